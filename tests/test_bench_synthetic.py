"""bench --spec-accept P: the synthetic drafter's drafts are accepted at the drawn lengths (rate 1: all; 0: none;
per-position rates: nothing past a 0), the output stays the target's greedy output, the draws are the seed's, and the
rows say the acceptance was synthetic; through the installed `spec-cli`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from spec_cli.speculative.base import DraftParams
from spec_cli.speculative.synthetic import SyntheticDrafter

SCRIPT = Path(sys.executable).with_name("spec-cli")


def bench(model, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(SCRIPT), "bench", "-m", str(model), "--prompt-set", "qa", "-n", "24", "-r", "2",
                           "--draft-max", "4", *flags], capture_output=True, text=True, timeout=600,
                          stdin=subprocess.DEVNULL)


def rows_of(r: subprocess.CompletedProcess) -> list[dict]:
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_drafts_are_accepted_at_the_drawn_lengths_and_the_output_is_the_targets(tiny_model_path):
    rows = rows_of(bench(tiny_model_path, "--spec-accept", "1,0,1/1/0", "-o", "json"))
    plain, *synthetic = rows
    assert plain["spec_type"] == "none" and plain["spec_accept"] is None
    by_rate = {r["spec_accept"]: r for r in synthetic}
    assert set(by_rate) == {"1", "0", "1/1/0"} and {r["spec_type"] for r in synthetic} == {"synthetic"}
    for r in synthetic:
        assert r["text_hash"] == plain["text_hash"]  # the target's greedy output, token for token
        assert r["n_drafts"] > 0
    assert by_rate["1"]["acceptance"] == 100.0
    assert by_rate["0"]["n_accepted"] == 0 and by_rate["0"]["n_drafted"] > 0
    per_pos = by_rate["1/1/0"]["acc_per_pos"]
    assert per_pos[0] == 1.0 and not any(per_pos[2:])  # position 1 always accepted, position 3 never


def test_draws_are_the_seeds(tiny_model_path):
    runs = [rows_of(bench(tiny_model_path, "--spec-accept", "0.6", "-o", "json", "-s", seed))[1]
            for seed in ("7", "7", "8")]
    first, again, other = ((r["n_drafted"], r["n_accepted"], r["acc_per_pos"]) for r in runs)
    assert first == again and first != other


def test_the_md_table_marks_synthetic_rows(tiny_model_path):
    r = bench(tiny_model_path, "--spec-accept", "0.9/0.5", "-o", "md", "-r", "1")
    assert r.returncode == 0, r.stderr
    [row] = [line for line in r.stdout.splitlines() if "| synthetic" in line]
    assert "0.9/0.5" in row and "spec_accept" in r.stdout


@pytest.mark.parametrize("flags,needle", [(["--spec-accept", "1.5"], "--spec-accept must be rates in [0, 1]"),
                                          (["--spec-accept", "0.9/x"], "--spec-accept must be a rate in [0, 1]"),
                                          (["--spec-accept", "0.9", "--temp", "0.7"], "needs --temp 0")])
def test_bad_rates_and_sampling_are_usage_errors(tiny_model_path, flags, needle):
    r = bench(tiny_model_path, *flags)
    assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr


def test_a_history_that_left_the_reference_gets_no_draft():
    drafter = SyntheticDrafter([1.0], 0, {(1, 2): [3, 4, 5, 6]}, n_vocab=10, n_seq=1)
    drafter.begin(0, [1, 2])
    p = DraftParams(seq=0, n_max=8, pos0=2, id_last=3, prompt=[1, 2])
    drafter.draft([p])
    assert p.result == [4, 5, 6]  # the rest of the continuation, within n_max
    p = DraftParams(seq=0, n_max=8, pos0=3, id_last=9, prompt=[1, 2, 3])
    drafter.draft([p])
    assert p.result == []
