"""Baseline comparison for CI (`--baseline FILE --max-regression PCT`): what llama.cpp's compare-llama-bench.py
does for two runs, made into a gate.

Rows of the current run and of a previous json / jsonl run are matched by their parameters (`KEY_FIELDS`: model
file name, backend, dtype, engine parameters, test shape, speculative settings, verify k), never by position.
Each matched row gets ratio = median t/s now / median t/s then. A row regresses only when both hold:
- it is slower by more than PCT percent (ratio < 1 - PCT/100), and
- the slowdown is larger than the noise: median_then - median_now > spread_then + spread_now, where a run's
  spread is half the range of its samples (so the two runs' sample ranges do not even touch).
Medians, not means, so one disturbed repetition does not decide. Rows only in the baseline are reported as
missing and rows only in the current run as new; neither fails the gate (a changed grid is not a slowdown).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from spec_cli.bench import KEY_FIELDS, row_label
from spec_cli.errors import SpecCliError


@dataclass
class RowComparison:
    name: str  # display: model, test and the distinguishing parameters
    status: str  # ok | regression | missing | new
    base_ts: float | None = None  # median samples_ts of the baseline row
    cur_ts: float | None = None
    ratio: float | None = None  # cur / base
    noise: float | None = None  # spread_then + spread_now, in t/s


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


def _spread(samples: list[float]) -> float:
    return (max(samples) - min(samples)) / 2 if samples else 0.0


def compare(current: list[dict], baseline: list[dict], max_regression: float) -> list[RowComparison]:
    base = {row_key(r): r for r in baseline}
    seen = set()
    out = []
    for r in current:
        key = row_key(r)
        seen.add(key)
        b = base.get(key)
        if b is None:
            out.append(RowComparison(_name(r), "new", cur_ts=statistics.median(r["samples_ts"])))
            continue
        now, then = statistics.median(r["samples_ts"]), statistics.median(b["samples_ts"])
        noise = _spread(r["samples_ts"]) + _spread(b["samples_ts"])
        ratio = now / then if then else float("inf")
        slower = ratio < 1 - max_regression / 100 and then - now > noise
        out.append(RowComparison(_name(r), "regression" if slower else "ok", then, now, ratio, noise))
    for key, b in base.items():
        if key not in seen:
            out.append(RowComparison(_name(b), "missing", base_ts=statistics.median(b["samples_ts"])))
    return out


def has_regression(rows: list[RowComparison]) -> bool:
    return any(r.status == "regression" for r in rows)


def _name(r: dict) -> str:
    name = f"{Path(r.get('model_filename') or '?').name} {row_label(r)}"
    if r["test"] == "spec":
        name += f" {r['spec_type']}" + (f" dmax{r['draft_max']}" if r["spec_type"] != "none" else "")
        name += f" temp{r['temp']:g}" if r.get("temp") else ""
    return name


def format_comparison(rows: list[RowComparison], max_regression: float) -> str:
    """Plain text table for stderr: one line per row, then the verdict."""
    width = max([len(r.name) for r in rows] + [4])
    lines = [f"{'test':<{width}}  {'base t/s':>10}  {'now t/s':>10}  {'ratio':>6}  {'noise':>8}  status"]
    for r in rows:
        lines.append(f"{r.name:<{width}}  {_cell(r.base_ts, 10, 2)}  {_cell(r.cur_ts, 10, 2)}  {_cell(r.ratio, 6, 3)}  "
                     f"{_cell(r.noise, 8, 2)}  {r.status}")
    n_bad = sum(r.status == "regression" for r in rows)
    verdict = (f"FAIL: {n_bad} row(s) slower than {max_regression:g}% beyond the noise" if n_bad
               else f"ok: no row slower than {max_regression:g}% beyond the noise")
    return "\n".join(lines) + "\n" + verdict + "\n"


def _cell(value: float | None, width: int, decimals: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}.{decimals}f}"
