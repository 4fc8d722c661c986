"""The bench regression gate: the paired A/B runs (a sign test on per-pair ratios whose bounds cover the median,
single-repetition runs pooled into the rows a longer run writes, the test flags handed to each build unchanged)
and the exact counters (greedy speculative rows compared exactly, the text against the plain row too). Then
through the installed spec-cli: a self-comparison passes, a deliberately slowed build (tests/altered_build.py)
fails, a changed text or acceptance fails with the row and counter named, and bad --baseline-cmd input is a
one-line error."""

from __future__ import annotations

import json
import os
import random
import re
import shlex
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import typer.main
import yaml

from spec_cli.bench.counters import AUTO_NOTE, compare_counters, gated, lossless
from spec_cli.bench.paired import ALPHA, MIN_PAIRS, child_args, judge, pool, sign_rank
from spec_cli.bench.params import BenchParams, from_flags
from spec_cli.bench.runner import run_bench
from spec_cli.cli import app
from spec_cli.options import BENCH_OPTIONS, read_flags

SCRIPT = Path(sys.executable).with_name("spec-cli")
ALTERED = Path(__file__).with_name("altered_build.py")
ROOT = Path(__file__).parents[1]
BENCH_COMMAND = typer.main.get_command(app).commands["bench"]


# --- the sign test ----------------------------------------------------------------------------------------

def test_sign_rank_follows_the_binomial_tables():
    # k: the largest with P(Binomial(n, 1/2) <= k - 1) <= 5 %; 0 where even n of n slower pairs is not rare enough
    assert {n: sign_rank(n) for n in (1, 4, 5, 7, 8, 10, 12, 15, 20)} == {
        1: 0, 4: 0, 5: 1, 7: 1, 8: 2, 10: 2, 12: 3, 15: 4, 20: 6}


@pytest.mark.parametrize("n", [5, 10, 20])
def test_sign_bounds_cover_the_median_of_skewed_ratios(n):
    """Each bound misses the true median at most ALPHA of the time, whatever the distribution: here lognormal
    ratios with bursts of a 30 % slower machine in one run of a pair (skewed, heavy-tailed)."""
    rng = random.Random(n)

    def ratio():
        burst = 0.7 if rng.random() < 0.15 else 1.0
        return rng.lognormvariate(0, 0.05) * (burst if rng.random() < 0.5 else 1 / burst)

    median = sorted(ratio() for _ in range(200001))[100000]
    k, trials = sign_rank(n), 4000
    high_misses = low_misses = 0
    for _ in range(trials):
        ordered = sorted(ratio() for _ in range(n))
        high_misses += ordered[n - k] < median
        low_misses += ordered[k - 1] > median
    assert high_misses / trials <= ALPHA + 0.01 and low_misses / trials <= ALPHA + 0.01


def runs(*ratios_per_row: list[float], base_ts: float = 100.0) -> tuple[list[list[dict]], list[list[dict]]]:
    """Single-repetition runs of two builds: row j of pair i has t/s base_ts * ratios_per_row[j][i] now."""
    def row(n_gen: int, ts: float) -> dict:
        return {"model_filename": "m.gguf", "test": "tg", "n_prompt": 0, "n_gen": n_gen, "n_depth": 0,
                "samples_ts": [ts], "samples_ns": [int(1e9 * n_gen / ts)], "compile_s": 0.0}

    n_pairs = len(ratios_per_row[0])
    current = [[row(j + 1, base_ts * ratios[i]) for j, ratios in enumerate(ratios_per_row)] for i in range(n_pairs)]
    baseline = [[row(j + 1, base_ts) for j in range(len(ratios_per_row))] for _ in range(n_pairs)]
    return current, baseline


def test_judge_fails_only_rows_surely_slower_than_the_threshold():
    slower = [0.8] * 9 + [1.3]  # 9 of 10 pairs 20 % slower, one disturbed the other way
    noisy = [0.85, 1.1, 0.9, 1.05, 0.97, 1.2, 0.8, 1.0, 0.93, 1.02]  # an unchanged build on a noisy machine
    mostly = [0.8] * 8 + [1.0, 1.0]  # 8 of 10 below: not enough at n = 10 (k = 2)
    verdicts = judge(*runs(slower, noisy, mostly), max_regression=5)
    assert [v.status for v in verdicts] == ["regression", "ok", "ok"]
    assert verdicts[0].high == pytest.approx(0.8) and verdicts[0].median == pytest.approx(0.8)
    assert verdicts[1].low == pytest.approx(0.85) and verdicts[1].high == pytest.approx(1.1)
    assert len(verdicts[0].ratios) == 10
    current, baseline = runs(slower, noisy)
    verdicts = judge(current, [rows[:1] for rows in baseline], max_regression=5)  # a test the baseline lacks
    assert [v.status for v in verdicts] == ["regression", "new"] and verdicts[1].ratios == []


