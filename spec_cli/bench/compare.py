"""Comparison with a stored run (`--baseline FILE --max-regression PCT`): what llama.cpp's compare-llama-bench.py
does for two runs, kept for history; the speed gate that holds on a drifting machine is the paired one (paired.py).

Rows of the current run and of a previous json / jsonl run are matched by their parameters (`KEY_FIELDS`: model
file name, backend, dtype, engine parameters, test shape, speculative settings, verify k), never by position.
Each matched row gets ratio = median t/s now / median t/s then.

The two runs were taken at different times, so every ratio holds the machine's drift between them (15-30 % over
minutes on shared VMs and CI runners), which neither file can measure: the comparison says so (UNPAIRED). A row
regresses only when all of these hold:
- it is slower by more than PCT percent (ratio < 1 - PCT/100);
- the two runs' sample ranges are apart: every sample now is slower than every sample then;
- each file has enough samples for "apart" to mean something: with m and n samples of one distribution, all m
  below all n happens with probability 1 / C(m + n, m) (Mann-Whitney's U = 0), which must be at most 5 % (3 and 3
  samples: 1/20; 5 and 5: 1/252). With fewer, the row says "few samples" and does not fail.
The noise this rule sees is the noise within each run; a threshold PCT below the machine's drift between runs
still fails green builds (docs/ci.md gives settings). Medians, not means, so one disturbed repetition does not move
the ratio. Rows only in the baseline are reported as missing and rows only in the current run as new; neither
fails the gate (a changed grid is not a slowdown).
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from spec_cli.bench import KEY_FIELDS, row_label
from spec_cli.errors import SpecCliError

ALPHA = 0.05  # the largest chance that samples of one distribution fall apart as a regression needs

UNPAIRED = ("warning: unpaired comparison: the baseline was measured at another time, so the machine's drift between "
            "the two runs is part of every ratio; --baseline-cmd runs a paired gate")


@dataclass
class RowComparison:
    name: str  # display: model, test and the distinguishing parameters
    status: str  # ok | regression | few samples | missing | new
    base_ts: float | None = None  # median samples_ts of the baseline row
    cur_ts: float | None = None
    ratio: float | None = None  # cur / base
    apart: bool | None = None  # every current sample below every baseline sample


def load_results(path: str | Path) -> list[dict]:
    """A json array (`-o json`) or json lines (`-o jsonl`) written by an earlier bench run."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise SpecCliError(f"cannot read baseline {path}: {e}") from None
    try:
        data = json.loads(text) if text.lstrip().startswith("[") else [
            json.loads(line) for line in text.splitlines() if line.strip()]
    except json.JSONDecodeError as e:
        raise SpecCliError(f"baseline {path} is not bench json/jsonl output ({e.msg} at line {e.lineno})") from None
    if not all(isinstance(r, dict) and "samples_ts" in r and "test" in r for r in data):
        raise SpecCliError(f"baseline {path}: rows lack 'test' / 'samples_ts' (write it with -o json or -o jsonl)")
    return data


def row_key(row: dict) -> tuple:
    def norm(field):
        v = row.get(field, "auto" if field == "compile" else None)  # rows written before --compile existed
        return Path(v).name if field in ("model_filename", "model_draft") and v else v

    return tuple(json.dumps(norm(f)) for f in KEY_FIELDS)


def enough_samples(m: int, n: int) -> bool:
    """Whether m samples all below n others is unlikely enough (<= ALPHA) when both come from one distribution."""
    return m > 0 and n > 0 and 1 / math.comb(m + n, m) <= ALPHA


def compare(current: list[dict], baseline: list[dict], max_regression: float) -> list[RowComparison]:
    base = {row_key(r): r for r in baseline}
    seen = set()
    out = []
    for r in current:
        key = row_key(r)
        seen.add(key)
        b = base.get(key)
        if b is None:
            out.append(RowComparison(row_name(r), "new", cur_ts=statistics.median(r["samples_ts"])))
            continue
        now, then = r["samples_ts"], b["samples_ts"]
        median_now, median_then = statistics.median(now), statistics.median(then)
        ratio = median_now / median_then if median_then else float("inf")
        apart = max(now) < min(then)
        status = "ok"
        if ratio < 1 - max_regression / 100 and apart:
            status = "regression" if enough_samples(len(now), len(then)) else "few samples"
        out.append(RowComparison(row_name(r), status, median_then, median_now, ratio, apart))
    for key, b in base.items():
        if key not in seen:
            out.append(RowComparison(row_name(b), "missing", base_ts=statistics.median(b["samples_ts"])))
    return out


def has_regression(rows: list[RowComparison]) -> bool:
    return any(r.status == "regression" for r in rows)


def row_name(r: dict) -> str:
    """A row as the gates name it: model file, test, and a speculative row's chain, draft length and temperature."""
    name = f"{Path(r.get('model_filename') or '?').name} {row_label(r)}"
    if r["test"] == "spec":
        name += f" {r['spec_type']}" + (f" dmax{r['draft_max']}" if r["spec_type"] != "none" else "")
        name += f" temp{r['temp']:g}" if r.get("temp") else ""
    return name


def format_comparison(rows: list[RowComparison]) -> str:
    """Plain text for stderr: the unpaired warning, then one line per row."""
    width = max([len(r.name) for r in rows] + [4])
    lines = [UNPAIRED, f"{'test':<{width}}  {'base t/s':>10}  {'now t/s':>10}  {'ratio':>6}  {'ranges':>7}  status"]
    for r in rows:
        ranges = "-" if r.apart is None else ("apart" if r.apart else "overlap")
        lines.append(f"{r.name:<{width}}  {_cell(r.base_ts, 10, 2)}  {_cell(r.cur_ts, 10, 2)}  {_cell(r.ratio, 6, 3)}  "
                     f"{ranges:>7}  {r.status}")
    return "\n".join(lines) + "\n"


def comparison_verdict(rows: list[RowComparison], max_regression: float) -> str:
    n_bad = sum(r.status == "regression" for r in rows)
    verdict = (f"FAIL: {n_bad} row(s) slower than {max_regression:g}% with the sample ranges apart" if n_bad
               else f"ok: no row slower than {max_regression:g}% with the sample ranges apart")
    if any(r.status == "few samples" for r in rows):
        verdict += " (rows marked 'few samples' are slower but have too few samples to tell: use -r 3 or more)"
    return verdict


def _cell(value: float | None, width: int, decimals: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}.{decimals}f}"
