"""POST /slots/{id}?action=save|restore|erase through a real uvicorn server: a slot saved, erased and restored (in the
same server or a fresh one) continues as if it had never been saved, drafter state included; file names stay inside
--slot-save-path; a damaged or foreign file is a clear 400 and the server goes on serving."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import httpx
import numpy as np
import pytest

from spec_cli.server import ServerSettings
from tests.server_harness import PROMPTS, LiveServer, make_session
from tests.tiny_eagle3 import write_tiny_eagle3
from tests.tiny_gguf import write_tiny_gguf

N_FIRST, N_SECOND = 48, 24
SMALL_MAPS = dict(ngram_map_k_size_n=2, ngram_map_k_size_m=8, ngram_map_k4v_size_n=2, ngram_map_k4v_size_m=8)


@pytest.fixture(scope="module")
def eagle3_pair(tmp_path_factory):
    """A 4-block tiny target and an EAGLE-3 head reading its layers 1, 2 and 3."""
    d = tmp_path_factory.mktemp("slot-eagle3")
    target = write_tiny_gguf(d / "target.gguf", arch="llama", seed=11, n_layer=4)
    return target, write_tiny_eagle3(d / "head.gguf", target, seed=0).path


@pytest.fixture
def chains(tiny_model_path, tiny_close_draft_path, eagle3_pair):
    """name -> a function opening a fresh session of that drafter chain."""
    return {
        "ngram-mod,draft-simple": lambda: make_session(tiny_model_path, spec_types="ngram-mod,draft-simple",
                                                       draft=tiny_close_draft_path),
        "n-gram family": lambda: make_session(tiny_model_path, spec_types="ngram-map-k,ngram-map-k4v,ngram-cache",
                                              **SMALL_MAPS),
        "draft-eagle3": lambda: make_session(eagle3_pair[0], spec_types="draft-eagle3", draft=eagle3_pair[1]),
    }


def complete(c: httpx.Client, prompt: list[int], n: int) -> dict:
    r = c.post("/completion", json={"prompt": prompt, "n_predict": n, "temperature": 0, "ignore_eos": True,
                                    "id_slot": 0, "return_tokens": True})
    assert r.status_code == 200, r.text
    return r.json()


def act(c: httpx.Client, action: str, filename: str | None = None, slot: int = 0) -> httpx.Response:
    return c.post(f"/slots/{slot}?action={action}", json={} if filename is None else {"filename": filename})


def drafters_state(c: httpx.Client) -> dict:
    return c.get("/props").json()["slots"][0]["speculative"]["drafters"]


def second_request(c: httpx.Client, first_prompt: list[int], first: dict) -> tuple[list[int], dict]:
    """The continuation of the first request's text: its tokens and timings."""
    out = complete(c, first_prompt + first["tokens"], N_SECOND)
    return out["tokens"], {k: out["timings"].get(k) for k in ("cache_n", "prompt_n", "draft_n", "draft_n_accepted")}


@pytest.mark.parametrize("chain", ["ngram-mod,draft-simple", "n-gram family", "draft-eagle3"])
def test_a_restored_slot_continues_as_if_never_saved(chains, chain, tmp_path):
    """Uninterrupted: request, continuation. Then request, save, erase, restore, continuation in one server, and
    restore, continuation in a fresh one: the same tokens, the same cached prefix, the same drafts and acceptances,
    and the same drafter state before the continuation."""
    settings = ServerSettings(slot_save_path=tmp_path)
    with LiveServer(chains[chain](), settings) as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        prompt = c.post("/tokenize", json={"content": PROMPTS[0], "add_special": True}).json()["tokens"]
        first = complete(c, prompt, N_FIRST)
        state = drafters_state(c)
        expected = second_request(c, prompt, first)
    assert expected[1]["draft_n"] > 0 and expected[1]["cache_n"] == len(prompt) + N_FIRST - 1

    with LiveServer(chains[chain](), settings) as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        assert complete(c, prompt, N_FIRST)["tokens"] == first["tokens"]
        saved = act(c, "save", "first.slot").json()
        assert saved["n_saved"] == len(prompt) + N_FIRST - 1
        assert saved["n_written"] == (tmp_path / "first.slot").stat().st_size
        assert act(c, "erase").json() == {"id_slot": 0, "n_erased": saved["n_saved"]}
        assert c.get("/props").json()["slots"][0]["n_past"] == 0
        restored = act(c, "restore", "first.slot").json()
        assert (restored["n_restored"], restored["n_read"]) == (saved["n_saved"], saved["n_written"])
        assert drafters_state(c) == state
        assert second_request(c, prompt, first) == expected

    with LiveServer(chains[chain](), settings) as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        assert act(c, "restore", "first.slot").status_code == 200
        assert drafters_state(c) == state
        assert second_request(c, prompt, first) == expected


