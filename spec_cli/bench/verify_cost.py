"""Verify-cost curve: the time of one target forward of k rows at depth d, k = 1..K, and the break-even point of
speculation at each k (the measurement suggested in llama.cpp PR #18471's thread; data for an adaptive draft length).

Why it matters: a speculative step sends k = 1 + n_draft rows (id_last plus the draft) through the target in one
forward and keeps L of them on average (the mean acceptance length, which counts the target's own token, so
1 <= L <= k). Plain decoding gets 1 token per cost(1). Speculating with k rows pays off when

    L / cost(k) > 1 / cost(1)   <=>   L > cost(k) / cost(1)

so the break-even mean acceptance length at k is exactly `cost_ratio = cost(k) / cost(1)` (drafting time, which
comes on top, is left out: it depends on the drafter, not on the target). If each draft token is accepted
independently with probability a, then L = 1 + a + ... + a^(k-1) = (1 - a^k) / (1 - a); `break_even_acc` is the a
that makes L equal the cost ratio (0 when the ratio is <= 1, i.e. verifying k rows costs no more than one; None
when the ratio is >= k, i.e. even a perfect drafter cannot win at that k).

On GPUs cost(k) stays near cost(1) for small k (weights are read once); on CPUs torch's matrix products for a few
rows can cost several times one row (see shared/models/README.md), which is why this curve is measured, not assumed.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

from spec_cli.batch import Batch
from spec_cli.context import Context


def time_forwards(ctx: Context, depth: int, k_max: int, repetitions: int, rng: random.Random,
                  sync: Callable[[], None]) -> dict[int, list[int]]:
    """ns of one decode of k rows (all with logits, as a verify batch) at positions depth..depth+k-1 of sequence 0,
    which already holds `depth` cells. Repetitions are interleaved over k (k = 1..K, then again) so slow drift of
    the machine spreads over every k instead of biasing the ratio; after each forward the rows are removed."""
    samples: dict[int, list[int]] = {k: [] for k in range(1, k_max + 1)}
    n_vocab = ctx.config.n_vocab
    for _ in range(repetitions):
        for k in samples:
            batch = Batch()
            for i in range(k):
                batch.add(rng.randrange(n_vocab), depth + i, 0, True)
            sync()
            t0 = time.perf_counter_ns()
            ctx.decode(batch)
            sync()
            samples[k].append(time.perf_counter_ns() - t0)
            ctx.seq_rm(0, depth)
    return samples


def curve(samples: dict[int, list[int]]) -> list[dict]:
    """Per k: mean ns, cost(k)/cost(1), break-even mean acceptance length and per-token acceptance."""
    mean = {k: sum(v) / len(v) for k, v in samples.items()}
    base = mean[1]
    rows = []
    for k in sorted(mean):
        ratio = mean[k] / base
        rows.append({"verify_k": k, "cost_ratio": ratio, "break_even_len": ratio,
                     "break_even_acc": break_even_acceptance(ratio, k)})
    return rows


def expected_length(acc: float, k: int) -> float:
    """Mean tokens per step with k verify rows when each draft token is accepted with probability acc."""
    return float(k) if acc >= 1.0 else (1.0 - acc**k) / (1.0 - acc)


def break_even_acceptance(ratio: float, k: int) -> float | None:
    """The per-token acceptance a with expected_length(a, k) == ratio (bisection; the length grows with a)."""
    if ratio <= 1.0:
        return 0.0
    if ratio >= k:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if expected_length(mid, k) < ratio:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2
