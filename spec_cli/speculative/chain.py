"""The drafter chain (llama.cpp `common_speculative`): which drafter's draft a sequence verifies, and the
counters/timers wrapped around every drafter call.

Selection (`--spec-select`):
  priority  llama.cpp's: drafters are asked in the registry's fixed priority order, the first non-empty draft wins.
  gain      every cheap drafter (`Drafter.cheap`: the n-gram family, drafting costs them next to nothing) proposes,
            and a sequence verifies the proposal with the most expected committed tokens, E(k) = 1 + g_1 + ... + g_k
            from the proposer's running acceptance per position (adaptive.AcceptanceModel, the planner's own with
            --draft-max auto); ties go by priority. Model drafters, whose tokens cost a forward each, are asked only
            where no cheap drafter proposed, in priority order as before.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import replace

from spec_cli.model.batch import Batch
from spec_cli.model.state_arrays import State, prefixed, within
from spec_cli.speculative.adaptive import AcceptanceModel, Planner, expected_tokens
from spec_cli.speculative.base import Drafter, DraftParams
from spec_cli.speculative.stats import DrafterStats


class Chain:
    def __init__(self, drafters: list[Drafter], n_seq: int, planner: Planner | None = None, select: str = "priority"):
        self.drafters = drafters
        self.stats = {d.name: DrafterStats(d.name) for d in drafters}
        self.last: list[Drafter | None] = [None] * n_seq  # which drafter produced each sequence's current draft
        # --draft-max auto: what the planner learned about these drafters lives and resets with them
        self.planner = planner
        if planner is not None:
            planner.per_call = frozenset(d.name for d in drafters if d.per_call)
        self.select = select
        # per sequence, this step's drafts of drafters asked only to be scored (`draft`'s `shadow`), never verified
        self.shadows: dict[int, list[tuple[str, list[int]]]] = {}
        # what `gain` ranks proposals by: the planner's acceptance, else the chain's own (fed by accept())
        self.acceptance = planner.acceptance if planner is not None else AcceptanceModel()

    @property
    def names(self) -> list[str]:
        return [d.name for d in self.drafters]

    @property
    def free_names(self) -> frozenset[str]:
        """The drafters whose asking costs next to nothing (`Drafter.cheap`: the n-gram family)."""
        return frozenset(d.name for d in self.drafters if d.cheap)

    def begin(self, seq: int, prompt: list[int]) -> None:
        self.last[seq] = None
        if self.planner is not None:
            self.planner.begin_request()
        for d in self.drafters:
            t0 = time.perf_counter()
            d.begin(seq, prompt)
            seconds = time.perf_counter() - t0
            st = self.stats[d.name]
            st.n_call_begin += 1
            st.t_begin_us += seconds * 1e6
            if self.planner is not None:
                self.planner.observe_mirroring(d.name, seconds)

    def process(self, batch: Batch) -> None:
        for d in self.drafters:
            t0 = time.perf_counter()
            d.process(batch)
            if self.planner is not None:
                self.planner.observe_mirroring(d.name, time.perf_counter() - t0)

    def draft(self, params: list[DraftParams], enabled: dict[int, set[str]] | None = None,
              caps: dict[str, int] | None = None, shadow: frozenset[str] = frozenset()) -> dict[str, float]:
        """Fill `result` of every drafting sequence by the chain's selection mode (module docstring).
        `enabled` optionally restricts, per sequence, which drafter names may draft (per-request types); `caps`
        optionally limits, per drafter name, the tokens it may draft this step (0: it is not asked), so a drafter
        does not produce (and pay for) tokens the adaptive planner would not verify. A drafter in `shadow` (cheap,
        capped at 0) is asked apart from the others, its drafts kept in `shadows` to be scored against what the
        step commits, never verified. Returns the seconds spent in each drafter that was asked, drafting: a
        drafter's optional `catch_up(params)` (bringing a lagging cache up to date) runs first and is left out."""
        for p in params:
            self.last[p.seq] = None
        self.shadows = {}
        spent: dict[str, float] = {}
        proposals: dict[int, list[tuple[Drafter, DraftParams]]] = {}  # gain: per sequence, every n-gram proposal
        for d in self.drafters:
            cap = caps.get(d.name) if caps is not None else None
            allowed = [p for p in params if enabled is None or d.name in enabled.get(p.seq, ())]
            if d.name in shadow and d.cheap:
                if allowed:
                    spent[d.name] = self._shadow(d, allowed)
                continue
            asking = [p for p in allowed if p.drafting]
            if not asking or cap == 0:
                continue
            if self.select == "gain" and d.cheap:
                # a proposal apart from the others'
                own = [replace(p, result=[], probs=None, confidence=[]) for p in asking]
                spent[d.name] = self._ask(d, own, cap)
                for p, mine in zip(asking, own):
                    if mine.result:
                        proposals.setdefault(p.seq, []).append((d, mine))
                continue
            if proposals:  # gain: the model drafters only draft where no n-gram drafter proposed
                self._choose(params, proposals)
                proposals = {}
                asking = [p for p in asking if p.drafting]
                if not asking:
                    continue
            spent[d.name] = self._ask(d, asking, cap)
            for p in asking:
                if p.result:
                    self._settle(d, p)
        self._choose(params, proposals)
        return spent

    def _shadow(self, d: Drafter, params: list[DraftParams]) -> float:
        """Ask cheap drafter d for drafts that no sequence verifies; returns its drafting seconds."""
        own = [replace(p, result=[], probs=None, confidence=[], drafting=True) for p in params]
        seconds = self._ask(d, own, None)
        for p, mine in zip(params, own):
            if mine.result:
                self.shadows.setdefault(p.seq, []).append((d.name, mine.result))
        return seconds

    def _ask(self, d: Drafter, asking: list[DraftParams], cap: int | None) -> float:
        """One draft call of d for `asking` (each p.n_max lowered to cap); returns its drafting seconds."""
        if self.planner is not None and not d.cheap and not d.per_call:
            gate = self.planner.gate(d.name, len(asking))  # where its tokens stop paying (a model drafter's)
            for p in asking:
                p.gate = gate
        with _capped(asking, cap):
            t_catch_up = time.perf_counter()
            d.catch_up(asking)  # a lagging cache is the drafter's time, but not the price of its tokens
            t0 = time.perf_counter()
            d.draft(asking)
            t1 = time.perf_counter()
            for p in asking:
                p.truncate(p.n_max)
                if not p.result:
                    p.probs = None
            lengths = [(len(p.result), p.n_max) for p in asking]
        st = self.stats[d.name]
        st.n_call_draft += 1
        for p in asking:
            if p.crossed is not None:  # a draft model with another vocabulary (vocab_bridge.py)
                st.n_mapped += p.crossed[0]
                st.n_unmapped += p.crossed[1]
        n_drafts = sum(1 for p in asking if p.result)
        st.n_proposed += n_drafts
        if self.planner is not None:
            self.planner.observe_catch_up(d.name, t0 - t_catch_up)
            self.planner.observe_drafting(d.name, t1 - t0, lengths)
        st.t_draft_us += (t1 - t_catch_up) * 1e6
        return t1 - t0

    def _choose(self, params: list[DraftParams], proposals: dict[int, list[tuple[Drafter, DraftParams]]]) -> None:
        """gain: each sequence takes its proposal with the most expected committed tokens (first = priority wins
        ties)."""
        for p in params:
            ranked = proposals.get(p.seq)
            if not ranked:
                continue
            d, best = max(ranked, key=lambda c: expected_tokens(self.acceptance.gains(c[0].name), len(c[1].result)))
            p.result, p.probs, p.confidence = best.result, best.probs, best.confidence
            self._settle(d, p)

    def _settle(self, d: Drafter, p: DraftParams) -> None:
        """p verifies d's (non-empty, capped) draft this step."""
        p.drafting = False
        self.last[p.seq] = d

    def winner(self, seq: int) -> str | None:
        """Name of the drafter whose draft `seq` verifies this step."""
        d = self.last[seq]
        return d.name if d is not None else None

    def cut(self, p: DraftParams, n: int) -> None:
        """Verify only the first n tokens of p's draft (adaptive draft length; 0 = no draft this step). Verifying a
        prefix of a draft is as lossless as verifying all of it. The winner hears of the cut by `shorten(seq, n)`
        (ngram-mod judges its acceptance fraction against the verified length). A draft cut below the winner's
        `min_length` (a model drafter's --draft-min) is dropped whole, as the drafter drops a short draft itself."""
        winner = self.last[p.seq]
        if winner is None:
            return
        if n < winner.min_length(p):
            n = 0
        p.truncate(n)
        winner.shorten(p.seq, n)
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
        if winner is not None and self.planner is None:  # with a planner, the step loop tells it (observe_accept)
            self.acceptance.observe(winner.name, n_drafted, n_accepted)
        self.last[seq] = None

    def end(self, seq: int, output: list[int]) -> None:
        """The request on seq is over; `output` = the tokens it generated."""
        for d in self.drafters:
            d.end(seq, output)

    # --- slot files: every drafter's state of one sequence, under its name ----------------------------------------

    def save_state(self, seq: int) -> State:
        return {k: v for d in self.drafters for k, v in prefixed(f"{d.name}/", d.save_state(seq)).items()}

    def restore_state(self, seq: int, state: State, n_vocab: int) -> None:
        for d in self.drafters:
            d.restore_state(seq, within(state, f"{d.name}/"), n_vocab)
        self.last[seq] = None

    def forget(self, seq: int) -> None:
        for d in self.drafters:
            d.forget(seq)
        self.last[seq] = None

    def slot_info(self, seq: int) -> dict[str, dict]:
        return {d.name: d.slot_info(seq) for d in self.drafters}


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
