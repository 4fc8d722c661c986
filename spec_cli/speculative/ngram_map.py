"""`ngram-map-k` and `ngram-map-k4v`: a per-sequence map from key n-grams to the m-grams that followed them.

Mirrors llama.cpp common/ngram-map.cpp (`common_ngram_map_begin/_draft/_accept`, PR #18471, #19493) and the
`common_speculative_impl_ngram_map_k` wrapper shared by both types. The key is the last n tokens of
`prompt + [id_last]`; a match is an earlier occurrence whose key and m-token value both lie inside `prompt`.
Positions already indexed (<= key_map_last_idx) are found through a 2^18-bucket hash table; newer
positions by a scan. Each key keeps up to 4 candidate values with counts and the last accepted length.
A slot file holds a sequence's whole map (`NgramMap.state`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from spec_cli.errors import StateError
from spec_cli.model.state_arrays import State, counters, entry, ints, token_ids
from spec_cli.speculative.base import DraftParams, HistoryDrafter, SpecParams

LCG_FACTOR = 2654435761  # Knuth's multiplicative constant; the hash runs in uint32 arithmetic
HASH_MAP_SIZE = 262144  # COMMON_NGRAM_HASH_MAP_SIZE
MAX_VALUES = 4  # COMMON_NGRAM_MAX_VALUES
MAX_VALUE_COUNT = 16380  # cap of key_num / value_num


def lcg_hash(tokens: list[int]) -> int:
    h = 0
    for t in tokens:
        h = (h * LCG_FACTOR + t) & 0xFFFFFFFF
    return h


def window_hashes(tokens: np.ndarray, n: int) -> np.ndarray:
    """LCG hash of every n-token window of `tokens` (uint32 [len - n + 1]); equals lcg_hash per window."""
    w = len(tokens) - n + 1
    h = np.zeros(max(w, 0), dtype=np.uint32)
    for k in range(n):
        h = h * np.uint32(LCG_FACTOR) + tokens[k : k + w]  # uint32 wraparound, like the C++ code
    return h


@dataclass
class Value:
    n_accepted: int  # how many tokens to draft from this value next time (starts at m)
    idx: int = 0  # start of the m-gram in the history; 0 = free slot
    num: int = 0  # occurrences after the key


@dataclass
class Key:
    key_idx: int  # where the key was first matched
    values: list[Value]
    stat_idx: int = 0  # values were counted for occurrences up to here
    key_num: int = 0  # times the key was looked up with a match


@dataclass
class NgramMap:
    """One sequence's map (llama.cpp `common_ngram_map`)."""

    size_key: int
    size_value: int
    key_only: bool  # ngram-map-k: draft from values[0] only
    min_hits: int
    keys: dict[tuple[int, ...], Key] = field(default_factory=dict)
    key_map: np.ndarray = field(default_factory=lambda: np.zeros(HASH_MAP_SIZE, dtype=np.uint32))
    key_map_last_idx: int = 0  # positions <= this are in key_map
    begin_tokens: list[int] = field(default_factory=list)  # the prompt of the previous begin
    size_last_begin: int = 0  # its length
    idx_last_check: int = 0  # history length at the last draft
    last_value: Value | None = None  # the value the last draft came from

    def reset(self) -> None:
        self.keys.clear()
        self.begin_tokens = []
        self.key_map.fill(0)
        self.key_map_last_idx = self.size_last_begin = self.idx_last_check = 0
        self.last_value = None

    def begin(self, tokens: list[int]) -> None:
        size_begin = len(tokens)
        if tokens[: self.size_last_begin] != self.begin_tokens:
            # Not an extension of the previous begin's prompt (another request, a context shift): stored
            # positions no longer describe this history. llama.cpp keeps them (and asserts when the history
            # got shorter, #21815); we start over.
            self.reset()
        elif size_begin < self.idx_last_check:
            # Generated text after the previous begin was dropped (e.g. reasoning removed by the template).
            self._prune(self.size_last_begin)
        self.idx_last_check = max(self.size_last_begin - 1, 0)
        self.begin_tokens = list(tokens)
        self.size_last_begin = size_begin
        self.last_value = None

    def _prune(self, limit: int) -> None:
        """Forget keys, values and hash entries at positions >= limit."""
        self.key_map[self.key_map >= limit] = 0
        self.key_map_last_idx = max(limit - 1, 0)
        for key, k in list(self.keys.items()):
            if k.key_idx >= limit:
                del self.keys[key]
                continue
            if self.key_only:
                continue
            kept = [v for v in k.values if 0 < v.idx < limit]
            if not kept:
                del self.keys[key]
            else:
                k.values = kept + [Value(self.size_value) for _ in range(MAX_VALUES - len(kept))]

    def draft(self, prompt: list[int], id_last: int) -> list[int]:
        self.last_value = None
        n, m = self.size_key, self.size_value
        cur_len = len(prompt)  # id_last excluded, as in llama.cpp
        if cur_len < 2 * n + m:
            return []
        if self.idx_last_check > cur_len or self.size_last_begin > cur_len:
            self.reset()  # the history shrank without a begin: llama.cpp aborts here
        self.idx_last_check = cur_len

        key = prompt[cur_len - n + 1 :] + [id_last]
        match_pos = self._find_and_index(prompt, key, cur_len - n - m - 1)
        if match_pos == 0:
            return []

        k = self.keys.get(tuple(key))
        if k is None:
            k = Key(key_idx=match_pos, values=[Value(m) for _ in range(MAX_VALUES)])
            self.keys[tuple(key)] = k
        k.key_num = min(k.key_num + 1, MAX_VALUE_COUNT)

        if self.key_only:
            slot = 0  # ngram-map-k checks no min_hits and no dominance
        else:
            if k.key_num < self.min_hits:
                return []
            self._count_values(prompt, k, key, match_pos)
            nums = [v.num for v in k.values]
            slot = nums.index(max(nums))
            others = sum(nums) - nums[slot]
            if others > 0 and nums[slot] < 2 * others:
                return []  # the most frequent continuation does not dominate
        value = k.values[slot]
        self.last_value = value
        # As upstream, the tokens come from the continuation of the most recent match, while the length
        # (the n_accepted feedback) comes from the chosen value.
        n_draft = min(m, value.n_accepted)
        return prompt[match_pos + n : match_pos + n + n_draft]

    def _find_and_index(self, prompt: list[int], key: list[int], hi: int) -> int:
        """Most recent start (<= hi) of `key` in prompt, 0 if none; adds new positions to key_map."""
        n, m = self.size_key, self.size_value
        h = lcg_hash(key)
        match_pos = 0
        idx = int(self.key_map[h % HASH_MAP_SIZE])
        if idx != 0 and idx < hi and prompt[idx : idx + n] == key:
            match_pos = idx

        lo = self.key_map_last_idx
        if hi <= lo:
            return match_pos
        hashes = window_hashes(np.asarray(prompt[lo + 1 : hi + n], dtype=np.uint32), n)  # [hi - lo]
        # Positions whose key+value end before the previous begin ("old") are preferred, because the text
        # generated since then may be removed later. llama.cpp starts its "new" scan after size_last_begin,
        # so the n+m+1 positions just before it are never indexed; we scan and index them.
        old_hi = min(self.size_last_begin - n - m - 1, hi)
        order = np.concatenate(
            [np.arange(old_hi, lo, -1, dtype=np.int64), np.arange(hi, max(old_hi, lo), -1, dtype=np.int64)]
        )
        if match_pos == 0:
            for j in order[hashes[order - lo - 1] == h].tolist():
                if prompt[j : j + n] == key:
                    match_pos = j
                    break
        buckets = hashes[order - lo - 1] % HASH_MAP_SIZE
        ub, first = np.unique(buckets, return_index=True)  # the first writer of a bucket wins
        free = self.key_map[ub] == 0
        self.key_map[ub[free]] = order[first[free]]
        self.key_map_last_idx = hi
        return match_pos

    def _count_values(self, prompt: list[int], k: Key, key: list[int], match_pos: int) -> None:
        """Count the m-grams after every occurrence of the key in [stat_idx, match_pos] into the 4 slots."""
        n, m = self.size_key, self.size_value
        lo = k.stat_idx
        if lo <= match_pos:
            hashes = window_hashes(np.asarray(prompt[lo : match_pos + n], dtype=np.uint32), n)
            for i in (np.flatnonzero(hashes == lcg_hash(key)) + lo).tolist():
                if prompt[i : i + n] != key:
                    continue
                start = i + n
                for v in k.values:
                    if v.idx == 0:
                        v.idx, v.num, v.n_accepted = start, 0, m
                    elif prompt[start : start + m] != prompt[v.idx : v.idx + m]:
                        continue
                    v.num = min(v.num + 1, MAX_VALUE_COUNT)
                    break
        k.stat_idx = match_pos

    def state(self) -> State:
        """The map as arrays: per key its tokens, (key_idx, stat_idx, key_num) and values (n_accepted, idx, num)."""
        keys = list(self.keys.items())
        last = next(((row, j) for row, (_, k) in enumerate(keys) for j, v in enumerate(k.values)
                     if v is self.last_value), (-1, -1))
        slots = np.flatnonzero(self.key_map)
        return {"keys": np.asarray([key for key, _ in keys], dtype=np.int64).reshape(-1, self.size_key),
                "key_fields": np.asarray([[k.key_idx, k.stat_idx, k.key_num] for _, k in keys],
                                         dtype=np.int64).reshape(-1, 3),
                "values": np.asarray([[[v.n_accepted, v.idx, v.num] for v in k.values] for _, k in keys],
                                     dtype=np.int64).reshape(-1, MAX_VALUES, 3),
                "key_map_slots": slots, "key_map_pos": self.key_map[slots].astype(np.int64),
                "begin_tokens": ints(self.begin_tokens), "last_value": np.asarray(last),
                "counters": np.asarray([self.key_map_last_idx, self.size_last_begin, self.idx_last_check])}

    def restore(self, state: State, n_vocab: int) -> None:
        """The map `state` describes, checked before anything is replaced (StateError)."""
        keys, fields = entry(state, "keys", ndim=2), entry(state, "key_fields", ndim=2)
        values = entry(state, "values", ndim=3)
        slots, pos, last = entry(state, "key_map_slots"), entry(state, "key_map_pos"), entry(state, "last_value")
        n = len(keys)
        if keys.shape[1] != self.size_key or fields.shape != (n, 3) or values.shape != (n, MAX_VALUES, 3):
            raise StateError(f"the map's keys are not of {self.size_key} tokens with their values (saved with other "
                             "--spec-ngram-map-* sizes?)")
        if slots.shape != pos.shape or (slots.size and (slots.min() < 0 or slots.max() >= HASH_MAP_SIZE
                                                         or pos.min() < 0 or pos.max() >= 1 << 32)):
            raise StateError("the map's hash table does not fit its size")
        if last.shape != (2,) or not (last[0] == -1 or (0 <= last[0] < n and 0 <= last[1] < MAX_VALUES)):
            raise StateError("'last_value' does not name one of the map's values")
        begin = token_ids(state, "begin_tokens", n_vocab).tolist()
        last_idx, size_last_begin, idx_last_check = counters(state, "counters", 3)
        self.keys = {tuple(key): Key(f[0], [Value(*v) for v in vs], f[1], f[2])
                     for key, f, vs in zip(keys.tolist(), fields.tolist(), values.tolist())}
        self.key_map.fill(0)
        self.key_map[slots] = pos
        self.begin_tokens, self.key_map_last_idx = begin, last_idx
        self.size_last_begin, self.idx_last_check = size_last_begin, idx_last_check
        self.last_value = list(self.keys.values())[last[0]].values[last[1]] if last[0] >= 0 else None

    def accept(self, n_accepted: int) -> None:
        # The next draft from this value is at most n_accepted long; 0 silences it for good.
        if self.last_value is not None:
            self.last_value.n_accepted = n_accepted


