"""The paired A/B gate (`--baseline-cmd CMD`): the same tests with another build (A, the baseline: CMD) and this one
(B, the current build), alternating, judged on the ratio of each pair (asv's continuous mode, interleaved
benchmarking). A shared machine's drift of tens of percent over minutes lands on both runs of a pair alike, so
it divides out of the ratio, which a stored baseline measured at another time cannot do (compare.py).

One process per repetition of each build: `CMD bench <the test flags> -r 1 -o jsonl`, and the current build the
same way (`current_command`), never in-process. Why:
- it asks of the baseline only the bench flags and jsonl rows it already has, so any older build can be the
  baseline (a long-lived worker would need a protocol that builds before it lack);
- a fresh process per repetition gets a fresh memory layout, allocator and thread pool, whose effect on speed
  (a few percent, fixed for a process's life) becomes noise spread over the pairs instead of a constant bias of one
  build;
- both builds run alike, so in a self-comparison the two runs of a pair are exchangeable, which the sign test
  below assumes.
The cost: a process start and model load per run (seconds, untimed: each run still warms up before its sample).
Order: A B, B A, A B, ... The builds alternate, and the order flips every pair, so a steady drift over the whole
run favours neither build.

The verdict per row, from the n pair ratios r_i = t/s current / t/s baseline: a sign test on their median. The
order statistics [r_(k), r_(n+1-k)], k the largest with P(Binomial(n, 1/2) <= k - 1) <= ALPHA, are one-sided
95 % confidence bounds of the median ratio, for any distribution of the ratios. The row fails when the upper
bound lies below 1 - PCT/100, i.e. when at least n + 1 - k of the n pairs were slower than the threshold: at most
a 5 % chance when the true median ratio sits at the threshold, and far less for an unchanged build, whose pairs
straddle 1. A sign test rather than a bootstrap: it assumes only independent pairs (no symmetry, no normal
shape; drift bursts make the ratios skewed and heavy-tailed), one disturbed pair moves it by one count, and its
coverage is exact at 5-20 pairs, where a bootstrap of the median is a coarse discrete distribution that
undercovers. It needs 5 pairs: with 4, even 4 slower pairs out of 4 happen by chance 1 time in 16.
"""

from __future__ import annotations

import json
import math
import shlex
import shutil
import statistics
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from spec_cli.bench import sample_stats, spec_rates
from spec_cli.bench.compare import row_key, row_name
from spec_cli.bench.runner import speedups
from spec_cli.errors import SpecCliError, UsageError
from spec_cli.options import BENCH

ALPHA = 0.05  # one-sided: the chance of a failed row when the true median ratio sits at the threshold
MIN_PAIRS = 5  # the fewest pairs with a bound at ALPHA: 1/2^5 = 3.1 %
# flags of the paired run as a whole, never passed to a child run
OWN_FLAGS = ("repetitions", "output", "output_err", "verbose", "progress", "baseline", "max_regression", "plot",
             "baseline_cmd")
COUNT_FIELDS = ("n_drafted", "n_accepted", "n_steps", "n_tokens", "n_drafts")


@dataclass
class PairedRow:
    key: tuple  # compare.row_key
    name: str
    status: str  # ok | regression | new (the baseline build has no such row)
    ratios: list[float]
    median: float | None = None
    low: float | None = None  # the sign test's bounds of the median ratio
    high: float | None = None


def parse_command(value: str) -> list[str]:
    """--baseline-cmd's value: a spec-cli executable, or a command line (quoted as one argument)."""
    words = shlex.split(value)
    if not words or (shutil.which(words[0]) is None and not Path(words[0]).is_file()):
        raise UsageError(f"--baseline-cmd: '{value}' is not a command (give another build's spec-cli)")
    return words


def current_command() -> list[str]:
    """This build as a command: the script this process started as (the installed spec-cli, or a wrapper around
    it), run by this interpreter; `python -m spec_cli` when it started that way."""
    script = Path(sys.argv[0])
    if script.is_file() and script.name != "__main__.py":
        return [sys.executable, str(script)]
    return [sys.executable, "-m", "spec_cli"]


