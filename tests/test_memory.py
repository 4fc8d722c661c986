"""Memory accounting (runtime/memory.py): the estimate made before loading is what loading takes; a -c / -np / draft
combination that cannot fit is refused before anything is allocated, with the numbers; the run summary, --json and
the text log give the bytes of weights and KV cache of every model and head; the suffix drafter's token store is
estimated at its bounds, measured as it grows, and shown in the same places and the server's start line."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType
from rich.console import Console

from spec_cli.cli.output import memory_table
from spec_cli.errors import SpecCliError
from spec_cli.model.gguf_file import GGUFFile
from spec_cli.options import SUFFIX_CACHE_TOKENS
from spec_cli.runtime import memory
from spec_cli.runtime.engine import EngineOptions, head_file
from tests.server_harness import make_session
from tests.tiny_dflash import write_tiny_dflash, write_tiny_dspark
from tests.tiny_eagle3 import write_tiny_eagle3
from tests.tiny_gguf import DIMS, write_tiny_gguf
from tests.tiny_mtp import write_tiny_mtp_gguf

SCRIPT = Path(sys.executable).with_name("spec-cli")
N_LAYER = 2  # tiny_gguf's default
INT32 = 4  # bytes of a token id in the suffix drafter's buffers
Q8_0 = GGMLQuantizationType.Q8_0
CASES = ["f32 target and draft", "q8_0 target and draft", "mtp head", "eagle3 head", "dflash head", "dspark head",
         "dflash head, q8_0 target"]


def kv_bytes(n_ctx: int, n_seq: int = 1, n_layer: int = N_LAYER) -> int:
    """K and V of every layer: [n_seq, kv_heads, n_ctx / n_seq + 1, head_dim] float32 (the CPU's activations)."""
    return 2 * n_layer * n_seq * DIMS["n_head_kv"] * (n_ctx // n_seq + 1) * DIMS["head_dim"] * 4


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_model_path, tiny_draft_path):
    d = tmp_path_factory.mktemp("memory")
    target4 = write_tiny_gguf(d / "target4.gguf", arch="llama", seed=11, n_layer=4)
    q8_target4 = write_tiny_gguf(d / "q8_target4.gguf", arch="llama", seed=11, n_layer=4, qtype=Q8_0)
    return {
        "f32 target and draft": (tiny_model_path, "draft-simple", tiny_draft_path),
        "q8_0 target and draft": (write_tiny_gguf(d / "q8.gguf", seed=0, qtype=Q8_0), "draft-simple",
                                  write_tiny_gguf(d / "q8d.gguf", seed=0, perturb=0.5, qtype=Q8_0)),
        "mtp head": (write_tiny_mtp_gguf(d / "mtp.gguf"), "draft-mtp", None),
        "eagle3 head": (target4, "draft-eagle3", write_tiny_eagle3(d / "head.gguf", target4).path),
        "dflash head": (target4, "draft-dflash", write_tiny_dflash(d / "dflash.gguf", target4, n_draft=150).path),
        "dspark head": (target4, "draft-dspark", write_tiny_dspark(d / "dspark.gguf", target4)[0].path),
        "dflash head, q8_0 target": (q8_target4, "draft-dflash",
                                     write_tiny_dflash(d / "q8_dflash.gguf", q8_target4).path),
    }


@pytest.mark.parametrize("case", CASES)
def test_the_estimate_is_what_loading_takes(models, case):
    target, types, draft = models[case]
    session = make_session(target, 2, types, draft, n_ctx_slot=300)
    opts = EngineOptions(model=str(target), model_draft=str(draft) if draft else None, n_ctx=600, n_seq=2,
                         device="cpu", spec=session.spec)
    draft_file = GGUFFile(draft) if types == "draft-simple" else None
    target_file = GGUFFile(target)
    parts = memory.estimate(opts, target_file, draft_file, head_file(opts, target_file))
    estimated = {p.name: p.as_dict() for p in parts}
    loaded = memory.measured(session.engine, session.chain.drafters)
    assert estimated.keys() == loaded.keys() - {"total"}
    for name, part in estimated.items():
        assert part["kv"] == loaded[name]["kv"] and part["devices"] == loaded[name]["devices"]
        assert part["weights"] == pytest.approx(loaded[name]["weights"], rel=0.01), name


def test_a_combination_that_does_not_fit_is_refused_with_its_numbers(models, monkeypatch):
    target, _, draft = models["f32 target and draft"]
    opts = EngineOptions(model=str(target), model_draft=str(draft), n_ctx=4096, n_seq=4, device="cpu")
    parts = memory.estimate(opts, GGUFFile(target), GGUFFile(draft), None)
    target_only = sum(parts[0].weights.values()) + sum(parts[0].kv.values())
    monkeypatch.setattr(memory, "available", lambda device: target_only)
    memory.check_fits(parts[:1], opts)  # the target alone fits
    with pytest.raises(SpecCliError) as e:
        memory.check_fits(parts, opts)
    message = str(e.value)
    assert "\n" not in message and "-c 4096 -np 4" in message and "leave out the draft" in message
    for what, n in (("target KV cache", parts[0].kv["cpu"]), ("draft weights", parts[1].weights["cpu"])):
        assert f"{what} {memory.size(n)}" in message
    assert "is free" in message and memory.size(target_only) in message


def spec_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout)