class _NgramMapDrafter(HistoryDrafter):
    name: str
    key_only: bool

    def __init__(self, params: SpecParams, n_seq: int) -> None:
        size_n, size_m, min_hits = self.sizes(params)
        self.maps = [NgramMap(size_n, size_m, self.key_only, min_hits) for _ in range(n_seq)]

    @staticmethod
    def sizes(params: SpecParams) -> tuple[int, int, int]:
        raise NotImplementedError

    def begin(self, seq: int, prompt: list[int]) -> None:
        self.maps[seq].begin(prompt)

    def draft_one(self, p: DraftParams) -> list[int]:
        return self.maps[p.seq].draft(p.prompt, p.id_last)

    def accept(self, seq: int, n_accepted: int, is_other: bool) -> None:
        if not is_other:
            self.maps[seq].accept(n_accepted)

    def save_state(self, seq: int) -> State:
        return self.maps[seq].state()

    def restore_state(self, seq: int, state: State, n_vocab: int) -> None:
        self.maps[seq].restore(state, n_vocab)

    def forget(self, seq: int) -> None:
        self.maps[seq].reset()

    def slot_info(self, seq: int) -> dict:
        return {"n_keys": len(self.maps[seq].keys)}


class NgramMapKDrafter(_NgramMapDrafter):
    name = "ngram-map-k"
    key_only = True

    @staticmethod
    def sizes(params: SpecParams) -> tuple[int, int, int]:
        return params.ngram_map_k_size_n, params.ngram_map_k_size_m, params.ngram_map_k_min_hits


class NgramMapK4vDrafter(_NgramMapDrafter):
    name = "ngram-map-k4v"
    key_only = False

    @staticmethod
    def sizes(params: SpecParams) -> tuple[int, int, int]:
        return params.ngram_map_k4v_size_n, params.ngram_map_k4v_size_m, params.ngram_map_k4v_min_hits