def child_args(opts: dict) -> list[str]:
    """The test flags as given (each build parses them itself), without the flags of the paired run as a whole."""
    args: list[str] = []
    for _, group in BENCH:
        for o in group:
            value = opts.get(o.name)
            if o.name in OWN_FLAGS or value is None or (not o.sweep and value == o.default):
                continue
            if o.sweep:  # the values as typed, the flag repeated (comma lists and ranges stay one value)
                args += [word for v in value for word in (o.flags[0], v)]
            elif value is True:
                args.append(o.flags[0])
            else:
                args += [o.flags[0], str(value)]
    return args


def run_pairs(baseline: list[str], args: list[str], n_pairs: int,
              log: Callable[[str], None]) -> tuple[list[list[dict]], list[list[dict]]]:
    """n_pairs runs of each build, alternating (A B, B A, ...); the rows of every run, current's then baseline's."""
    builds = {"baseline": baseline, "current": current_command()}
    runs: dict[str, list[list[dict]]] = {"baseline": [], "current": []}
    for i in range(n_pairs):
        order = ("baseline", "current") if i % 2 == 0 else ("current", "baseline")
        for which in order:
            runs[which].append(_run_child(builds[which], args, which))
        ratios = [c / b for c, b in _pair_ts(runs["current"][-1], runs["baseline"][-1]).values()]
        log(f"pair {i + 1}/{n_pairs} ({order[0]} first): t/s ratio " + " ".join(f"{r:.3f}" for r in ratios))
    return runs["current"], runs["baseline"]


def _run_child(command: list[str], args: list[str], which: str) -> list[dict]:
    try:
        done = subprocess.run(command + ["bench", *args, "-r", "1", "-o", "jsonl"], capture_output=True, text=True)
    except OSError as e:
        raise SpecCliError(f"cannot run the {which} build ({shlex.join(command)}): {e}") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no message"])[-1]
        raise SpecCliError(f"the {which} build's bench failed (exit {done.returncode}): {last}")
    try:
        return [json.loads(line) for line in done.stdout.splitlines() if line.strip()]
    except json.JSONDecodeError:
        raise SpecCliError(f"the {which} build ({shlex.join(command)}) wrote no bench jsonl rows") from None


def _pair_ts(current: list[dict], baseline: list[dict]) -> dict[tuple, tuple[float, float]]:
    """(t/s current, t/s baseline) of each row the two runs of a pair share, by row key (a baseline row that timed
    nothing, t/s 0, has no ratio)."""
    base = {row_key(r): statistics.median(r["samples_ts"]) for r in baseline}
    return {row_key(r): (statistics.median(r["samples_ts"]), base[row_key(r)]) for r in current
            if base.get(row_key(r))}


def sign_rank(n: int) -> int:
    """k of the bounds [r_(k), r_(n+1-k)]: the largest with P(Binomial(n, 1/2) <= k - 1) <= ALPHA; 0 if none."""
    k, below = 0, 0.0
    while k < n and below + math.comb(n, k) / 2**n <= ALPHA:
        below += math.comb(n, k) / 2**n
        k += 1
    return k


def judge(current: list[list[dict]], baseline: list[list[dict]], max_regression: float) -> list[PairedRow]:
    """The sign test's verdict per row of the current build (rows in the order of its first run)."""
    pairs = [_pair_ts(c, b) for c, b in zip(current, baseline)]
    threshold = 1 - max_regression / 100
    out = []
    for r in current[0]:
        key = row_key(r)
        ratios = [p[key][0] / p[key][1] for p in pairs if key in p]
        k = sign_rank(len(ratios))
        if k == 0:  # the baseline build has no such row (or too few that timed anything)
            out.append(PairedRow(key, row_name(r), "new", ratios))
            continue
        ordered = sorted(ratios)
        low, high = ordered[k - 1], ordered[len(ordered) - k]
        out.append(PairedRow(key, row_name(r), "regression" if high < threshold else "ok", ratios,
                             statistics.median(ratios), low, high))
    return out


def has_regression(rows: list[PairedRow]) -> bool:
    return any(r.status == "regression" for r in rows)


