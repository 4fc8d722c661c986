"""`ngram-mod`: a lossy hash pool n-gram -> next token, shared by all sequences and kept across requests.

Mirrors llama.cpp common/ngram-mod.cpp (`common_ngram_mod`) and `common_speculative_impl_ngram_mod` (PR #19164).
The pool has 4M int32 slots; an n-gram's slot is its polynomial hash (multiplier 6364136223846793005,
uint64 wraparound) modulo the size, with no collision check. Drafting walks the pool from the last n
tokens until an empty slot. The pool is cleared when more than 25 % full at a begin, or after 5
consecutive drafts of one sequence with less than 25 % accepted.

A slot file holds the sequence's counters and the pool's occupied slots (the pool is shared: restoring writes them
over the pool, which leaves a fresh process's pool as it was at the save and adds them to a live one's).
"""

from __future__ import annotations

import numpy as np

from spec_cli.errors import StateError
from spec_cli.model.state_arrays import State, counters, entry, scalar, token_ids
from spec_cli.speculative.base import DraftParams, HistoryDrafter, SpecParams

POOL_SIZE = 4 * 1024 * 1024
EMPTY = -1
MULTIPLIER = 6364136223846793005
MASK64 = (1 << 64) - 1
FILL_RESET = 0.25  # clear the pool at begin when used / size exceeds this
LOW_ACCEPT = 0.25  # an accepted fraction below this counts as a low-acceptance draft
LOW_STREAK_RESET = 5  # consecutive low-acceptance drafts that clear the pool
INDEX_CHUNK = 32  # new history is added to the pool once more than this many tokens wait


class NgramPool:
    """llama.cpp `common_ngram_mod`: slot(ngram) = hash(ngram) % size holds the token that followed it."""

    def __init__(self, n: int, size: int = POOL_SIZE) -> None:
        self.n = n
        self.size = size
        self.entries = np.full(size, EMPTY, dtype=np.int32)  # [size]
        self.used = 0  # occupied slots
        self._lead_power = pow(MULTIPLIER, n - 1, 1 << 64)  # weight of the oldest token in the hash

    def reset(self) -> None:
        self.entries.fill(EMPTY)
        self.used = 0

    def hash(self, ngram: list[int]) -> int:
        h = 0
        for t in ngram:
            h = (h * MULTIPLIER + t) & MASK64
        return h

    def add_range(self, tokens: list[int], start: int, stop: int) -> None:
        """Add the n-grams starting at start..stop-1, each mapped to the token after it (in order)."""
        n, w = self.n, stop - start
        if w <= 0:
            return
        window = np.asarray(tokens[start : stop + n], dtype=np.int64).astype(np.uint64)  # [w + n]
        h = np.zeros(w, dtype=np.uint64)
        for k in range(n):
            h = h * np.uint64(MULTIPLIER) + window[k : k + w]  # uint64 wraparound, like the C++ size_t
        slots = (h % np.uint64(self.size)).astype(np.int64)  # [w]
        following = window[n:].astype(np.int32)  # [w]
        # Sequential adds: the last n-gram written to a slot wins.
        uniq, first_rev = np.unique(slots[::-1], return_index=True)
        self.used += int(np.count_nonzero(self.entries[uniq] == EMPTY))
        self.entries[uniq] = following[w - 1 - first_rev]

    def occupied(self) -> tuple[np.ndarray, np.ndarray]:
        """(slot indices, their tokens) of the occupied slots."""
        slots = np.flatnonzero(self.entries != EMPTY)
        return slots, self.entries[slots]

    def write(self, slots: np.ndarray, tokens: np.ndarray) -> None:
        """entries[slots] = tokens (checked: StateError)."""
        if slots.shape != tokens.shape or (slots.size and (slots.min() < 0 or slots.max() >= self.size)):
            raise StateError(f"the pool's slots are not {len(tokens)} indices in [0, {self.size})")
        self.entries[slots] = tokens
        self.used = int(np.count_nonzero(self.entries != EMPTY))

    def walk(self, window: list[int], n_max: int) -> list[int]:
        """Follow the pool from `window` (n tokens) for up to n_max tokens, stopping at an empty slot."""
        out: list[int] = []
        window = list(window)
        h = self.hash(window)
        for _ in range(n_max):
            t = int(self.entries[h % self.size])
            if t == EMPTY:
                break
            out.append(t)
            # Slide the window by one token without rehashing all n.
            h = ((h - window.pop(0) * self._lead_power) * MULTIPLIER + t) & MASK64
            window.append(t)
        return out


