"""The exact half of the regression gate: counters of greedy speculative rows, which no machine's noise moves, so
they are compared exactly (both `--baseline FILE` and `--baseline-cmd CMD`).

The counters (fields of a spec row, runner.py):
- text_hash: sha256 of the generated token ids. Greedy decoding makes it a function of the code, the model and the
  prompts; lossless speculation makes it the plain row's too, which is checked within the current run as well
  (`lossless`), so a change that alters the output fails even against a baseline that had the same fault.
- forwards_per_token, rows_per_token: target forwards and verified rows per generated token (what a step costs).
- mean_acc_len, acc_per_pos: mean acceptance length and the acceptance rate per draft position.
Which rows: spec rows at temp <= 0. With --draft-max auto the planner picks each draft's length from measured verify
costs and drafting times, so the acceptance counters move with the machine's speed: those rows gate the text only,
and the report says so (gate fixed --draft-max values to gate acceptance). Sampled rows (temp > 0) are not gated:
their text follows the draws, whose order a legitimate change of the sampler may change.
The float counters are ratios of integer counts, so only rounding can move them: compared to 1e-9 relative. They
are per token and per draft, so cold rows compare across different -r; warm rows (--warm) fill their n-gram pools
over the repetitions, so their acceptance is compared only with a row of as many repetitions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from spec_cli.bench import plain_key
from spec_cli.bench.compare import row_key, row_name
from spec_cli.options import AUTO

TEXT = "text_hash"
ACCEPTANCE = ("forwards_per_token", "rows_per_token", "mean_acc_len", "acc_per_pos")
COUNTERS = (TEXT,) + ACCEPTANCE
REL_TOL = 1e-9

AUTO_NOTE = ("note: rows with --draft-max auto gate the generated text only: the planner picks draft lengths from "
             "measured timings, so their acceptance counters depend on the machine; gate fixed --draft-max values")


@dataclass
class Mismatch:
    row: str  # row_name
    counter: str
    expected: object  # the baseline's value (the plain row's for a lossless failure)
    got: object
    lossless: bool = False  # a speculative row's text differs from its own run's plain row

    def message(self) -> str:
        if self.lossless:
            return (f"FAIL {self.row}: {self.counter} {self.got} differs from the plain row's {self.expected}: "
                    "speculation changed the greedy output")
        varies = " (differs between repetitions)" if self.counter == TEXT and "," in str(self.got) else ""
        return f"FAIL {self.row}: {self.counter} changed: {_shown(self.expected)} -> {_shown(self.got)}{varies}"


def gated(row: dict) -> tuple[str, ...]:
    """The counters the gate compares exactly on this row."""
    if row.get("test") != "spec" or (row.get("temp") or 0) > 0:
        return ()
    return (TEXT,) if row.get("draft_max") == AUTO and row.get("spec_type") != "none" else COUNTERS


def compare_counters(current: list[dict], baseline: list[dict]) -> tuple[list[Mismatch], list[str]]:
    """Counter changes of the rows both runs have, and notes on what could not be compared."""
    base = {row_key(r): r for r in baseline}
    mismatches, notes = [], set()
    for r in current:
        b = base.get(row_key(r))
        if b is None:
            continue
        for counter in gated(r):
            if counter in ACCEPTANCE and r.get("warm") and len(r["samples_ts"]) != len(b["samples_ts"]):
                notes.add("note: warm rows of different repetition counts: acceptance not compared")
                continue
            if counter not in b or counter not in r:
                notes.add(f"note: {counter} is not recorded by the {'baseline' if counter not in b else 'current'} "
                          "build: not compared")
                continue
            if not _same(r[counter], b[counter]):
                mismatches.append(Mismatch(row_name(r), counter, b[counter], r[counter]))
        if r.get("draft_max") == AUTO and gated(r):
            notes.add(AUTO_NOTE)
    return mismatches, sorted(notes)


def lossless(rows: list[dict]) -> list[Mismatch]:
    """Greedy speculative rows whose generated text differs from the plain row of the same run and settings."""
    plain = {plain_key(r): r for r in rows if r["test"] == "spec" and r["spec_type"] == "none"}
    out = []
    for r in rows:
        if r["test"] != "spec" or r["spec_type"] == "none" or TEXT not in gated(r):
            continue
        p = plain.get(plain_key(r))
        if p is not None and r.get(TEXT) and p.get(TEXT) and r[TEXT] != p[TEXT]:
            out.append(Mismatch(row_name(r), TEXT, p[TEXT], r[TEXT], lossless=True))
    return out


def format_counters(mismatches: list[Mismatch], notes: list[str]) -> str:
    """The exact gate's lines for stderr: each failure (row and counter named), then the notes."""
    return "".join(line + "\n" for line in [m.message() for m in mismatches] + notes)


def counters_verdict(mismatches: list[Mismatch], n_gated: int) -> str:
    return (f"FAIL: {len(mismatches)} exact counter(s) changed" if mismatches
            else f"ok: the exact counters of {n_gated} greedy speculative row(s) are unchanged")


def _same(a, b) -> bool:
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, (int, float)) and isinstance(b, (int, float)) and math.isclose(a, b, rel_tol=REL_TOL)
    return a == b


def _shown(value) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(_shown(v) for v in value) + "]"
    return f"{value:.6g}" if isinstance(value, float) else str(value)
