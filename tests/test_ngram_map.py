"""ngram-map-k / ngram-map-k4v: key lookup, value dominance, n_accepted feedback, begin pruning (llama.cpp rules)."""

import random

import numpy as np
import pytest

from spec_cli.speculative.base import DraftParams, SpecParams
from spec_cli.speculative.ngram_map import NgramMapK4vDrafter, NgramMapKDrafter, lcg_hash, window_hashes

A, B = [3, 4], [5, 6]


def make(kind="k", n=2, m=2, min_hits=1, n_seq=1):
    params = SpecParams(
        ngram_map_k_size_n=n, ngram_map_k_size_m=m, ngram_map_k_min_hits=min_hits,
        ngram_map_k4v_size_n=n, ngram_map_k4v_size_m=m, ngram_map_k4v_min_hits=min_hits,
    )
    return (NgramMapKDrafter if kind == "k" else NgramMapK4vDrafter)(params, n_seq)


def draft(drafter, prompt, id_last, seq=0, n_max=64):
    p = DraftParams(seq=seq, n_max=n_max, pos0=len(prompt), id_last=id_last, prompt=prompt)
    drafter.draft([p])
    return p.result


def fresh_draft(prompt, id_last, **kw):
    drafter = make(**kw)
    drafter.begin(0, prompt)
    return draft(drafter, prompt, id_last)


# (kinds, prompt, id_last, n, m, expected, why); the key is the last n-1 prompt tokens + id_last
LOOKUP_CASES = [
    ("k k4v", [0, 1, 2, 3, 4, 5, 6, 7, 1], 2, 2, 2, [3, 4], "match drafts the m tokens after it"),
    ("k k4v", list(range(9)), 42, 2, 2, [], "no match"),
    ("k", [0, 1, 2, 3, 4, 1, 2, 5, 6, 9, 9, 1], 2, 2, 2, [5, 6], "most recent occurrence wins"),
    ("k k4v", [0, 1, 2, 3, 4, 5, 1, 2, 6, 1], 2, 2, 2, [3, 4], "a match needs key + m tokens + 1 before the end"),
    ("k k4v", [0, 1, 2, 3, 1, 2], 3, 3, 1, [], "history shorter than 2n+m"),
    ("k k4v", [5, 0, 1, 2, 3, 1, 2], 3, 3, 1, [1], "history of 2n+m tokens"),
]


@pytest.mark.parametrize(
    "kind,prompt,id_last,n,m,expected",
    [(kind, *c[1:-1]) for c in LOOKUP_CASES for kind in c[0].split()],
    ids=[f"{kind}: {c[-1]}" for c in LOOKUP_CASES for kind in c[0].split()],
)
def test_lookup_table(kind, prompt, id_last, n, m, expected):
    assert fresh_draft(prompt, id_last, kind=kind, n=n, m=m) == expected


def blocks(values):
    """[0] then `1 2 v 9` per value, ending with 1 (id_last 2 makes the key 1 2 again)."""
    out = [0]
    for v in values:
        out += [1, 2] + v + [9]
    return out + [1]


# k4v counts the values after every occurrence of the key; the winner must have >= 2x all the others.
# As upstream, the drafted tokens are the continuation of the most recent occurrence.
K4V_CASES = [
    ([A], A, "a single value"),
    ([A, B, A], A, "2 vs 1 dominates"),
    ([A, A, A, B], B, "3 vs 1 dominates; the tokens follow the last match"),
    ([A, B], [], "1 vs 1 does not dominate"),
    ([A, B, A, B, A], [], "3 vs 2 does not dominate"),
]


@pytest.mark.parametrize("values,expected,why", K4V_CASES, ids=[c[-1] for c in K4V_CASES])
def test_k4v_dominance(values, expected, why):
    assert fresh_draft(blocks(values), 2, kind="k4v") == expected
    assert fresh_draft(blocks(values), 2, kind="k") == values[-1]  # map-k has no dominance rule


def test_k4v_min_hits():
    drafter = make("k4v", min_hits=2)
    prompt = blocks([A, A])
    drafter.begin(0, prompt)
    assert draft(drafter, prompt, 2) == []  # first lookup of the key: 1 hit
    assert draft(drafter, prompt, 2) == A


@pytest.mark.parametrize("kind", ["k", "k4v"])
def test_n_accepted_caps_the_next_draft_and_zero_stops_the_key(kind):
    drafter = make(kind, m=3)
    p1 = [0, 1, 2, 3, 4, 5, 6, 7, 8, 1]
    drafter.begin(0, p1)
    assert draft(drafter, p1, 2) == [3, 4, 5]
    drafter.accept(0, 1, is_other=False)
    p2 = p1 + [2, 3, 9, 9, 9, 1]
    assert draft(drafter, p2, 2) == [3]
    drafter.accept(0, 0, is_other=False)
    p3 = p2 + [2, 3, 5, 5, 5, 1]
    assert draft(drafter, p3, 2) == []
    p4 = p3 + [2, 3, 4]
    assert draft(drafter, p4, 5) == [6, 7, 8]  # another key still drafts in full


