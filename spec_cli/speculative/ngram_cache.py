"""`ngram-cache` (lookup decoding): counts of the tokens that followed each 1..4-gram, in three tiers.

Mirrors llama.cpp common/ngram-cache.cpp (`common_ngram_cache_update/_draft`, PRs #5479, #6828, #6848, #8648)
and the `ngram-cache` spec type (`common_speculative_impl_ngram_cache`); the lookup tools (spec_cli/runtime/lookup.py,
spec_cli/runtime/lookup_offline.py) count and draft with the same functions.
Tiers: the context cache (this request's text, lax thresholds), the dynamic cache (earlier generations, strict
thresholds) and the static cache (corpus bigrams: a weight on the other tiers' candidates, and the last resort).
The caches' files (llama.cpp's byte format) are read and written by ngram_cache_file.py. A slot file holds a
sequence's context cache; the dynamic and static caches are files of their own (-lcd, -lcs).
"""

from __future__ import annotations

import os

import numpy as np

from spec_cli.errors import SpecCliError, StateError
from spec_cli.model.state_arrays import State, counters, entry
from spec_cli.speculative.base import DraftParams, HistoryDrafter, SpecParams
from spec_cli.speculative.ngram_cache_file import Ngram, NgramCache, load_cache, merge_caches, save_cache

NGRAM_MIN = 1  # LLAMA_NGRAM_MIN
NGRAM_MAX = 4  # LLAMA_NGRAM_MAX
NGRAM_STATIC = 2  # LLAMA_NGRAM_STATIC: the static cache holds bigrams
TOKEN_NULL = -1  # pads an n-gram shorter than NGRAM_MAX
SPEC_N_DRAFT = 8  # draft length of the ngram-cache spec type (then cut to the per-call cap)

# Indexed by n - ngram_min (n - 1 with ngram_min = 1): minimum sum of counts, minimum share of the pick.
MIN_SAMPLE_LAX = (2, 2, 1, 1)
MIN_PERCENT_LAX = (66, 50, 50, 50)
MIN_SAMPLE_STRICT = (4, 3, 2, 2)
MIN_PERCENT_STRICT = (75, 66, 66, 66)


def make_ngram(tokens: list[int]) -> Ngram:
    return tuple(tokens) + (TOKEN_NULL,) * (NGRAM_MAX - len(tokens))  # type: ignore[return-value]


def ngram_cache_update(cache: NgramCache, ngram_min: int, ngram_max: int, tokens: list[int], n_new: int) -> None:
    """Count, for each n, the token at every position of the last n_new that has n tokens before it."""
    for n in range(ngram_min, ngram_max + 1):
        for i in range(max(len(tokens) - n_new, n), len(tokens)):
            part = cache.setdefault(make_ngram(tokens[i - n : i]), {})
            part[tokens[i]] = part.get(tokens[i], 0) + 1


def _try_primary(
    cache: NgramCache, ngrams: list[Ngram | None], part_static: dict[int, int],
    min_sample: tuple[int, ...], min_percent: tuple[int, ...],
) -> int | None:
    """Longest n-gram first: the candidate maximizing count x static weight, if it passes the thresholds."""
    for i in reversed(range(len(ngrams))):
        part = cache.get(ngrams[i]) if ngrams[i] is not None else None
        if part is None:
            continue
        pick, pick_count, pick_weight, total = None, 0, 0, 0
        for token, count in part.items():
            weight = 100 * part_static[token] if token in part_static else 1
            if count * weight > pick_count * pick_weight:
                pick, pick_count, pick_weight = token, count, weight
            total += count
        if total >= min_sample[i] and 100 * pick_count >= min_percent[i] * total:
            return pick
    return None


def _try_static(nc_static: NgramCache, ngram: Ngram) -> int | None:
    part = nc_static.get(ngram)
    if not part:
        return None
    pick = max(part, key=part.__getitem__)  # first of the most frequent, like the strict > in llama.cpp
    total = sum(part.values())
    k = NGRAM_STATIC - 1
    if total < MIN_SAMPLE_LAX[k] or 100 * part[pick] < MIN_PERCENT_LAX[k] * total:
        return None
    return pick


def ngram_cache_draft(
    inp: list[int], n_draft: int, ngram_min: int, ngram_max: int,
    nc_context: NgramCache, nc_dynamic: NgramCache, nc_static: NgramCache,
) -> list[int]:
    """Up to n_draft tokens continuing `inp` (which ends with id_last); context, then dynamic, then static."""
    if len(inp) < NGRAM_STATIC:
        return []
    window = list(inp[-max(ngram_max, NGRAM_STATIC) :])  # only the tail is ever looked at
    draft: list[int] = []
    while len(draft) < n_draft:
        ngram_static = make_ngram(window[-NGRAM_STATIC:])
        part_static = nc_static.get(ngram_static, {})
        # n-grams longer than the history cannot occur in any cache (llama.cpp reads out of bounds here).
        ngrams = [make_ngram(window[-n:]) if n <= len(window) else None for n in range(ngram_min, ngram_max + 1)]
        token = _try_primary(nc_context, ngrams, part_static, MIN_SAMPLE_LAX, MIN_PERCENT_LAX)
        if token is None:
            token = _try_primary(nc_dynamic, ngrams, part_static, MIN_SAMPLE_STRICT, MIN_PERCENT_STRICT)
        if token is None:
            token = _try_static(nc_static, ngram_static)
        if token is None:
            break
        draft.append(token)
        window.append(token)
    return draft


