"""-tp N (spec_cli/model/parallel/tensor_parallel.py): a target sharded over 2 CPU ranks (gloo) decodes greedily exactly as the
whole target, plain and with a speculative chain (rollback on every shard), 1 and 4 sequences; bad -tp values and
a killed rank end the command with a one-line error. Each -tp 2 run is a process of its own (one group per
process): tests/tp_driver.py, or the installed `spec-cli` console script."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as T

from spec_cli.errors import UsageError
from spec_cli.model.parallel import comm as tp_comm
from tests.tiny_gguf import K_DIMS, write_tiny_gguf
from tests.tp_driver import greedy_outputs

SCRIPT = Path(sys.executable).with_name("spec-cli")
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """The subprocesses keep --draft-max auto's calibrations in the test's folder, not the user's cache."""
    monkeypatch.setenv("SPEC_CLI_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("SPEC_CLI_DEBUG", raising=False)


def driver(*args) -> dict:
    out = subprocess.run([sys.executable, "-m", "tests.tp_driver", *map(str, args)], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def cli(*args, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([str(SCRIPT), *map(str, args)], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("n_seq", [1, 4])
@pytest.mark.parametrize("chain", ["", "ngram-simple,draft-simple"])
def test_two_ranks_equal_one(tiny_model_path, tiny_draft_path, chain, n_seq):
    draft = tiny_draft_path if chain else "-"
    whole = greedy_outputs(str(tiny_model_path), None if chain == "" else str(draft), chain, n_seq, 1)
    sharded = driver(tiny_model_path, draft, chain or "-", n_seq, 2)
    assert sharded == whole
    assert sharded["rounds"][0] == sharded["rounds"][1]
    assert (sharded["accepted"] > 0) == bool(chain)  # a chain that accepted nothing would prove nothing


@pytest.fixture(scope="module")
def q8_qwen2(tmp_path_factory) -> Path:
    """Q8_0 blocks (columns cut on 32-value boundaries) and q/k/v biases."""
    return write_tiny_gguf(tmp_path_factory.mktemp("tp") / "q8-qwen2.gguf", arch="qwen2", seed=3, qtype=T.Q8_0)


@pytest.fixture(scope="module")
def q4k_model(tmp_path_factory) -> Path:
    """Q4_K: the 2 ranks' wo columns (128 each) fall inside 256-value blocks, so wo stays whole (inputs gathered)."""
    return write_tiny_gguf(tmp_path_factory.mktemp("tp") / "q4k.gguf", arch="llama", seed=0, qtype=T.Q4_K,
                           dims=K_DIMS)


def generate_json(model: Path, tp: int, *extra) -> tuple[dict, str]:
    # -dev cpu: on a machine with one GPU, auto would put -tp 1 on CUDA and the 2 ranks on the CPU (rank_device)
    out = cli("run", "-m", model, "-p", "hello world hello", "-n", 24, "--temp", 0, "--json", "-tp", tp, "-dev", "cpu",
              *extra)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout), out.stderr


@pytest.mark.parametrize("model", ["q8_qwen2", "q4k_model"])
def test_cli_two_ranks_equal_one(model, request):
    path = request.getfixturevalue(model)
    whole, _ = generate_json(path, 1)
    sharded, err = generate_json(path, 2, "--spec-type", "ngram-simple")
    assert sharded["content"] == whole["content"]
    assert ("stays whole on every rank" in err) == (model == "q4k_model")


def test_long_flag_and_bad_values(tiny_model_path):
    run = ("run", "-m", tiny_model_path, "-p", "hi", "-n", 2, "--temp", 0)
    assert cli(*run, "--tensor-parallel", 2).returncode == 0
    bad = cli(*run, "-tp", 3)
    assert bad.returncode == 1
    assert bad.stderr.strip() == "error: -tp 3: the model's 2 KV heads (4 attention heads) do not divide over 3 ranks"
    assert cli(*run, "-tp", 0).returncode == 2
    assert "-ngl cannot be combined" in cli(*run, "-tp", 2, "-ngl", 1).stderr


def test_bench_takes_tp(tiny_model_path):
    out = cli("bench", "-m", tiny_model_path, "-p", 8, "-n", 4, "-r", 1, "-o", "json", "-tp", 2)
    assert out.returncode == 0, out.stderr
    assert [row["n_gen"] for row in json.loads(out.stdout)] == [0, 4]


def _follower_of(pid: int) -> int:
    """The spawned rank among a process's children (not multiprocessing's resource tracker)."""
    for _ in range(200):
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        for child in children:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
            if b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
                return int(child)
        time.sleep(0.05)
    raise AssertionError("no spawned rank")


def test_killed_rank_ends_the_command(tiny_model_path):
    """A rank killed mid-generation: rank 0 stops with one line and exit code 1, well within the timeout."""
    args = ("run", "-m", tiny_model_path, "-p", "hello", "-n", 100000, "--ignore-eos", "-c", 100000, "--temp", 0,
            "-tp", 2)
    proc = subprocess.Popen([str(SCRIPT), *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        follower = _follower_of(proc.pid)
        proc.stdout.read(20)  # generating: both ranks are in the loop
        killed = time.monotonic()
        os.kill(follower, signal.SIGKILL)
        _, err = proc.communicate(timeout=tp_comm.TIMEOUT.seconds)
    finally:
        proc.kill()
    assert time.monotonic() - killed < 30
    assert proc.returncode == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: tensor parallel: a rank stopped"), err


@pytest.mark.real_model
def test_real_model_two_ranks(real_model_path):
    model = real_model_path("qwen2.5-coder-0.5b")
    args = ("run", "-m", model, "-p", "def fibonacci(n):", "-n", 8, "--temp", 0, "-c", 256, "--json")
    whole, sharded = cli(*args), cli(*args, "-tp", 2)
    assert sharded.returncode == 0, sharded.stderr
    assert json.loads(sharded.stdout)["content"] == json.loads(whole.stdout)["content"]


def test_rank_devices_need_a_gpu_per_rank(monkeypatch):
    """One GPU and -tp 2: auto runs every rank on the CPU (never rank 1 on a cuda:1 that does not exist); a CUDA
    device named explicitly is a usage error for the rank without a GPU."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    for rank in ("0", "1"):
        monkeypatch.setenv("LOCAL_RANK", rank)
        assert tp_comm.rank_device("auto") == torch.device("cpu")
        assert tp_comm.rank_device("cpu") == torch.device("cpu")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert tp_comm.rank_device("cuda") == torch.device("cuda", 0)
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(UsageError, match="rank 1 needs cuda:1 but this machine has 1 CUDA device"):
        tp_comm.rank_device("cuda")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert tp_comm.rank_device("auto") == torch.device("cuda", 0)
