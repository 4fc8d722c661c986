"""A model drafter's confidence as acceptance (`--draft-max auto`): how often the target accepts a draft token whose
top-1 probability under the drafter was p, given that it accepted the tokens before it, learned per drafter in bins
of p; and the gate that stops a draft where its next token no longer pays.

Why: the planner's per-position acceptance (adaptive.py) is an average over drafts, but the drafter says which of
its tokens are sure (EAGLE-2's observation: a draft model's confidence tracks acceptance). --draft-p-min stops a
draft at one fixed probability whatever drafting and verifying cost, so a cheap head (an EAGLE-3 token is 0.1 of a
target forward) stops where another token would pay and a draft model (0.4 of one for the 0.5b drafting the 1.5b)
drafts on where the chain's accepted prefix has become unlikely. The gate weighs each token: its expected gain (the
product of the calibrated rates of the draft's tokens so far) against what it costs at the rate the step is planned
to run at: its verify row, and where the draft goes on, the draft forward that shows the next token.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

# Upper edges of the confidence bins (the last bin runs to 1): finer near 1, where most of a good drafter's tokens are
CONFIDENCE_EDGES = (0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 0.98, 0.995)
CONFIDENCE_DECAY = 0.99  # per observation of a bin: a memory of ~100 tokens per bin
CONFIDENCE_PRIOR_WEIGHT = 2.0  # an unseen bin's rate is its confidence, counted as this many observations


def confidence_bin(p: float) -> int:
    return bisect.bisect_right(CONFIDENCE_EDGES, p)


def calibrated_gains(rates: tuple[float, ...], confidences) -> list[float]:
    """g_1..g_n of draft tokens with these confidences: g_j = the product of the calibrated rates of tokens 1..j."""
    out, g = [], 1.0
    for p in confidences:
        g *= rates[confidence_bin(p)]
        out.append(g)
    return out


def _bin_middles() -> tuple[float, ...]:
    edges = (0.0, *CONFIDENCE_EDGES, 1.0)
    return tuple((lo + hi) / 2 for lo, hi in zip(edges, edges[1:]))


BIN_MIDDLES = _bin_middles()


class ConfidenceModel:
    """Per drafter name and confidence bin, the conditional acceptance of a draft token: decayed hits over decayed
    trials with the bin's middle confidence as a prior (CONFIDENCE_PRIOR_WEIGHT observations, forgotten like the
    others). A token is tried when every token before it in its draft was accepted."""

    def __init__(self) -> None:
        self.counts: dict[str, list[list[float]]] = {}  # name -> per bin [hits, trials, prior weight]

    def observe(self, name: str, confidences: list[float], n_accepted: int) -> None:
        """A verified draft whose tokens had these confidences: the first n_accepted accepted, the next rejected."""
        counts = self.counts.setdefault(name, [[0.0, 0.0, CONFIDENCE_PRIOR_WEIGHT] for _ in BIN_MIDDLES])
        for i, p in enumerate(confidences[: n_accepted + 1]):
            c = counts[confidence_bin(p)]
            c[0] = CONFIDENCE_DECAY * c[0] + (i < n_accepted)
            c[1] = CONFIDENCE_DECAY * c[1] + 1.0
            c[2] *= CONFIDENCE_DECAY

    def mean(self, name: str) -> float:
        """The acceptance of a token of any confidence (0.5 for a drafter never observed, counted as one token)."""
        counts = self.counts.get(name, ())
        return (sum(c[0] for c in counts) + 0.5) / (sum(c[1] for c in counts) + 1.0)

    def rates(self, name: str) -> tuple[float, ...]:
        """The acceptance of a token per confidence bin (the bins' middles for a drafter never observed)."""
        counts = self.counts.get(name)
        if counts is None:
            return BIN_MIDDLES
        return tuple((hits + w * prior) / (trials + w) for (hits, trials, w), prior in zip(counts, BIN_MIDDLES))


@dataclass(frozen=True)
class DraftGate:
    """Where one step's draft of a model drafter stops paying, from the planner (adaptive.Planner.gate), in expected
    tokens: `rates` per confidence bin (ConfidenceModel); per draft position j (from 1), `row[j - 1]` the tokens its
    verify row costs at the step's planned rate; `ahead` the acceptance expected of the next token before it is seen
    (ConfidenceModel.mean: of any position, since a position the gate stopped drafting at would keep its own
    estimate for good); `forward` the tokens one draft forward costs at that rate."""

    rates: tuple[float, ...]
    row: tuple[float, ...]
    ahead: float
    forward: float

    def keeps(self, j: int, gain: float) -> bool:
        """Whether the j-th token, of expected gain `gain`, pays for its verify row."""
        return j <= len(self.row) and gain >= self.row[j - 1]

    def goes_on(self, j: int, gain: float) -> bool:
        """Whether drafting a (j + 1)-th token after the j-th, of expected gain `gain`, pays for the forward that
        shows it and its verify row, at the acceptance expected there."""
        return j < len(self.row) and gain * self.ahead >= self.forward + self.row[j]