# --- pooled runs and the flags each build gets ----------------------------------------------------------------

def test_single_repetition_runs_pool_into_the_row_of_a_longer_run(tiny_model_path, prompt_set_file):
    params = BenchParams(model=[str(tiny_model_path)], devices=["cpu"], random_tests=False,
                         spec_type=["draft-simple"], model_draft=[str(tiny_model_path)], draft_max=[3],
                         draft_p_min=[0.0], prompt_sets=[str(prompt_set_file)], n_gen=[10], repetitions=1)
    one = [[r.to_dict() for r in run_bench(params)] for _ in range(2)]
    two = [r.to_dict() for r in run_bench(replace(params, repetitions=2))]
    pooled = pool(one)
    counters = ("n_drafted", "n_accepted", "n_steps", "n_tokens", "n_drafts", "acceptance", "mean_acc_len",
                "tokens_per_step", "forwards_per_token", "rows_per_token", "acc_per_pos", "text_hash")
    assert [r["spec_type"] for r in pooled] == [r["spec_type"] for r in two] == ["none", "draft-simple"]
    for p, t, first, second in zip(pooled, two, *one):
        assert {c: p[c] for c in counters} == {c: t[c] for c in counters}
        assert p["samples_ts"] == first["samples_ts"] + second["samples_ts"]
        assert p["avg_ts"] == pytest.approx(sum(p["samples_ts"]) / 2)
    assert pooled[1]["n_accepted"] > 0  # the model drafting for itself: every draft accepted
    assert pooled[1]["speedup"] == pytest.approx(pooled[1]["avg_ts"] / pooled[0]["avg_ts"])


def test_each_build_gets_the_test_flags_as_given():
    command = BENCH_COMMAND
    given = ["-m", "a.gguf,b.gguf", "-ngl", "-1", "-p", "0", "-n", "8,16", "--spec-type", "ngram-simple;draft-simple",
             "--spec-type", "ngram-mod,draft-simple", "-md", "d.gguf", "--draft-max", "1-4*2,auto", "--temp", "0,0.5",
             "--warm", "--verify-cost", "4", "-r", "7", "-o", "jsonl", "--plot", "x.png", "--baseline-cmd", "old-cli",
             "--max-regression", "3", "--progress"]
    opts = dict(command.make_context("bench", list(given)).params)
    args = child_args(opts)
    assert not {"-r", "-o", "--plot", "--baseline-cmd", "--max-regression", "--progress"} & set(args)
    again = dict(command.make_context("bench", list(args)).params)
    assert from_flags(again) == replace(from_flags(opts), repetitions=BenchParams().repetitions)


# --- exact counters ------------------------------------------------------------------------------------------

def spec_row(spec_type="draft-simple", draft_max=4, temp=0.0, text="aaaa", acc=(0.5, 0.25), samples=1, **kw):
    row = {"model_filename": "m.gguf", "test": "spec", "n_prompt": 40, "n_gen": 32, "n_depth": 0, "prompt_set": "qa",
           "spec_type": spec_type, "draft_max": draft_max, "temp": temp, "warm": False, "text_hash": text,
           "forwards_per_token": 0.6, "rows_per_token": 2.5, "mean_acc_len": 1.75, "acc_per_pos": list(acc),
           "samples_ts": [10.0] * samples}
    row.update(kw)
    return row


def test_unchanged_counters_pass_and_every_change_is_named():
    base = [spec_row(spec_type="none", acc=()), spec_row()]
    assert compare_counters([dict(r) for r in base], base) == ([], [])
    changed = [spec_row(spec_type="none", acc=()), spec_row(acc=(0.5, 0.2), mean_acc_len=1.7)]
    mismatches, _ = compare_counters(changed, base)
    assert [m.counter for m in mismatches] == ["mean_acc_len", "acc_per_pos"]
    assert mismatches[1].message() == ("FAIL m.gguf qa n32 draft-simple dmax4: acc_per_pos changed: [0.5, 0.25] -> "
                                       "[0.5, 0.2]")
    # ratios of counts: a last-bit difference is rounding, not a change
    assert compare_counters([spec_row(rows_per_token=2.5 * (1 + 1e-15))], [spec_row()]) == ([], [])


def test_what_is_gated_exactly():
    assert gated(spec_row()) == ("text_hash", "forwards_per_token", "rows_per_token", "mean_acc_len", "acc_per_pos")
    assert gated(spec_row(draft_max="auto")) == ("text_hash",)  # the planner's lengths follow the machine's speed
    assert gated(spec_row(temp=0.7)) == () and gated({"test": "tg"}) == ()
    mismatches, notes = compare_counters([spec_row(draft_max="auto", acc=(0.1,), text="bbbb")],
                                         [spec_row(draft_max="auto")])
    assert [m.counter for m in mismatches] == ["text_hash"] and notes == [AUTO_NOTE]