def test_run_refuses_a_context_that_cannot_fit_before_allocating(tiny_model_path):
    r = spec_cli("run", "-m", str(tiny_model_path), "-c", "4000000000", "-p", "hi", "-n", "1", "--temp", "0")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    assert lines[0].startswith("error: not enough memory on cpu: -c 4000000000 -np 1 needs ")
    assert f"target KV cache {memory.size(kv_bytes(4_000_000_000))}" in lines[0] and "is free" in lines[0]


def test_the_server_refuses_slots_and_a_draft_that_cannot_fit(tiny_model_path, tiny_draft_path):
    r = spec_cli("server", "-m", str(tiny_model_path), "-md", str(tiny_draft_path), "-c", "2000000000", "-np", "4",
                 "--port", "1")  # refused before it would bind
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert "-np 4" in r.stderr and "draft KV cache" in r.stderr and "leave out the draft" in r.stderr


def test_json_and_the_summaries_give_weights_and_kv_per_model(tiny_model_path, tiny_draft_path):
    args = ["-m", str(tiny_model_path), "-md", str(tiny_draft_path), "-c", "512", "-p", "the cat sat", "-n", "4",
            "--temp", "0"]
    out = json.loads(spec_cli("run", *args, "--json").stdout)["memory"]
    file_bytes = {p: sum(t.n_bytes for t in GGUFFile(p).tensors.values()) for p in (tiny_model_path, tiny_draft_path)}
    output_rows = GGUFFile(tiny_draft_path).tensors["output.weight"].n_bytes  # the draft vocabulary: all of them
    assert out["target"] == {"devices": ["cpu"], "weights": file_bytes[tiny_model_path], "kv": kv_bytes(512),
                             "store": 0}
    assert out["draft"] == {"devices": ["cpu"], "weights": file_bytes[tiny_draft_path] + 2 * output_rows,
                            "kv": kv_bytes(512), "store": 0}
    assert out["total"] == {"weights": out["target"]["weights"] + out["draft"]["weights"], "kv": 2 * kv_bytes(512),
                            "store": 0}

    table = spec_cli("run", *args).stderr
    assert "memory" in table and f"{kv_bytes(512) / 2**20:.1f}" in table
    text = spec_cli("speculative-simple", *args, "--log-format", "text").stderr
    assert f"memory: target      weights = {file_bytes[tiny_model_path] / 2**20:9.2f} MiB, KV cache = " in text
    assert "memory: draft " in text


def suffix_bound(cache_tokens: int, n_seq: int, n_ctx_seq: int) -> int:
    """The shared outputs' budget and each sequence's context with id_last's slot, one int32 a token."""
    return INT32 * (cache_tokens + n_seq * (n_ctx_seq + 1))


