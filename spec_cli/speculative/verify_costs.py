"""The verify side of a speculative step, timed: how many seconds a target forward of k rows takes on this machine
(`time_forwards`), and the curve the adaptive planner (adaptive.py) plans with (`CostModel`): calibrated once per
model, weights, device and thread count, kept in a JSON cache between commands, refined online from every step.
"""

from __future__ import annotations

import bisect
import json
import os
import random
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from spec_cli.model import kernels
from spec_cli.model.batch import Batch
from spec_cli.model.context import Context

CALIBRATION_ROWS = (1, 2, 3, 4, 6, 8, 12, 16)  # sparse: interpolation fills the gaps
MULTI_SEQ_ROWS = (24, 32)  # several sequences' verify steps reach past 16 rows (G + their drafts, or padded)
# Timed again in every process that reads a cached calibration (~0.4 s on qwen2.5-coder-1.5b, 2 threads): the VM's
# phase changes the curve's shape, and the short verifies are where a draft model's worth is decided.
REFRESH_ROWS = (1, 2, 3, 4)
# Timed forwards per row count, the fastest kept: a calibration is cached and used by every later command, and the
# online refinement never corrects the 1-row cost while every step drafts; with 2, a 1.5b 1-row forward disturbed
# twice read 36.5 ms instead of 28-29, so one-token drafts at 45 % acceptance looked worth it (0.82x of plain).
CALIBRATION_REPS = 3
COST_EMA = 0.1  # weight of one step's timing in the online cost estimate (steps are noisy on a shared CPU)


def time_forwards(ctx: Context, seq: int, ks: Iterable[int], repetitions: int, rng: random.Random,
                  sync: Callable[[], None]) -> dict[int, list[int]]:
    """ns of one decode of k rows (all with logits, as a verify batch) on sequence `seq` right after the cells it
    holds, for each k in `ks`. Repetitions are interleaved over k so slow drift of the machine spreads over every k
    instead of biasing the ratio; after each forward its rows are removed, so the KV cache is left as it was."""
    depth = ctx.lengths[seq]
    samples: dict[int, list[int]] = {k: [] for k in ks}
    n_vocab = ctx.config.n_vocab
    for _ in range(repetitions):
        for k in samples:
            batch = Batch()
            for i in range(k):
                batch.add(rng.randrange(n_vocab), depth + i, seq, True)
            sync()
            t0 = time.perf_counter_ns()
            ctx.decode(batch)
            sync()
            samples[k].append(time.perf_counter_ns() - t0)
            ctx.seq_rm(seq, depth)
    return samples


