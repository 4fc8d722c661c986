"""The drafter chain (llama.cpp `common_speculative`): `--spec-type` parsing, fixed priority order, first
non-empty draft per sequence wins, and the counters/timers wrapped around every drafter call."""

from __future__ import annotations

import time

from spec_cli.batch import Batch
from spec_cli.errors import UsageError
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
    def __init__(self, drafters: list[Drafter], n_seq: int):
        self.drafters = drafters
        self.stats = {d.name: DrafterStats(d.name) for d in drafters}
        self.last: list[Drafter | None] = [None] * n_seq  # which drafter produced each sequence's current draft

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

    def draft(self, params: list[DraftParams], enabled: dict[int, set[str]] | None = None) -> None:
        """Fill `result` of every drafting sequence: first non-empty draft in priority order wins.
        `enabled` optionally restricts, per sequence, which drafter names may draft (per-request types)."""
        for p in params:
            self.last[p.seq] = None
        for d in self.drafters:
            asking = [p for p in params if p.drafting and (enabled is None or d.name in enabled.get(p.seq, ()))]
            if not asking:
                continue
            t0 = time.perf_counter()
            d.draft(asking)
            st = self.stats[d.name]
            st.n_call_draft += 1
            st.t_draft_us += (time.perf_counter() - t0) * 1e6
            for p in asking:
                if not p.result:
                    p.probs = None
                    continue
                if len(p.result) > p.n_max:
                    del p.result[p.n_max:]
                    if p.probs is not None:
                        p.probs = p.probs[: p.n_max]
                p.drafting = False
                self.last[p.seq] = d
                st.observe_draft(len(p.result))

    def accept(self, seq: int, n_accepted: int) -> None:
        winner = self.last[seq]
        if winner is None and n_accepted:
            raise AssertionError("accepted tokens without a draft")
        for d in self.drafters:
            t0 = time.perf_counter()
            d.accept(seq, n_accepted, d is not winner)
            if d is winner:
                st = self.stats[d.name]
                st.observe_accept(n_accepted)
                st.t_accept_us += (time.perf_counter() - t0) * 1e6
        self.last[seq] = None