@pytest.fixture(scope="module")
def server(tiny_model_path, tiny_close_draft_path, tmp_path_factory):
    """A server with a saved slot file `good.slot` in its --slot-save-path, and that directory's parent (outside)."""
    root = tmp_path_factory.mktemp("slots")
    settings = ServerSettings(slot_save_path=root / "saved", api_key="k")
    settings.slot_save_path.mkdir()
    session = make_session(tiny_model_path, n_seq=2, spec_types="ngram-mod,draft-simple", draft=tiny_close_draft_path,
                           n_ctx_slot=2048)  # room for a request that is still generating when the busy slot is tried
    with LiveServer(session, settings) as srv, httpx.Client(base_url=srv.url, timeout=60,
                                                            headers={"Authorization": "Bearer k"}) as c:
        complete(c, [1, 2, 3, 4, 5, 6], 12)
        assert act(c, "save", "good.slot").status_code == 200
        yield c, settings.slot_save_path


@pytest.mark.parametrize("name", ["../escape.slot", "/tmp/escape.slot", "sub/escape.slot", "..", ".", ".hidden",
                                  "", "a\\b", "x" * 256, "tab\tname", "nul\x00name", "é.slot"])
def test_a_file_name_that_could_leave_the_directory_is_refused(server, name):
    c, directory = server
    for action in ("save", "restore"):
        r = act(c, action, name)
        assert r.status_code == 400 and r.json()["error"]["param"] == "filename", r.text
    assert sorted(p.name for p in directory.iterdir()) == ["good.slot"]
    assert not (directory.parent / "escape.slot").exists()


def test_symbolic_links_are_not_followed(server):
    c, directory = server
    outside = directory.parent / "outside.slot"
    outside.write_bytes((directory / "good.slot").read_bytes())
    link = directory / "link.slot"
    link.symlink_to(outside)
    try:
        r = act(c, "restore", "link.slot")
        assert r.status_code == 400 and "symbolic link" in r.json()["error"]["message"]
        before = outside.read_bytes()
        assert act(c, "save", "link.slot").status_code == 200  # a new file in place of the link
        assert outside.read_bytes() == before and not link.is_symlink()
    finally:
        link.unlink()
        outside.unlink()


def valid_file(directory: Path) -> bytes:
    return (directory / "good.slot").read_bytes()


def rewritten(data: bytes, change) -> bytes:
    """The slot file `data` with its arrays passed through `change(dict) -> dict`, stored uncompressed."""
    with np.load(io.BytesIO(data), allow_pickle=False) as npz:
        arrays = change({k: npz[k] for k in npz.files})
    out = io.BytesIO()
    np.savez(out, **arrays)
    return out.getvalue()


def with_header(**changes):
    def change(arrays):
        header = {**json.loads(arrays["header"].tobytes()), **changes}
        return {**arrays, "header": np.frombuffer(json.dumps(header).encode(), dtype=np.uint8)}
    return change


def compressed(data: bytes) -> bytes:
    with np.load(io.BytesIO(data), allow_pickle=False) as npz:
        arrays = {k: npz[k] for k in npz.files}
    out = io.BytesIO()
    np.savez_compressed(out, **arrays)
    return out.getvalue()


def object_array(data: bytes) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        buf = io.BytesIO()
        np.save(buf, np.array([{"a": 1}], dtype=object), allow_pickle=True)
        z.writestr("header.npy", buf.getvalue())
    return out.getvalue()


