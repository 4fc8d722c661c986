"""GET /props through a real uvicorn server: llama-server's fields, the speculative settings, each slot's draft counters
and drafter state, the memory of every model and of the suffix drafter's store, and the vocabulary bridge of a draft
model with another vocabulary."""

from __future__ import annotations

import httpx
import pytest

from spec_cli.model.gguf_file import GGUFFile
from spec_cli.options import SUFFIX_CACHE_TOKENS
from spec_cli.runtime.memory import SUFFIX_PART
from spec_cli.server import ServerSettings
from spec_cli.text.tokenizer import Tokenizer
from tests.server_harness import N_CTX_SLOT, PROMPTS, LiveServer, make_session
from tests.test_memory import kv_bytes
from tests.tiny_gguf import N_VOCAB, RENAMED

INT32 = 4  # bytes of a token id in the suffix drafter's buffers


@pytest.fixture(scope="module")
def served(tiny_model_path, tiny_close_draft_path):
    session = make_session(tiny_model_path, n_seq=2, spec_types="ngram-mod,draft-simple", draft=tiny_close_draft_path)
    settings = ServerSettings(alias="tiny", api_key="secret", metrics=True)
    with LiveServer(session, settings) as srv, httpx.Client(base_url=srv.url, timeout=60,
                                                            headers={"X-Api-Key": "secret"}) as c:
        yield c


def test_props_has_llama_servers_fields(served, tiny_model_path):
    p = served.get("/props").json()
    meta = GGUFFile(tiny_model_path).metadata
    tok = Tokenizer.from_metadata(meta)
    assert p["total_slots"] == 2 and p["model_alias"] == "tiny" and p["model_path"] == str(tiny_model_path)
    assert p["chat_template"] == meta["tokenizer.chat_template"]
    assert (p["bos_token"], p["eos_token"]) == (tok.token_to_piece(tok.bos_id).decode(),
                                                tok.token_to_piece(tok.eos_id).decode())
    assert p["build_info"].startswith("spec-cli ") and p["modalities"] == {"vision": False, "audio": False}
    assert (p["endpoint_slots"], p["endpoint_metrics"], p["is_sleeping"]) == (False, True, False)
    defaults = p["default_generation_settings"]
    assert defaults["n_ctx"] == N_CTX_SLOT and defaults["is_processing"] is False
    params = defaults["params"]
    assert (params["temperature"], params["top_k"], params["n_predict"]) == (0.8, 40, -1)
    assert (params["speculative.n_max"], params["speculative.n_min"], params["speculative.p_min"]) == (6, 0, 0.0)


def test_props_gives_the_speculative_settings(served, tiny_close_draft_path):
    spec = served.get("/props").json()["speculative"]
    assert spec == {"types": ["ngram-mod", "draft-simple"], "n_max": 6, "n_max_auto": False, "n_min": 0, "p_min": 0.0,
                    "verify": "auto", "select": "priority", "model_draft": str(tiny_close_draft_path)}


def test_props_gives_each_slots_draft_counters_and_drafter_state(served):
    before = served.get("/props").json()["slots"][1]["speculative"]
    drafted = accepted = 0
    for text in PROMPTS[:3]:
        r = served.post("/completion", json={"prompt": text, "n_predict": 16, "temperature": 0, "id_slot": 1})
        timings = r.json()["timings"]
        drafted, accepted = drafted + timings.get("draft_n", 0), accepted + timings.get("draft_n_accepted", 0)
    slots = served.get("/props").json()["slots"]
    after = slots[1]["speculative"]
    assert drafted > 0 and after["n_drafted"] - before["n_drafted"] == drafted
    assert after["n_accepted"] - before["n_accepted"] == accepted
    assert slots[1]["n_past"] > 0 and slots[1]["is_processing"] is False and slots[1]["n_ctx"] == N_CTX_SLOT
    assert after["drafters"]["draft-simple"]["n_kv"] > 0 and after["drafters"]["ngram-mod"]["pool_used"] > 0
    assert [s["id"] for s in slots] == [0, 1]


def test_props_gives_the_memory_of_each_model(served):
    memory = served.get("/props").json()["memory"]
    assert set(memory) == {"target", "draft", "total"}
    for name in ("target", "draft"):
        assert memory[name]["kv"] == kv_bytes(2 * N_CTX_SLOT, n_seq=2) and memory[name]["weights"] > 0
    assert memory["total"]["kv"] == 2 * kv_bytes(2 * N_CTX_SLOT, n_seq=2)


@pytest.fixture(scope="module")
def bridged(tiny_model_path, tiny_other_vocab_path):
    """A server drafting with suffix and with a draft model of another vocabulary (tiny_gguf.write_other_vocab)."""
    session = make_session(tiny_model_path, n_seq=2, spec_types="suffix,draft-simple", draft=tiny_other_vocab_path)
    with LiveServer(session) as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        yield c


def complete(client: httpx.Client, prompt: str, spec_type: str, n_predict: int = 32) -> dict:
    body = {"prompt": prompt, "n_predict": n_predict, "temperature": 0, "id_slot": 0,
            "speculative": {"types": [spec_type]}}
    r = client.post("/completion", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_props_gives_the_vocabulary_bridge_and_its_mapped_tokens(bridged):
    """RENAMED's tokens have no counterpart; 119 ('w') is the tiny target's most frequent output token: drafts after
    "The quick brown fox jumps" end at it."""
    before = bridged.get("/props").json()["speculative"]["draft_vocabulary"]
    assert before["shared_tokens"] == N_VOCAB - len(RENAMED)
    assert 0.5 * before["common_of"] <= before["common_shared"] <= before["common_of"] and before["common_of"] > 0
    drafted = 0
    for prompt in ("abc abc abc abc abc", "The quick brown fox jumps"):
        drafted += complete(bridged, prompt, "draft-simple")["timings"]["draft_n"]
    after = bridged.get("/props").json()["speculative"]["draft_vocabulary"]
    assert set(after) == {"shared_tokens", "common_shared", "common_of", "n_mapped", "n_unmapped"}
    assert [after[k] for k in ("shared_tokens", "common_shared", "common_of")] == \
        [before[k] for k in ("shared_tokens", "common_shared", "common_of")]  # the bridge's, fixed at load
    n_mapped, n_unmapped = after["n_mapped"] - before["n_mapped"], after["n_unmapped"] - before["n_unmapped"]
    assert drafted > 0 and n_mapped >= drafted and n_unmapped > 0


def test_props_gives_the_suffix_stores_memory_as_it_grows(bridged):
    """Each finished request's output joins the shared store, one int32 a token and one for its separator; the slot's
    own text stays within the buffer its first request allocated."""
    complete(bridged, PROMPTS[0], "suffix")
    before = bridged.get("/props").json()["memory"]
    out = complete(bridged, PROMPTS[1], "suffix")
    after = bridged.get("/props").json()["memory"]
    store = after[SUFFIX_PART]
    assert store["devices"] == ["cpu"] and (store["weights"], store["kv"]) == (0, 0)
    assert store["store"] - before[SUFFIX_PART]["store"] == INT32 * (out["tokens_predicted"] + 1)
    assert store["store"] <= INT32 * (SUFFIX_CACHE_TOKENS + 2 * (N_CTX_SLOT + 1))  # runtime/memory.py's estimate
    assert after["total"]["store"] == store["store"]
    assert {k: v for k, v in after.items() if k not in (SUFFIX_PART, "total")} == \
        {k: v for k, v in before.items() if k not in (SUFFIX_PART, "total")}


def test_props_needs_the_api_key(served):
    assert httpx.get(str(served.base_url) + "/props").status_code == 401