class NgramCacheDrafter(HistoryDrafter):
    name = "ngram-cache"

    def __init__(self, params: SpecParams, n_seq: int) -> None:
        self.static: NgramCache = load_cache(params.lookup_cache_static) if params.lookup_cache_static else {}
        self.dynamic_path = params.lookup_cache_dynamic
        # A missing dynamic cache is normal: lookup creates it at the end of the run.
        exists = self.dynamic_path is not None and os.path.exists(self.dynamic_path)
        self.dynamic: NgramCache = load_cache(self.dynamic_path) if exists else {}
        self.contexts: list[NgramCache] = [{} for _ in range(n_seq)]
        self.n_indexed = [0] * n_seq  # tokens of the history already counted in the context cache
        # llama-lookup drafts --draft-max tokens; the spec type keeps llama.cpp's fixed 8 (the command sets this).
        self.n_draft = SPEC_N_DRAFT

    def begin(self, seq: int, prompt: list[int]) -> None:
        # A fresh context cache per request: llama.cpp keeps the previous request's (#27852).
        self.contexts[seq] = {}
        ngram_cache_update(self.contexts[seq], NGRAM_MIN, NGRAM_MAX, prompt, len(prompt))
        self.n_indexed[seq] = len(prompt)

    def draft_one(self, p: DraftParams) -> list[int]:
        context = self.contexts[p.seq]
        size = len(p.prompt) + 1  # the history ends with id_last
        if size < self.n_indexed[p.seq]:  # shrank without a begin: count it again from scratch
            context.clear()
            self.n_indexed[p.seq] = 0
        # Accepted tokens reach us through the prompt; count the new ones (with NGRAM_MAX tokens before).
        tail = p.prompt[max(self.n_indexed[p.seq] - NGRAM_MAX, 0) :] + [p.id_last]
        ngram_cache_update(context, NGRAM_MIN, NGRAM_MAX, tail, size - self.n_indexed[p.seq])
        self.n_indexed[p.seq] = size
        draft = ngram_cache_draft(tail, self.n_draft, NGRAM_MIN, NGRAM_MAX, context, self.dynamic, self.static)
        return draft[: max(p.n_max, 0)]

    def accept(self, seq: int, n_accepted: int, is_other: bool) -> None:
        pass

    def save_state(self, seq: int) -> State:
        """The context cache as rows (n-gram [NGRAM_MAX], token, count)."""
        rows = [(*ngram, token, count) for ngram, part in self.contexts[seq].items() for token, count in part.items()]
        return {"context": np.asarray(rows, dtype=np.int64).reshape(-1, NGRAM_MAX + 2),
                "n_indexed": np.asarray([self.n_indexed[seq]])}

    def restore_state(self, seq: int, state: State, n_vocab: int) -> None:
        rows = entry(state, "context", ndim=2)
        ngram_ids, tokens_counts = rows[:, :NGRAM_MAX], rows[:, NGRAM_MAX:]
        if rows.shape[1] != NGRAM_MAX + 2 or (rows.size and (
                ngram_ids.min() < TOKEN_NULL or ngram_ids.max() >= n_vocab or tokens_counts[:, 0].min() < 0
                or tokens_counts[:, 0].max() >= n_vocab or tokens_counts[:, 1].min() < 1)):
            raise StateError(f"'context' is not rows of {NGRAM_MAX} n-gram ids, a token and a count")
        (n_indexed,) = counters(state, "n_indexed", 1)
        context: NgramCache = {}
        for *ngram, token, count in rows.tolist():
            context.setdefault(tuple(ngram), {})[token] = count
        self.contexts[seq], self.n_indexed[seq] = context, n_indexed

    def forget(self, seq: int) -> None:
        self.contexts[seq], self.n_indexed[seq] = {}, 0

    def slot_info(self, seq: int) -> dict:
        return {"n_ngrams": len(self.contexts[seq])}

    def save_dynamic(self, path: str | None = None) -> None:
        """Merge every sequence's context cache into the dynamic cache and write it (end of llama-lookup).

        Call once per run: the merged counts stay in the dynamic cache.
        """
        path = path or self.dynamic_path
        if not path:
            raise SpecCliError("no path to save the dynamic lookup cache to (-lcd)")
        for context in self.contexts:
            merge_caches(self.dynamic, context)
        save_cache(self.dynamic, path)
