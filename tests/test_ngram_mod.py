"""ngram-mod: pool walk, n_min, one pool for all sequences, fill reset, low-acceptance reset (llama.cpp rules)."""

import random

import numpy as np
import pytest

from spec_cli.speculative.base import DraftParams, SpecParams
from spec_cli.speculative.ngram_mod import EMPTY, MULTIPLIER, NgramModDrafter, NgramPool

A = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2]  # with id_last 3 the window 1 2 3 walks 4 5 6 7 8 1 2, then an empty slot
LONG = list(range(45)) + [0, 1]  # with id_last 2 the walk runs 3 4 5 ... (and it is long enough to re-index)


def make(n=3, n_min=2, n_max=5, n_seq=1, pool_size=None):
    drafter = NgramModDrafter(SpecParams(ngram_mod_n_match=n, ngram_mod_n_min=n_min, ngram_mod_n_max=n_max), n_seq)
    if pool_size is not None:
        drafter.pool = NgramPool(n, size=pool_size)
    return drafter


def draft(drafter, prompt, id_last, seq=0, n_max=64):
    p = DraftParams(seq=seq, n_max=n_max, pos0=len(prompt), id_last=id_last, prompt=prompt)
    drafter.draft([p])
    return p.result


# (prompt, id_last, n_min, n_max, expected, why)
CASES = [
    (A, 3, 2, 5, [4, 5, 6, 7, 8], "walk stops at n_max"),
    (A, 3, 2, 10, [4, 5, 6, 7, 8, 1, 2], "walk stops at an empty slot"),
    (A, 3, 8, 10, [], "stopped before n_min: no draft"),
    (A, 3, 8, 7, [4, 5, 6, 7, 8, 1, 2], "a walk that reaches n_max is kept even below n_min"),
    (A, 9, 1, 10, [], "unknown n-gram"),
    ([1], 2, 1, 10, [], "history shorter than n"),
]


@pytest.mark.parametrize("prompt,id_last,n_min,n_max,expected,why", CASES, ids=[c[-1] for c in CASES])
def test_table(prompt, id_last, n_min, n_max, expected, why):
    drafter = make(n_min=n_min, n_max=n_max)
    drafter.begin(0, prompt)
    assert draft(drafter, prompt, id_last) == expected


def test_new_history_is_added_in_chunks_of_more_than_32():
    drafter = make(n_max=3)
    drafter.begin(0, [])
    assert draft(drafter, A * 3, 3) == []  # 30 tokens: not indexed yet
    assert draft(drafter, A * 4, 3) == [4, 5, 6]  # 40 > 0 + 32: indexed


def test_one_pool_serves_every_sequence_and_outlives_requests():
    drafter = make(n_seq=2)
    drafter.begin(0, A)
    drafter.begin(1, [50, 51, 1, 2])
    assert draft(drafter, [50, 51, 1, 2], 3, seq=1) == [4, 5, 6, 7, 8]
    drafter.begin(0, [60, 61, 62])  # a new request on seq 0 keeps the pool
    assert draft(drafter, [60, 61, 62, 1, 2], 3, seq=0) == [4, 5, 6, 7, 8]


def test_fill_above_a_quarter_clears_the_pool_at_begin():
    small = make(pool_size=64)
    small.begin(0, A)  # 7 n-grams <= 16 slots
    assert 0 < small.pool.used <= 16 and draft(small, A, 3) == [4, 5, 6, 7, 8]
    big = list(range(100, 142)) + A  # about 49 n-grams in 64 slots
    small.begin(0, big)
    assert small.pool.used == 0 and draft(small, big, 3) == []


def low_round(drafter, n_accepted=0, is_other=False, n_max=64):
    assert draft(drafter, LONG, 2, n_max=n_max)
    drafter.accept(0, n_accepted, is_other=is_other)


def test_five_low_acceptance_drafts_in_a_row_clear_the_pool():
    drafter = make()
    drafter.begin(0, LONG)
    for _ in range(4):
        low_round(drafter)  # 0 of 5 accepted
    assert drafter.pool.used > 0
    low_round(drafter)
    assert drafter.pool.used == 0
    assert draft(drafter, LONG, 2) == [3, 4, 5, 6, 7]  # the sequence's history is indexed again


def test_a_good_draft_breaks_the_streak():
    drafter = make()
    drafter.begin(0, LONG)
    for _ in range(4):
        low_round(drafter)
    low_round(drafter, n_accepted=2)  # 2 of 5 >= 25 %
    for _ in range(4):
        low_round(drafter, n_accepted=1)  # 1 of 5 < 25 %
    assert drafter.pool.used > 0


def test_other_drafters_rounds_never_count():
    drafter = make()
    drafter.begin(0, LONG)
    for _ in range(10):
        low_round(drafter, is_other=True)
    assert drafter.pool.used > 0


def test_acceptance_is_judged_on_the_verified_tokens():
    drafter = make()
    drafter.begin(0, LONG)
    for _ in range(10):
        low_round(drafter, n_accepted=1, n_max=1)  # the per-call cap cut the 5-token walk to 1
    assert drafter.pool.used > 0


def add_one_by_one(pool, tokens, start, stop):
    for i in range(start, stop):
        slot = pool.hash(tokens[i : i + pool.n]) % pool.size
        pool.used += int(pool.entries[slot] == EMPTY)
        pool.entries[slot] = tokens[i + pool.n]


def walk_rehashing(pool, window, n_max):
    out, window = [], list(window)
    for _ in range(n_max):
        t = int(pool.entries[pool.hash(window) % pool.size])
        if t == EMPTY:
            break
        out.append(t)
        window = window[1:] + [t]
    return out


def test_vectorized_add_and_sliding_walk_equal_the_one_by_one_versions():
    rng = random.Random(0)
    for n in (1, 3, 24):
        fast, slow = NgramPool(n, size=257), NgramPool(n, size=257)  # small: many collisions
        tokens = [rng.choice([rng.randrange(4), rng.randrange(200_000)]) for _ in range(300)]
        fast.add_range(tokens, 0, 150)
        add_one_by_one(slow, tokens, 0, 150)
        fast.add_range(tokens, 150, 300 - n)
        add_one_by_one(slow, tokens, 150, 300 - n)
        assert np.array_equal(fast.entries, slow.entries) and fast.used == slow.used
        for i in range(0, 300 - n, 7):
            assert fast.walk(tokens[i : i + n], 64) == walk_rehashing(fast, tokens[i : i + n], 64)


def test_hash_is_the_uint64_polynomial():
    pool = NgramPool(2, size=8)
    assert pool.hash([5]) == 5
    assert pool.hash([1, 7]) == MULTIPLIER + 7
    assert pool.hash([199_999, 1, 2]) == (((199_999 * MULTIPLIER + 1) * MULTIPLIER) + 2) % 2**64
