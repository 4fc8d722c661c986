"""Exit codes of every command through the installed `spec-cli` console script, in a subprocess: 0 ok, 1 runtime
error, 2 usage error, and a one-line error without a traceback. In-process runners (typer's CliRunner, main()
called from a test) cannot see what the entry point does with the code.

The invocations run concurrently in one fixture (each pays ~2 s of torch import), the tests then check each one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from spec_cli.bench.params import BenchParams
from spec_cli.bench.runner import run_bench

SCRIPT = Path(sys.executable).with_name("spec-cli")
PROMPT = "abc abc abc abc abc abc"


def cases(model: str, tmp: Path) -> dict[str, tuple[list[str], int, str]]:
    """name -> (arguments, exit code, text stderr must contain)."""
    corpus, cache_a, cache_b, fast = tmp / "corpus.txt", tmp / "a.bin", tmp / "b.bin", tmp / "fast.jsonl"
    missing = str(tmp / "missing.gguf")
    gen = ["-m", model, "-p", PROMPT, "-n", "2", "--temp", "0"]
    bench = ["bench", "-m", model, "-p", "0", "-n", "2", "-r", "1", "-t", "1", "-dev", "cpu", "--no-warmup", "-o",
             "jsonl"]
    return {
        "unknown-command": (["bogus"], 2, "No such command"),
        "run-ok": (["run", *gen], 0, "generation"),
        "run-runtime": (["run", "-m", missing, "-p", "x"], 1, "model file not found"),
        "run-usage": (["run", *gen, "-c", "-1"], 2, "-c must be >= 0"),
        "speculative-ok": (["speculative-simple", *gen, "--spec-type", "ngram-simple"], 0, "speculation"),
        "speculative-runtime": (["speculative-simple", *gen, "--spec-type", "mtp"], 1, "MTP"),
        # a model without a models.toml draft, no drafter asked for (nothing is loaded)
        "speculative-usage": (["speculative-simple", "-m", "smollm2-135m", "-p", "Hello", "-n", "8"], 2,
                              "nothing to speculate with"),
        "lookup-ok": (["lookup", *gen], 0, "n_accept"),
        "lookup-runtime": (["lookup", *gen, "-lcs", str(tmp / "missing.bin")], 1, "cannot read lookup cache"),
        "lookup-usage": (["lookup", *gen, "--draft-max", "many"], 2, "--draft-max"),
        "lookup-create-ok": (["lookup-create", "-m", model, "-f", str(corpus), "-lcs", str(tmp / "c.bin")], 0,
                             "bigrams"),
        "lookup-create-runtime": (["lookup-create", "-m", model, "-f", str(tmp / "missing.txt"), "-lcs",
                                   str(tmp / "d.bin")], 1, "cannot read"),
        "lookup-create-usage": (["lookup-create", "-m", model, "-f", str(corpus)], 2, "-lcs"),
        "lookup-merge-ok": (["lookup-merge", str(cache_a), str(cache_b), str(tmp / "merged.bin")], 0, "merged"),
        "lookup-merge-runtime": (["lookup-merge", str(tmp / "missing.bin"), str(cache_b), str(tmp / "m2.bin")], 1,
                                 "cannot read lookup cache"),
        "lookup-merge-usage": (["lookup-merge", str(cache_a), str(tmp / "m3.bin")], 2, "at least two input files"),
        "lookup-stats-ok": (["lookup-stats", "-m", model, "-f", str(corpus), "-c", "16"], 0, "n_accept"),
        "lookup-stats-runtime": (["lookup-stats", "-m", missing, "-f", str(corpus)], 1, "model file not found"),
        "lookup-stats-usage": (["lookup-stats", "-m", model, "-f", str(corpus), "-c", "0"], 2, "-c must be >= 1"),
        "bench-ok": (bench, 0, ""),
        "bench-runtime": ([*bench, "-r", "3", "--baseline", str(fast), "--max-regression", "10"], 1,
                          "FAIL: 1 row(s) slower"),
        "bench-usage": (["bench", "-m", model, "-o", "xml"], 2, "-o must be md, csv"),
        "server-ok": (["server", "--help"], 0, ""),
        "server-runtime": (["server", "-m", missing], 1, "model file not found"),
        "server-usage": (["server", "-m", model, "-np", "0"], 2, "-np must be -1 (auto) or at least 1"),
        "mtp-train-ok": (["mtp-train", "--help"], 0, ""),
        "mtp-train-runtime": (["mtp-train", "-m", missing, "-o", str(tmp / "out.gguf")], 1, "model file not found"),
        "mtp-train-usage": (["mtp-train", "-m", model, "-o", str(tmp / "out.gguf"), "--steps", "0"], 2,
                            "--steps must be >= 1"),
        "models-ok": (["models", "list", "--json"], 0, ""),
        "models-runtime": (["models", "pull", "no-such-model"], 1, "unknown model"),
        "models-usage": (["models", "show"], 2, "Missing argument"),
    }


def write_inputs(model: str, tmp: Path) -> None:
    (tmp / "corpus.txt").write_text("Hello world, the cat sat on the mat.\n" * 8)
    (tmp / "a.bin").write_bytes(b"")  # an empty n-gram cache is a valid one
    (tmp / "b.bin").write_bytes(b"")
    # a baseline 100x faster than anything this machine does: the gate must fail
    rows = [r.to_dict() for r in run_bench(BenchParams(model=[model], n_prompt=[0], n_gen=[2], n_threads=[1],
                                                       devices=["cpu"], repetitions=3, warmup=False))]
    (tmp / "fast.jsonl").write_text("".join(
        json.dumps({**r, "samples_ts": [100 * t for t in r["samples_ts"]]}) + "\n" for r in rows))


@pytest.fixture(scope="module")
def results(tiny_model_path, tmp_path_factory) -> dict[str, tuple[subprocess.CompletedProcess, int, str]]:
    assert SCRIPT.exists(), f"{SCRIPT} is missing: pip install -e '.[test]'"
    tmp = tmp_path_factory.mktemp("exit-codes")
    model = str(tiny_model_path)
    write_inputs(model, tmp)
    env = {**os.environ, "SPEC_CLI_CACHE": str(tmp / "cache"), "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    env.pop("SPEC_CLI_DEBUG", None)

    def invoke(args: list[str]) -> subprocess.CompletedProcess:
        return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, timeout=300, env=env,
                              stdin=subprocess.DEVNULL)

    todo = cases(model, tmp)
    with ThreadPoolExecutor(max_workers=4) as pool:
        done = dict(zip(todo, pool.map(invoke, (args for args, _, _ in todo.values()))))
    return {name: (done[name], code, needle) for name, (_, code, needle) in todo.items()}


@pytest.mark.parametrize("name", list(cases("M", Path("."))))
def test_exit_code(results, name):
    proc, code, needle = results[name]
    assert proc.returncode == code, proc.stderr
    assert needle in proc.stderr
    assert "Traceback" not in proc.stderr
    if code == 1:  # runtime errors: exactly one line saying what went wrong (the gate prints its table first)
        assert proc.stderr.splitlines()[-1].startswith(("error:", "FAIL:")), proc.stderr