def format_paired(rows: list[PairedRow], max_regression: float, baseline: list[str]) -> str:
    """Plain text for stderr: what ran, then one line per row (median ratio, bounds, pairs, pairs below)."""
    threshold = 1 - max_regression / 100
    width = max([len(r.name) for r in rows] + [4])
    lines = [f"paired gate: current {shlex.join(current_command())} against baseline {shlex.join(baseline)}; "
             f"t/s ratio current/baseline per pair, sign-test bounds of the median ({1 - ALPHA:.0%} each)",
             f"{'test':<{width}}  {'median':>6}  {'bounds':>15}  {'pairs':>5}  {'below':>5}  status"]
    for r in rows:
        bounds = "-" if r.low is None else f"[{r.low:.3f}, {r.high:.3f}]"
        below = sum(x < threshold for x in r.ratios)
        median = "-" if r.median is None else f"{r.median:.3f}"
        lines.append(f"{r.name:<{width}}  {median:>6}  {bounds:>15}  {len(r.ratios):>5}  {below:>5}  {r.status}")
    return "\n".join(lines) + "\n"


def paired_verdict(rows: list[PairedRow], max_regression: float) -> str:
    threshold = 1 - max_regression / 100
    n_bad = sum(r.status == "regression" for r in rows)
    if n_bad:
        return (f"FAIL: {n_bad} row(s) with the median ratio's upper bound below {threshold:g} "
                f"({max_regression:g}% slower)")
    return f"ok: no row's median ratio is surely below {threshold:g} ({max_regression:g}% slower)"


# --- the runs of one build as one result row per test -------------------------------------------------------

def pool(runs: list[list[dict]]) -> list[dict]:
    """One row per test from the single-repetition runs of one build, as a run with that many repetitions would
    write it: samples in run order, counts summed, rates from the sums, per-repetition means averaged."""
    groups: dict[tuple, list[dict]] = {}
    for rows in runs:
        for r in rows:
            groups.setdefault(row_key(r), []).append(r)
    pooled = [_pool_row(rows) for rows in groups.values()]
    for r, speedup in zip(pooled, speedups(pooled)):
        if r["test"] == "spec":
            r["speedup"] = speedup
    return pooled


def _pool_row(rows: list[dict]) -> dict:
    out = dict(rows[0])
    out["samples_ns"] = [ns for r in rows for ns in r["samples_ns"]]
    out["samples_ts"] = [ts for r in rows for ts in r["samples_ts"]]
    out.update(sample_stats(out["samples_ns"], out["samples_ts"]), compile_s=sum(r["compile_s"] for r in rows))
    if out["test"] != "spec" or not all(f in out for f in COUNT_FIELDS):
        return out  # the verify curve's fields, or a baseline build whose rows lack the counts, stay the first run's
    counts = {f: sum(r[f] for r in rows) for f in COUNT_FIELDS}
    per_pos: list[int] = []
    for r in rows:  # rate x drafts gives back each run's count of drafts accepted at a position
        for i, rate in enumerate(r["acc_per_pos"]):
            per_pos += [0] * (i + 1 - len(per_pos))
            per_pos[i] += round(rate * r["n_drafts"])
    hashes = list(dict.fromkeys(h for r in rows for h in r["text_hash"].split(",") if h))
    out.update(counts, **spec_rates(**counts, n_acc_per_pos=per_pos), text_hash=",".join(hashes),
               prompt_ns=int(statistics.fmean(r["prompt_ns"] for r in rows)),
               draft_ms=statistics.fmean(r["draft_ms"] for r in rows),
               verify_ms=statistics.fmean(r["verify_ms"] for r in rows))
    return out


def attach_pairs(rows: list[dict], verdicts: list[PairedRow], baseline_rows: list[dict],
                 baseline: list[str]) -> None:
    """Each current row records its pairs: the baseline's samples, the ratios and the verdict (json/jsonl)."""
    base = {row_key(r): r for r in baseline_rows}
    verdict = {v.key: v for v in verdicts}
    for r in rows:
        b, v = base.get(row_key(r), {}), verdict.get(row_key(r))
        r["paired"] = {"baseline_cmd": shlex.join(baseline), "baseline_commit": b.get("build_commit"),
                       "baseline_samples_ts": b.get("samples_ts"), "ratios": v.ratios if v else [],
                       "median_ratio": v.median if v else None,
                       "bounds": None if v is None or v.low is None else [v.low, v.high],
                       "status": v.status if v else "new"}