BAD_FILES = {
    "truncated": (lambda d: d[: len(d) // 2], "not a slot file"),
    "random bytes": (lambda d: os.urandom(4096), "not a slot file"),
    "one flipped byte": (lambda d: d[:2000] + bytes([d[2000] ^ 0xFF]) + d[2001:], "not a slot file"),
    "no header": (lambda d: rewritten(d, lambda a: {k: v for k, v in a.items() if k != "header"}), "'header'"),
    "another magic": (lambda d: rewritten(d, with_header(magic="something else")), "not a slot file of spec-cli"),
    "another version": (lambda d: rewritten(d, with_header(version=99)), "version 99"),
    "another model": (lambda d: rewritten(d, with_header(model={"name": "other.gguf", "size": 1})), "other.gguf"),
    "other drafters": (lambda d: rewritten(d, with_header(types=["ngram-simple"])), "types"),
    "too long for a slot": (lambda d: rewritten(d, with_header(n_tokens=10**6)), "holds 1000000 tokens"),
    "a KV of another shape": (lambda d: rewritten(d, lambda a: {**a, "target/k0": a["target/k0"][:1]}), "'k0'"),
    "a drafter's state missing": (lambda d: rewritten(d, lambda a: {k: v for k, v in a.items()
                                                                     if not k.startswith("drafters/draft-simple/kv")}),
                                  "missing"),
    "token ids past the vocabulary": (lambda d: rewritten(d, lambda a: {**a, "tokens": a["tokens"] + 10**6}),
                                      "outside"),
    "compressed members": (compressed, "compressed"),
    "a pickled object": (object_array, "not a slot file"),
}


@pytest.mark.parametrize("kind", list(BAD_FILES))
def test_a_damaged_or_foreign_file_is_a_400_and_the_server_goes_on(server, kind):
    c, directory = server
    make, words = BAD_FILES[kind]
    (directory / "bad.slot").write_bytes(make(valid_file(directory)))
    try:
        assert act(c, "restore", "good.slot", slot=1).status_code == 200
        r = act(c, "restore", "bad.slot", slot=1)
        assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
        slot = c.get("/props").json()["slots"][1]
        if slot["n_past"] != 0:  # refused before anything was restored: the slot is as it was
            assert slot["n_past"] == c.get("/props").json()["slots"][0]["n_past"] or slot["n_past"] > 0
        else:  # refused half way: emptied, drafters included
            assert slot["speculative"]["drafters"]["draft-simple"] == {"n_kv": 0}
        assert act(c, "restore", "good.slot", slot=1).status_code == 200  # the slot and the server still work
        assert complete(c, [1, 2, 3], 4)["tokens"]
    finally:
        (directory / "bad.slot").unlink()


def test_a_missing_file_is_a_404_and_unknown_actions_and_slots_a_400(server):
    c, _ = server
    assert act(c, "restore", "nothing.slot").status_code == 404
    assert act(c, "rename", "good.slot").status_code == 400
    assert c.post("/slots/0", json={"filename": "good.slot"}).status_code == 400  # no action
    assert act(c, "save", "x.slot", slot=2).status_code == 400  # 2 slots: 0 and 1
    assert c.post("/slots/zero?action=erase", json={}).status_code == 400
    assert c.post("/slots/0?action=save", json={"filename": 7}).status_code == 400


def test_the_slot_routes_need_the_api_key(server):
    c, _ = server
    bare = httpx.Client(base_url=str(c.base_url), timeout=30)
    assert bare.post("/slots/0?action=erase", json={}).status_code == 401
    assert bare.get("/props").status_code == 401


def test_a_busy_slot_is_not_saved_restored_or_erased(server):
    c, _ = server
    body = {"prompt": [1, 2, 3], "n_predict": 5000, "temperature": 0, "ignore_eos": True, "id_slot": 0,
            "stream": True}
    with c.stream("POST", "/completion", json=body) as r:
        lines = r.iter_lines()  # kept: httpx closes the response when the iterator is dropped
        next(lines)  # generating
        for action, name in (("save", "busy.slot"), ("restore", "good.slot"), ("erase", None)):
            refused = act(c, action, name)
            assert refused.status_code == 409 and "busy" in refused.json()["error"]["message"]


def test_without_a_slot_save_path_the_actions_are_not_supported(tiny_model_path):
    with LiveServer(make_session(tiny_model_path), ServerSettings()) as srv:
        r = httpx.post(srv.url + "/slots/0?action=erase", json={})
        assert r.status_code == 501 and "--slot-save-path" in r.json()["error"]["message"]


def test_a_drafter_without_saved_state_refuses_the_save(tiny_model_path, tmp_path):
    """A plugin drafter that implements no save_state: the save says which and why, nothing is written."""
    from tests.test_toy_drafter import RepeatLast

    with LiveServer(make_session(tiny_model_path, spec_types=RepeatLast.name),
                    ServerSettings(slot_save_path=tmp_path)) as srv:
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            complete(c, [1, 2, 3], 4)
            r = act(c, "save", "toy.slot")
    assert r.status_code == 501 and "'toy-repeat' does not implement save_state" in r.json()["error"]["message"]
    assert list(tmp_path.iterdir()) == []


def test_the_server_command_refuses_a_slot_save_path_it_cannot_create(tiny_model_path, tmp_path):
    """Before the model loads: exit 1, one line."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    r = subprocess.run([str(Path(sys.executable).with_name("spec-cli")), "server", "-m", str(tiny_model_path),
                        "--slot-save-path", str(blocker / "slots"), "--port", "1"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 1 and r.stderr.count("\n") == 1
    assert r.stderr.startswith("error: --slot-save-path ") and "cannot create the directory" in r.stderr