def test_warm_rows_compare_acceptance_only_at_equal_repetitions_and_old_rows_say_what_they_lack():
    warm = dict(warm=True, acc=(0.9,))
    mismatches, notes = compare_counters([spec_row(samples=3, **warm)], [spec_row(samples=5, warm=True)])
    assert mismatches == [] and "warm rows" in notes[0]
    assert [m.counter for m in compare_counters([spec_row(samples=5, **warm)], [spec_row(samples=5, warm=True)])[0]
            ] == ["acc_per_pos"]
    old = {k: v for k, v in spec_row().items() if k != "text_hash"}  # written before text_hash existed
    mismatches, notes = compare_counters([spec_row()], [old])
    assert mismatches == [] and notes == ["note: text_hash is not recorded by the baseline build: not compared"]


def test_speculation_must_keep_the_plain_rows_text():
    rows = [spec_row(spec_type="none", acc=()), spec_row(), spec_row(spec_type="ngram-simple", text="abab")]
    [broken] = lossless(rows)
    assert broken.message() == ("FAIL m.gguf qa n32 ngram-simple dmax4: text_hash abab differs from the plain row's "
                                "aaaa: speculation changed the greedy output")
    assert lossless([spec_row(spec_type="none", acc=()), spec_row(temp=0.8, text="abab")]) == []  # sampled


def test_bench_rows_carry_the_exact_counters(tiny_model_path, tiny_draft_path, prompt_set_file):
    params = BenchParams(model=[str(tiny_model_path)], devices=["cpu"], random_tests=False,
                         spec_type=["ngram-simple", "draft-simple"], model_draft=[str(tiny_draft_path)],
                         draft_max=[3], draft_p_min=[0.0], prompt_sets=[str(prompt_set_file)], n_gen=[10],
                         repetitions=2)
    rows = [r.to_dict() for r in run_bench(params)]
    assert len({r["text_hash"] for r in rows}) == 1 and len(rows[0]["text_hash"]) == 16  # lossless, same each rep
    assert lossless(rows) == []
    for r in rows:
        assert r["forwards_per_token"] == pytest.approx(r["n_steps"] / r["n_tokens"])
        assert r["rows_per_token"] == pytest.approx((r["n_steps"] + r["n_drafted"]) / r["n_tokens"])
    drafted = rows[2]
    assert drafted["n_drafts"] > 0 and drafted["mean_acc_len"] == pytest.approx(
        1 + drafted["n_accepted"] / drafted["n_drafts"])


