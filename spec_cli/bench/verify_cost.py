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
The timing itself (`time_forwards`) lives in speculative/verify_costs.py, whose cost model `--draft-max auto` plans with.
"""

from __future__ import annotations


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
