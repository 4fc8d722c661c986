"""scripts/compare_peers.py end to end on the tiny models (llama.cpp side left out: the tiny GGUF is not a model
llama.cpp can load, and llama-cpp-python is optional)."""

from __future__ import annotations

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
         "--no-llama-cpp", "--compiled"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    table = "\n".join(lines)
    for name in ("plain", "plain --compile on", "ngram-simple draft-max 4", "draft-simple draft-max auto"):
        assert f"spec-cli   {name}" in table
    assert "draft-simple mean acc len" in table  # per-drafter statistics pooled over the runs
    assert lines[-1] == "spec-cli best / llama.cpp best: n/a"
