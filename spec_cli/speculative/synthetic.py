"""Synthetic acceptance (`bench --spec-accept P`, as llama.cpp #27711 and vLLM's synthetic rejection sampling): drafts
of the planned lengths whose accepted length is drawn from P, so that the cost of verify batches, rollback and the
drafting machinery at a given acceptance can be measured on any model, random-weight ones included.

Unlike those engines, which accept draft tokens the target did not choose (the text is then no model's), the draft
here is built so that the target itself accepts exactly the drawn number of tokens: the target's own greedy
continuation (generated beforehand, without speculation) up to the drawn point, then a token it will not choose,
then the continuation again to the planned length. The output stays the target's greedy output, token for token.

P is a conditional acceptance rate per draft position: `0.8` (every position), or `0.9/0.8/0.6` (position 1, 2, 3,
then 0.6 for the rest); position i is accepted with its rate when positions 1..i-1 were, so the unconditional rate of
position i (what a row's acc/pos reports) is the product of the first i rates. Draws come from a generator seeded once
per drafter: the same seed, the same draws.
"""

from __future__ import annotations

import random

from spec_cli.speculative.base import DraftParams, HistoryDrafter

NAME = "synthetic"


class SyntheticDrafter(HistoryDrafter):
    """Drafts p.n_max tokens of which the target accepts a drawn number (module docstring). `references` maps a
    prompt (as a tuple) to its greedy continuation, the last sampled token included; a prompt without one, or a
    history that left it, gets no draft."""

    name = NAME

    def __init__(self, rates: list[float], seed: int, references: dict[tuple[int, ...], list[int]], n_vocab: int,
                 n_seq: int) -> None:
        self.rates = rates
        self.rng = random.Random(seed)
        self.references = references
        self.n_vocab = n_vocab
        self.reference: list[list[int] | None] = [None] * n_seq  # per sequence: its request's continuation
        self.n_prompt = [0] * n_seq

    def begin(self, seq: int, prompt: list[int]) -> None:
        self.reference[seq] = self.references.get(tuple(prompt))
        self.n_prompt[seq] = len(prompt)

    def accepted_length(self, n: int) -> int:
        """How many of n draft tokens the target is to accept: a draw per position while they are accepted."""
        k = 0
        while k < n and self.rng.random() < self.rates[min(k, len(self.rates) - 1)]:
            k += 1
        return k

    def draft_one(self, p: DraftParams) -> list[int]:
        reference, n_prompt = self.reference[p.seq], self.n_prompt[p.seq]
        done = len(p.prompt) - n_prompt + 1  # tokens generated so far, id_last included
        if reference is None or reference[:done] != p.prompt[n_prompt:] + [p.id_last]:
            return []
        ahead = reference[done : done + p.n_max]
        k = self.accepted_length(len(ahead))
        if k < len(ahead):  # the target's token there is ahead[k]: any other is rejected
            ahead[k] = (ahead[k] + 1) % self.n_vocab
        return ahead
