"""`ngram-simple`: copy what followed the most recent earlier occurrence of the last n tokens.

Mirrors llama.cpp `common_ngram_simple_draft` (common/ngram-map.cpp) and `common_speculative_impl_ngram_simple`.
Stateless: `begin`, `process` and `accept` do nothing, and a slot file holds nothing of it.
"""

from __future__ import annotations

import numpy as np

from spec_cli.model.state_arrays import State
from spec_cli.speculative.base import DraftParams, HistoryDrafter, SpecParams


def ngram_simple_draft(prompt: list[int], id_last: int, size_n: int, size_m: int) -> list[int]:
    """The draft for history `prompt + [id_last]`, or [] when there is no usable match.

    As in llama.cpp, lengths count `prompt` only (`cur_len`, id_last excluded): the pattern is the last
    n-1 prompt tokens plus id_last; start positions are searched from cur_len-n-1 down to 1 (position 0
    never matches), and the draft copies at most m tokens of the prompt after the match, and at least n.
    """
    n, m = size_n, size_m
    cur_len = len(prompt)
    if cur_len <= n + m + 1:
        return []
    pattern = prompt[cur_len - n + 1 :] + [id_last]

    # Candidate starts j in [1, cur_len-n-1]; test all at once, then take the highest (most recent).
    hist = np.asarray(prompt, dtype=np.int64)
    n_cand = cur_len - n - 1
    hit = np.ones(n_cand, dtype=bool)  # [n_cand], entry j-1 is start j
    for k in range(n):
        hit &= hist[1 + k : 1 + k + n_cand] == pattern[k]
    starts = np.flatnonzero(hit)
    if starts.size == 0:
        return []
    j = int(starts[-1]) + 1

    copy_max = min(m, cur_len - (j + n))
    if copy_max < n:
        return []
    return prompt[j + n : j + n + copy_max]


class NgramSimpleDrafter(HistoryDrafter):
    name = "ngram-simple"

    def __init__(self, params: SpecParams, n_seq: int) -> None:
        # min_hits exists as a flag but llama.cpp's ngram-simple never reads it.
        self.size_n = params.ngram_simple_size_n
        self.size_m = params.ngram_simple_size_m
        self.n_seq = n_seq

    def draft_one(self, p: DraftParams) -> list[int]:
        return ngram_simple_draft(p.prompt, p.id_last, self.size_n, self.size_m)

    def save_state(self, seq: int) -> State:
        return {}

    def restore_state(self, seq: int, state: State, n_vocab: int) -> None:
        pass