class NgramModDrafter(HistoryDrafter):
    name = "ngram-mod"

    def __init__(self, params: SpecParams, n_seq: int) -> None:
        self.n_min = params.ngram_mod_n_min
        self.n_max = params.ngram_mod_n_max
        self.pool = NgramPool(params.ngram_mod_n_match)  # one instance serves every sequence
        self.i_last = [0] * n_seq  # history up to here is in the pool
        self.n_draft_last = [0] * n_seq  # length of this sequence's last draft
        self.n_low = [0] * n_seq  # consecutive low-acceptance drafts

    def begin(self, seq: int, prompt: list[int]) -> None:
        # As upstream, the low-acceptance streak survives begin, and the fill check runs after the
        # prompt was added (so a reset here also drops this prompt).
        self.i_last[seq] = 0
        self.n_draft_last[seq] = 0
        n = self.pool.n
        if len(prompt) < n:
            return
        self.pool.add_range(prompt, 0, len(prompt) - n)
        self.i_last[seq] = len(prompt) - n
        if self.pool.used / self.pool.size > FILL_RESET:
            self.pool.reset()

    def draft_one(self, p: DraftParams) -> list[int]:
        seq, n = p.seq, self.pool.n
        self.n_draft_last[seq] = 0
        cur_len = len(p.prompt)
        if cur_len < n:
            return []
        if self.i_last[seq] + INDEX_CHUNK < cur_len:
            self.pool.add_range(p.prompt, self.i_last[seq], cur_len - n)
            self.i_last[seq] = cur_len - n

        result = self.pool.walk(p.prompt[cur_len - n + 1 :] + [p.id_last], self.n_max)
        if len(result) < min(self.n_min, self.n_max):
            return []  # stopped at an empty slot before n_min
        # Truncate to the per-call cap here (the chain would anyway) so the acceptance fraction is
        # measured against the tokens that were actually verified.
        result = result[: max(p.n_max, 0)]
        self.n_draft_last[seq] = len(result)
        return result

    def shorten(self, seq: int, n: int) -> None:
        # The chain verifies only n tokens of the last draft (--draft-max auto): judge the streak against those.
        self.n_draft_last[seq] = min(self.n_draft_last[seq], n)

    def accept(self, seq: int, n_accepted: int, is_other: bool) -> None:
        if is_other:
            # Another drafter's tokens: the history is added lazily from the prompt at the next draft,
            # and this sequence's streak only judges ngram-mod's own drafts.
            return
        if self.n_draft_last[seq] == 0:
            return
        if n_accepted / self.n_draft_last[seq] < LOW_ACCEPT:
            self.n_low[seq] += 1
            if self.n_low[seq] >= LOW_STREAK_RESET:
                self.pool.reset()  # affects every sequence
                self.n_low[seq] = 0
                self.i_last[seq] = 0  # re-add this sequence's whole history at its next draft
        else:
            self.n_low[seq] = 0

    def save_state(self, seq: int) -> State:
        slots, tokens = self.pool.occupied()
        return {"n_match": np.asarray(self.pool.n), "pool_slots": slots, "pool_tokens": tokens,
                "counters": np.asarray([self.i_last[seq], self.n_draft_last[seq], self.n_low[seq]])}

    def restore_state(self, seq: int, state: State, n_vocab: int) -> None:
        if scalar(state, "n_match") != self.pool.n:
            raise StateError(f"saved with --spec-ngram-mod-n-match {int(state['n_match'])}, this server uses "
                             f"{self.pool.n}")
        i_last, n_draft_last, n_low = counters(state, "counters", 3)
        self.pool.write(entry(state, "pool_slots"), token_ids(state, "pool_tokens", n_vocab).astype(np.int32))
        self.i_last[seq], self.n_draft_last[seq], self.n_low[seq] = i_last, n_draft_last, n_low

    def forget(self, seq: int) -> None:
        self.i_last[seq] = self.n_draft_last[seq] = self.n_low[seq] = 0  # the shared pool stays

    def slot_info(self, seq: int) -> dict:
        return {"pool_used": self.pool.used}
