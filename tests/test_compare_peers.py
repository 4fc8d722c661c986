"""scripts/compare_peers.py end to end on the tiny models (llama.cpp side left out: the tiny GGUF is not a model
llama.cpp can load, and llama-cpp-python is optional)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "compare_peers.py"


def test_compare_peers_runs_every_configuration_and_ends_with_the_ratio_line(tiny_model_path, tiny_close_draft_path):
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "-m", str(tiny_model_path), "-md", str(tiny_close_draft_path), "--n-prompts", "1",
         "-n", "8", "--rounds", "1", "-t", "1", "--spec", "ngram-simple:4", "--spec", "draft-simple:auto",
         "--no-llama-cpp"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    table = "\n".join(lines)
    for name in ("plain", "ngram-simple draft-max 4", "draft-simple draft-max auto"):
        assert f"spec-cli   {name}" in table
    assert "draft-simple mean acc len" in table  # per-drafter statistics pooled over the runs
    assert lines[-1] == "spec-cli best / llama.cpp best: n/a"


def test_configurations_run_back_to_back_per_prompt_and_take_turns_going_first():
    spec = importlib.util.spec_from_file_location("compare_peers", SCRIPT)
    cp = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = cp  # its dataclasses look their module up
    spec.loader.exec_module(cp)
    calls = []

    def runner(name):
        def run(prompt):
            calls.append((name, prompt[0]))
            return cp.Run(1, 1.0, {})
        return run

    configs = [cp.Config("spec-cli", n, runner(n)) for n in ("plain", "a", "b")]
    cp.measure(configs, [[0], [1], [2]], rounds=2)
    timed = calls[3:]  # after the warmup (each configuration once)
    order = [[n for n, _ in timed[i:i + 3]] for i in range(0, len(timed), 3)]
    assert [p for _, p in timed[::3]] == [0, 1, 2, 0, 1, 2]  # a prompt's configurations run back to back
    assert [o[0] for o in order] == ["plain", "b", "plain", "b", "plain", "b"]
    assert all(sorted(o) == ["a", "b", "plain"] for o in order)
    assert all(len(c.runs) == 2 and len(c.runs[0]) == 3 for c in configs)