class CostModel:
    """Seconds of the verify side of a step (everything but drafting) as a function of the target forward's rows.

    Calibrated once, at the first step that needs it, by timing target forwards of CALIBRATION_ROWS rows at the
    depth of a real sequence (the minimum of 2), linear between points and extrapolated past the last.
    Refined online: each step's measured time updates an estimate for its row count, the mean of the curve's value
    (as one sample) and the steps seen so far until that is an EMA at COST_EMA. Row counts not seen yet use the curve
    moved as the nearest observed row counts moved (interpolated between them): by their gap between observed and
    calibrated times (what the bare forward does not see: verification, rollback, draft-simple mirroring the batch on
    the draft model) or by their ratio (a faster or slower machine), whichever reads lower (`_around_observed`).
    Why the early steps weigh so much: a calibration is cached and taken in whatever phase this VM was in, and the
    phases differ in shape, not only in level (qwen2.5-coder-1.5b, 2 threads: 1/2/3 rows 23.4/35.0/46.0 ms in one,
    35.2/39.6/37.4 in another). With the first shape and a weight of 0.1 per step, one 2-row probe at the real
    31 ms left the estimate at 37 ms: draft-simple, 98 % right on code edits, was dropped for the whole request
    (0.97x of plain against 1.35x with the other calibration, same runs)."""

    def __init__(self, cache: Path | None = None) -> None:
        self.cache = cache  # JSON file of earlier calibrations (a command's startup would pay ~3 s on a 1.5B model)
        # Calibration points, ascending: the same lists in every cold() copy, so whichever copy calibrates first
        # calibrates them all (a renewed session would otherwise time the refresh again for every request).
        self.rows: list[int] = []
        self.seconds: list[float] = []
        self.observed: dict[int, float] = {}  # rows -> the online estimate
        self.n_observed: dict[int, int] = {}

    @property
    def calibrated(self) -> bool:
        return bool(self.rows)

    def calibrate(self, ctx: Context, seq: int) -> None:
        """Time forwards on `seq` after the cells it holds (removed again); rows that do not fit are extrapolated.
        A calibration of the same model file, weights, device, threads, sequence count, torch and kernel build is
        read from the cache instead, and re-anchored to forwards of REFRESH_ROWS rows timed now: the rest of the
        curve moves with the nearest of them, as unseen row counts do online (`_around_observed`)."""
        key = _calibration_key(ctx)
        cached = _read_cache(self.cache).get(key) if self.cache and key else None
        room = min(ctx.n_ctx_seq - ctx.lengths[seq], ctx.n_batch)
        ks = REFRESH_ROWS if cached else CALIBRATION_ROWS + (MULTI_SEQ_ROWS if ctx.n_seq > 1 else ())
        ks = [k for k in ks if k <= room]
        sync = torch.cuda.synchronize if ctx.device.type == "cuda" else (lambda: None)
        rng = random.Random(0)
        # One 1-row warmup is enough: the prompt was just prefilled, and on the CPU no row count's first forward is
        # slower than its second there (qwen2.5-coder-0.5b, 1 thread); the minimum drops disturbed samples.
        time_forwards(ctx, seq, ks[:1], 1, rng, sync)
        samples = time_forwards(ctx, seq, ks, CALIBRATION_REPS, rng, sync)
        timed = {k: min(ns) / 1e9 for k, ns in samples.items()}
        if cached:
            self.set_points({int(k): v for k, v in cached.items()})
            self.observed = timed  # read the re-anchored curve off the online estimate, as if these were steps
            self.set_points({k: self(k) for k in {*self.rows, *timed}})
            self.observed = {}
            return
        self.set_points(timed)
        full = len(ks) == len(CALIBRATION_ROWS) + (len(MULTI_SEQ_ROWS) if ctx.n_seq > 1 else 0)
        if self.cache and key and full:  # a curve cut short by a small context is not kept
            _write_cache(self.cache, key, dict(zip(self.rows, self.seconds)))

    def cold(self) -> CostModel:
        """The calibration alone, without what the steps since taught it: what a new process plans with."""
        fresh = CostModel(self.cache)
        fresh.rows, fresh.seconds = self.rows, self.seconds
        return fresh

    def set_points(self, seconds_by_rows: dict[int, float]) -> None:
        self.rows[:] = sorted(seconds_by_rows)
        self.seconds[:] = [seconds_by_rows[k] for k in self.rows]

    def __call__(self, rows: int) -> float:
        seen = self.observed.get(rows)
        if seen is not None:
            return seen
        curve = self.curve(rows)
        gap = self._around_observed(rows, lambda k: self.observed[k] - self.curve(k), 0.0)
        ratio = self._around_observed(rows, lambda k: self.observed[k] / self.curve(k), 1.0)
        return min(curve + gap, curve * ratio)

    def _around_observed(self, rows: int, of: Callable[[int], float], default: float) -> float:
        """`of` at the observed row counts nearest to `rows`, interpolated between them (the nearest one's beyond
        them); `default` before any step. Two readings of how the steps differ from the calibration: a gap (what
        the bare forward does not see: verification, rollback, mirroring on a draft model) and a ratio (the
        machine faster or slower than when it was calibrated: the cached curve may come from another phase or
        another load). An unseen row count takes the lower of the two: a cost that reads high is never tried
        and never corrected. With the gap alone, a curve calibrated at twice today's times kept 17 rows at
        10 one-row forwards, where they cost 5, and ngram-mod's 16-token drafts, accepted whole, were cut to 2
        (replayed: 0.91x of --draft-max 16 on code edits; with the lower of the two, 0.99x)."""
        seen = sorted(self.observed)
        if not seen:
            return default
        i = bisect.bisect_left(seen, rows)
        lo, hi = seen[max(i - 1, 0)], seen[min(i, len(seen) - 1)]
        at_lo, at_hi = of(lo), of(hi)
        return at_lo if hi == lo else at_lo + (at_hi - at_lo) * (rows - lo) / (hi - lo)

    def curve(self, rows: int) -> float:
        """The calibrated time: linear between points, along the last segment past the last point (proportional
        to the rows when only one point fitted in the context), the first point's below it."""
        xs, ys = self.rows, self.seconds
        if len(xs) == 1:
            return ys[0] * rows / xs[0]
        if rows <= xs[0]:
            return ys[0]
        i = min(bisect.bisect_left(xs, rows), len(xs) - 1)
        slope = (ys[i] - ys[i - 1]) / (xs[i] - xs[i - 1])
        return ys[i - 1] + slope * (rows - xs[i - 1])

    def observe(self, rows: int, seconds: float) -> None:
        n = self.n_observed.get(rows, 0) + 1
        prior = self(rows)
        self.observed[rows] = prior + max(1 / (n + 1), COST_EMA) * (seconds - prior)
        self.n_observed[rows] = n


CACHE_ENTRIES = 32  # calibrations kept, newest last


def _calibration_key(ctx: Context) -> str | None:
    gf = ctx.loaded.gguf
    if gf is None:
        return None
    st = gf.path.stat()
    parts = (gf.path.resolve(), st.st_size, st.st_mtime_ns, ctx.loaded.weights, ctx.device, torch.get_num_threads(),
             ctx.n_seq, torch.__version__, kernels.build_id())  # a rebuilt kernel library has other speeds
    return "|".join(map(str, parts))


def _read_cache(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # none yet, or unreadable: calibrate again
    return data if isinstance(data, dict) else {}


def _write_cache(path: Path, key: str, seconds_by_rows: dict[int, float]) -> None:
    data = _read_cache(path)
    data.pop(key, None)
    data[key] = {str(k): v for k, v in seconds_by_rows.items()}
    data = dict(list(data.items())[-CACHE_ENTRIES:])
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data))
        tmp.replace(path)
    except OSError:
        pass  # a read-only cache only costs the next command a calibration