# --- through the installed script -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def prompt_set_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gate") / "gate-set.jsonl"
    lines = [{"id": "loop", "prompt": "Hello world, the world is here. Hello world, the world is"},
             {"id": "chat", "messages": [{"role": "user", "content": "def return the"}]}]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def bench(*args: str, altered: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """spec-cli bench ARGS through the installed script, or the altered build (tests/altered_build.py) with its
    environment variables."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200", **(altered or {})}
    env.pop("SPEC_CLI_DEBUG", None)
    command = [sys.executable, str(ALTERED)] if altered is not None else [str(SCRIPT)]
    return subprocess.run(command + ["bench", *args], capture_output=True, text=True, timeout=600, env=env,
                          stdin=subprocess.DEVNULL)


def gated_sweep(model: Path, prompts: Path) -> list[str]:
    """A tg test and a greedy speculative sweep (the model drafting for itself: every draft accepted)."""
    return ["-m", str(model), "-dev", "cpu", "-t", "1", "-p", "0", "-n", "12", "--spec-type", "draft-simple",
            "-md", str(model), "--draft-max", "3", "--draft-p-min", "0", "--prompts", str(prompts)]


@pytest.mark.slow
def test_paired_self_comparison_passes(tiny_model_path, prompt_set_file):
    done = bench(*gated_sweep(tiny_model_path, prompt_set_file), "-r", "5", "--max-regression", "20", "-o", "jsonl",
                 "--baseline-cmd", str(SCRIPT))
    assert done.returncode == 0, done.stderr
    assert "pair 4/5 (current first)" in done.stderr and "pair 5/5 (baseline first)" in done.stderr
    assert "paired gate: current" in done.stderr
    assert done.stderr.rstrip().splitlines()[-2:] == [
        "ok: no row's median ratio is surely below 0.8 (20% slower)",
        "ok: the exact counters of 2 greedy speculative row(s) are unchanged"]
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    assert [r["test"] for r in rows] == ["tg", "spec", "spec"]
    for r in rows:
        assert len(r["samples_ts"]) == 5 and len(r["paired"]["ratios"]) == 5 and r["paired"]["status"] == "ok"
        assert len(r["paired"]["baseline_samples_ts"]) == 5


@pytest.mark.slow
def test_paired_gate_catches_a_slowed_build(tiny_model_path):
    done = bench("-m", str(tiny_model_path), "-dev", "cpu", "-t", "1", "-p", "0", "-n", "32", "-r", "5",
                 "--max-regression", "20", "--baseline-cmd", str(SCRIPT), altered={"ALTERED_BUILD_SLOWDOWN": "3"})
    assert done.returncode == 1, done.stderr
    [line] = [line for line in done.stderr.splitlines() if "tiny-llama.gguf tg32" in line]
    assert line.endswith("regression") and line.split()[-2] == "5"  # all 5 pairs below the threshold
    assert done.stderr.rstrip().splitlines()[-1] == (
        "FAIL: 1 row(s) with the median ratio's upper bound below 0.8 (20% slower)")
    assert "Traceback" not in done.stderr


@pytest.mark.slow
def test_a_change_of_text_or_acceptance_fails_naming_the_row_and_counter(tiny_model_path, prompt_set_file, tmp_path):
    tests = [*gated_sweep(tiny_model_path, prompt_set_file), "-r", "1", "-o", "jsonl"]
    first = bench(*tests)
    assert first.returncode == 0, first.stderr
    (tmp_path / "base.jsonl").write_text(first.stdout)
    gate = [*tests, "--baseline", str(tmp_path / "base.jsonl")]
    same = bench(*gate, altered={})
    assert same.returncode == 0, same.stderr  # -r 1: too few samples for a speed verdict, counters equal
    assert "ok: the exact counters of 2 greedy speculative row(s) are unchanged" in same.stderr
    text = bench(*gate, altered={"ALTERED_BUILD_CHANGE": "text"})
    assert text.returncode == 1, text.stderr
    assert "FAIL tiny-llama.gguf gate-set n12 none: text_hash changed: " in text.stderr
    assert "FAIL tiny-llama.gguf gate-set n12 draft-simple dmax3: text_hash changed: " in text.stderr
    acceptance = bench(*gate, altered={"ALTERED_BUILD_CHANGE": "acceptance"})
    assert acceptance.returncode == 1, acceptance.stderr
    failures = [line for line in acceptance.stderr.splitlines() if line.startswith("FAIL ")]
    assert failures and all(line.startswith("FAIL tiny-llama.gguf gate-set n12 draft-simple dmax3: ")
                            for line in failures)
    assert {line.split(": ")[1].split()[0] for line in failures} == {
        "forwards_per_token", "rows_per_token", "mean_acc_len", "acc_per_pos"}  # the text is the same
    assert acceptance.stderr.rstrip().splitlines()[-1] == "FAIL: 4 exact counter(s) changed"


def test_bad_baseline_cmd_input(tiny_model_path, tmp_path):
    few = bench("-m", str(tiny_model_path), "-r", "4", "--baseline-cmd", str(SCRIPT))
    assert few.returncode == 2 and "--baseline-cmd needs -r 5 or more" in few.stderr
    missing = bench("-m", str(tiny_model_path), "--baseline-cmd", str(tmp_path / "no-such-spec-cli"))
    assert missing.returncode == 2 and "is not a command" in missing.stderr
    failing = bench("-m", str(tiny_model_path), "-dev", "cpu", "-p", "0", "-n", "2", "--baseline-cmd", "false")
    assert failing.returncode == 1
    assert failing.stderr.splitlines()[-1] == "error: the baseline build's bench failed (exit 1): no message"
    for done in (few, missing, failing):
        assert "Traceback" not in done.stderr


def test_ci_recipe_runs_the_gate_script_with_gated_flags_and_uploads_its_output():
    steps = yaml.safe_load((ROOT / "ci" / "bench-gate.yml").read_text())["jobs"]["bench-gate"]["steps"]
    [gate] = [shlex.split(s["run"]) for s in steps if s.get("run", "").startswith("scripts/ab_gate.sh ")]
    [upload] = [s for s in steps if s.get("uses", "").startswith("actions/upload-artifact")]
    assert upload["with"]["path"].rstrip("/") == gate[3] and upload["if"] == "always()"
    script = ROOT / "scripts" / "ab_gate.sh"
    assert os.access(script, os.X_OK) and os.access(ROOT / "scripts" / "gate_trials.sh", os.X_OK)
    flags = shlex.split(re.search(r"DEFAULT_FLAGS=\((.*?)\)", script.read_text(), re.S).group(1))
    params = from_flags(read_flags(BENCH_OPTIONS, BENCH_COMMAND.make_context("bench", flags).params))
    assert params.repetitions >= MIN_PAIRS and params.spec_type and params.temp == [0.0]
    assert all(isinstance(d, int) for d in params.draft_max)  # fixed lengths: the acceptance counters are gated
