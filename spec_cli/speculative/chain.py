"""The drafter chain (llama.cpp `common_speculative`): `--spec-type` parsing, fixed priority order, first
non-empty draft per sequence wins, and the counters/timers wrapped around every drafter call."""

from __future__ import annotations

import time
from contextlib import contextmanager

from spec_cli.batch import Batch
from spec_cli.errors import UsageError
from spec_cli.speculative.adaptive import Planner
from spec_cli.speculative.base import DraftParams, Drafter
from spec_cli.speculative.stats import DrafterStats

# llama.cpp creates implementations in this order whatever the command line says: draftless n-gram types first
PRIORITY = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache", "draft-simple", "draft-mtp")
ALIASES = {"draft": "draft-simple", "mtp": "draft-mtp"}
MODEL_TYPES = ("draft-simple", "draft-mtp")


def parse_spec_types(values: list[str] | str | None) -> list[str]:
    """Comma lists, repeatable; `none` anywhere disables; returns canonical names in priority order."""
    if values is None:
        return []
    if isinstance(values, str):
        values = [values]
    names: list[str] = []
    for value in values:
        for raw in value.split(","):
            name = raw.strip().lower()
            if not name:
                continue
            name = ALIASES.get(name, name)
            if name != "none" and name not in PRIORITY:
                valid = ", ".join(("none",) + PRIORITY + tuple(ALIASES))
                raise UsageError(f"unknown --spec-type '{raw.strip()}' (valid: {valid})")
            names.append(name)
    if "none" in names:
        return []
    return [n for n in PRIORITY if n in names]


class Chain:
    def __init__(self, drafters: list[Drafter], n_seq: int, planner: Planner | None = None):
        self.drafters = drafters
        self.stats = {d.name: DrafterStats(d.name) for d in drafters}
        self.last: list[Drafter | None] = [None] * n_seq  # which drafter produced each sequence's current draft
        # --draft-max auto: what the planner learned about these drafters lives and resets with them
        self.planner = planner

    @property
    def names(self) -> list[str]:
        return [d.name for d in self.drafters]

    def begin(self, seq: int, prompt: list[int]) -> None:
        self.last[seq] = None
        for d in self.drafters:
            t0 = time.perf_counter()
            d.begin(seq, prompt)
            st = self.stats[d.name]
            st.n_call_begin += 1
            st.t_begin_us += (time.perf_counter() - t0) * 1e6

    def process(self, batch: Batch) -> None:
        for d in self.drafters:
            d.process(batch)

    def draft(self, params: list[DraftParams], enabled: dict[int, set[str]] | None = None,
              caps: dict[str, int] | None = None) -> dict[str, float]:
        """Fill `result` of every drafting sequence: first non-empty draft in priority order wins.
        `enabled` optionally restricts, per sequence, which drafter names may draft (per-request types); `caps`
        optionally limits, per drafter name, the tokens it may draft this step (0: it is not asked), so a drafter
        does not produce (and pay for) tokens the adaptive planner would not verify. Returns the seconds spent in
        each drafter that was asked, drafting: a drafter's optional `catch_up(params)` (bringing a lagging cache up
        to date) runs first and is left out."""
        for p in params:
            self.last[p.seq] = None
        spent: dict[str, float] = {}
        for d in self.drafters:
            cap = caps.get(d.name) if caps is not None else None
            asking = [p for p in params if p.drafting and (enabled is None or d.name in enabled.get(p.seq, ()))]
            if not asking or cap == 0:
                continue
            with _capped(asking, cap):
                t_catch_up = time.perf_counter()
                catch_up = getattr(d, "catch_up", None)
                if catch_up is not None:  # a lagging cache is the drafter's time, but not the price of its tokens
                    catch_up(asking)
                t0 = time.perf_counter()
                d.draft(asking)
                t1 = time.perf_counter()
                spent[d.name] = t1 - t0
                for p in asking:
                    self._settle(d, p)
            st = self.stats[d.name]
            st.n_call_draft += 1
            st.t_draft_us += (t1 - t_catch_up) * 1e6
        return spent

    def _settle(self, d: Drafter, p: DraftParams) -> None:
        """After d drafted for p: an empty result passes p on to the next drafter, a draft is truncated to p's cap."""
        if not p.result:
            p.probs = None
            return
        if len(p.result) > p.n_max:
            del p.result[p.n_max:]
            if p.probs is not None:
                p.probs = p.probs[: p.n_max]
        p.drafting = False
        self.last[p.seq] = d

    def winner(self, seq: int) -> str | None:
        """Name of the drafter whose draft `seq` verifies this step."""
        d = self.last[seq]
        return d.name if d is not None else None

    def cut(self, p: DraftParams, n: int) -> None:
        """Verify only the first n tokens of p's draft (adaptive draft length; 0 = no draft this step). Verifying a
        prefix of a draft is as lossless as verifying all of it. A drafter whose accept-time bookkeeping depends on
        its draft's length defines `shorten(seq, n)` and hears of the cut (ngram-mod's acceptance fraction).
        A model drafter's draft cut below --draft-min is dropped whole, as the drafter drops a short draft itself."""
        winner = self.last[p.seq]
        if winner is not None and winner.name in MODEL_TYPES and n < p.min_length(winner.params):
            n = 0
        del p.result[n:]
        if p.probs is not None:
            p.probs = p.probs[:n] if n else None
        shorten = getattr(winner, "shorten", None)
        if shorten is not None:
            shorten(p.seq, n)
        if n == 0:
            self.last[p.seq] = None

    def accept(self, seq: int, n_drafted: int, n_accepted: int) -> None:
        """The target verified n_drafted draft tokens of `seq` and accepted n_accepted. The winner's counters
        count drafts as verified (after any cut), so acceptance is measured against what the target saw."""
        winner = self.last[seq]
        if winner is None and n_accepted:
            raise AssertionError("accepted tokens without a draft")
        for d in self.drafters:
            t0 = time.perf_counter()
            d.accept(seq, n_accepted, d is not winner)
            if d is winner:
                st = self.stats[d.name]
                st.observe_draft(n_drafted)
                st.observe_accept(n_accepted)
                st.t_accept_us += (time.perf_counter() - t0) * 1e6
        self.last[seq] = None


@contextmanager
def _capped(params: list[DraftParams], cap: int | None):
    """Lower every p.n_max to `cap` for one drafter's call, restoring it for the drafters after it."""
    full = [p.n_max for p in params]
    if cap is not None:
        for p in params:
            p.n_max = min(p.n_max, cap)
    try:
        yield
    finally:
        for p, n_max in zip(params, full):
            p.n_max = n_max