def test_feedback_is_per_sequence_and_ignores_other_drafters():
    drafter = make("k", n_seq=2)
    prompt = [0, 1, 2, 3, 4, 5, 6, 7, 1]
    for seq in (0, 1):
        drafter.begin(seq, prompt)
        assert draft(drafter, prompt, 2, seq=seq) == [3, 4]
    drafter.accept(0, 0, is_other=True)  # another drafter's draft was verified: no feedback
    longer = prompt + [2, 3, 8, 8, 1]
    assert draft(drafter, longer, 2, seq=0) == [3, 4]
    drafter.accept(0, 0, is_other=False)
    assert draft(drafter, longer, 2, seq=0) == []
    assert draft(drafter, longer, 2, seq=1) == [3, 4]


def test_n_max_truncates():
    drafter = make("k", m=4)
    prompt = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 1]
    drafter.begin(0, prompt)
    assert draft(drafter, prompt, 2, n_max=2) == [3, 4]


@pytest.mark.parametrize("kind", ["k", "k4v"])
def test_begin_after_dropped_generated_text_reindexes_it(kind):
    drafter = make(kind)
    prompt = [0, 10, 11, 12, 13, 14, 15, 16, 17, 18]
    generated = list(range(20, 30))
    drafter.begin(0, prompt)
    for i in range(9):
        draft(drafter, prompt + generated[:i], generated[i])
    # The next request keeps the prompt but replaces the generated text with a shorter one.
    history = prompt + [1, 2, 3, 4, 5, 6]
    drafter.begin(0, history)
    assert draft(drafter, history + [7, 1], 2) == [3, 4]


@pytest.mark.parametrize("kind", ["k", "k4v"])
@pytest.mark.parametrize("second_begin", [40, 130])  # shorter / longer than the first history
def test_begin_with_an_unrelated_prompt_acts_like_a_fresh_map(kind, second_begin):
    rng = random.Random(1)
    first = [rng.randrange(4) for _ in range(120)]
    drafter = make(kind)
    drafter.begin(0, first[:100])
    for i in range(100, 120):
        draft(drafter, first[:i], first[i])
        drafter.accept(0, 1, is_other=False)
    second = [rng.randrange(4) for _ in range(second_begin + 40)]
    fresh = make(kind)
    for d in (drafter, fresh):
        d.begin(0, second[:second_begin])
    drafts = [
        (draft(drafter, second[:i], second[i]), draft(fresh, second[:i], second[i]))
        for i in range(second_begin, len(second))
    ]
    assert all(a == b for a, b in drafts)
    assert any(a for a, _ in drafts)


@pytest.mark.parametrize("kind", ["k", "k4v"])
def test_random_histories_only_draft_real_continuations(kind):
    """Whatever begin/draft/accept sequence, a draft is what followed an earlier occurrence of the key."""
    rng = random.Random(2)
    n, m = 2, 3
    drafter = make(kind, n=n, m=m)
    history, begin_prompt, n_drafts = [], [], 0
    for _ in range(300):
        r = rng.random()
        if r < 0.1:  # new request: extend the last begin prompt, cut the history, or start over
            history = rng.choice([begin_prompt + [rng.randrange(3)], history[: rng.randint(0, len(history))], []])
            history = history + [rng.randrange(3) for _ in range(rng.randint(0, 10))]
            begin_prompt = list(history)
            drafter.begin(0, history)
            continue
        id_last = rng.randrange(3)
        d = draft(drafter, history, id_last)
        assert len(d) <= m
        if d:
            n_drafts += 1
            key = history[len(history) - n + 1 :] + [id_last]
            assert any(
                history[j : j + n] == key and history[j + n : j + n + len(d)] == d
                for j in range(1, len(history) - n - m)
            )
        drafter.accept(0, rng.randint(0, len(d)), is_other=not d)
        history = history + [id_last] + d[: rng.randint(0, len(d))]
    assert n_drafts > 20


def test_lcg_hash_wraps_in_uint32_and_matches_the_vectorized_hash():
    assert lcg_hash([7]) == 7
    assert lcg_hash([1, 0]) == 2654435761
    assert lcg_hash([1, 0, 0]) == (2654435761 * 2654435761) % 2**32
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 200_000, size=50)
    vec = window_hashes(tokens.astype(np.uint32), 12)
    assert vec.tolist() == [lcg_hash(tokens[j : j + 12].tolist()) for j in range(len(tokens) - 11)]