def test_the_suffix_store_is_estimated_at_its_bounds_and_measured_as_it_grows(tiny_model_path):
    session = make_session(tiny_model_path, 2, "suffix", n_ctx_slot=64, suffix_cache_tokens=40)
    opts = EngineOptions(model=str(tiny_model_path), n_ctx=128, n_seq=2, device="cpu", spec=session.spec)
    parts = {p.name: p.as_dict() for p in memory.estimate(opts, GGUFFile(tiny_model_path), None, None)}
    bound = suffix_bound(40, 2, 64)
    assert parts[memory.SUFFIX_PART] == {"devices": ["cpu"], "weights": 0, "kv": 0, "store": bound}

    [drafter] = session.chain.drafters

    def measured() -> dict:
        out = memory.measured(session.engine, session.chain.drafters)
        assert out["total"]["store"] == out[memory.SUFFIX_PART]["store"]
        return out[memory.SUFFIX_PART]

    assert measured() == {"devices": ["cpu"], "weights": 0, "kv": 0, "store": 0}
    drafter.begin(0, list(range(50)))
    drafter.begin(0, list(range(64)))  # a sequence filling its context: its buffer grows to it, no further
    for n in (30, 30, 30):
        drafter.end(0, list(range(n)))  # one 30-token output (and its separator) fits the 40-token budget
    assert measured()["store"] == INT32 * ((64 + 1) + (30 + 1))
    drafter.begin(1, list(range(64)))
    assert measured()["store"] == INT32 * (2 * (64 + 1) + 30 + 1) <= bound


def test_a_suffix_store_that_cannot_fit_is_refused_before_loading(tiny_model_path):
    r = spec_cli("run", "-m", str(tiny_model_path), "--spec-type", "suffix", "--spec-suffix-cache-tokens",
                 str(10**13), "-c", "512", "-p", "hi", "-n", "1")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    assert f"suffix drafter store {memory.size(suffix_bound(10**13, 1, 512))}" in lines[0]
    assert "lower -c, --spec-suffix-cache-tokens or -np" in lines[0]


def test_json_and_the_summaries_give_the_suffix_store(tiny_model_path):
    args = ["-m", str(tiny_model_path), "--spec-type", "suffix", "-c", "512", "-p", "the cat sat", "-n", "8",
            "--temp", "0"]
    run = json.loads(spec_cli("run", *args, "--json").stdout)
    out = run["memory"]
    store = out[memory.SUFFIX_PART]
    assert store["devices"] == ["cpu"] and (store["weights"], store["kv"]) == (0, 0)
    held = INT32 * (run["predicted_n"] + 1 + run["prompt_n"])  # the output with its separator, the prompt's text
    assert held <= store["store"] <= suffix_bound(SUFFIX_CACHE_TOKENS, 1, 512)
    assert out["total"]["store"] == store["store"]
    console = Console(width=200, record=True)
    console.print(memory_table(out))
    table = console.export_text()
    assert "store MiB" in table and f"{store['store'] / 2**20:.1f}" in table

    text = spec_cli("speculative-simple", *args, "--log-format", "text").stderr
    assert "memory: suffix drafter weights =      0.00 MiB, KV cache =      0.00 MiB, store = " in text
    assert "memory: target      weights = " in text and ", store =      0.00 MiB" in text


def test_the_server_start_line_gives_the_suffix_store_at_its_bounds(tiny_model_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([str(SCRIPT), "server", "-m", str(tiny_model_path), "--spec-type", "suffix", "-np", "2",
                             "-c", "512", "--port", str(port)], stderr=subprocess.PIPE, text=True)
    try:
        line = next(line for line in proc.stderr if line.startswith("spec-cli server: "))
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert line.rstrip().endswith(f", suffix store {memory.size(suffix_bound(SUFFIX_CACHE_TOKENS, 2, 256))} when full")
