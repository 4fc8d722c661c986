"""ngram-simple: the continuation of the most recent earlier occurrence of the last n tokens (llama.cpp rules)."""

import random

import pytest

from spec_cli.speculative.base import DraftParams, SpecParams
from spec_cli.speculative.ngram_simple import NgramSimpleDrafter, ngram_simple_draft


def run_draft(prompt, id_last, n=2, m=3, n_max=64):
    drafter = NgramSimpleDrafter(SpecParams(ngram_simple_size_n=n, ngram_simple_size_m=m), n_seq=1)
    p = DraftParams(seq=0, n_max=n_max, pos0=len(prompt), id_last=id_last, prompt=prompt)
    drafter.begin(0, prompt)
    drafter.draft([p])
    return p.result


# (prompt, id_last, n, m, expected draft, what it shows)
CASES = [
    ([0, 1, 2, 3, 4, 5, 6, 7, 8, 1], 2, 2, 3, [3, 4, 5], "match copies m tokens"),
    ([0, 1, 2, 3, 4, 5, 6, 7, 8, 1], 2, 2, 5, [3, 4, 5, 6, 7], "size_m caps the copy"),
    (list(range(10)), 42, 2, 3, [], "no match"),
    ([0, 1, 2, 3, 4, 5, 1, 2, 7, 8, 9, 1], 2, 2, 3, [7, 8, 9], "most recent occurrence wins"),
    ([1, 2, 3, 4, 5, 6, 7, 8, 9, 1], 2, 2, 3, [], "position 0 is never a match"),
    ([0, 1, 2, 3, 4, 1], 2, 2, 3, [], "history of n+m+1 tokens is too short"),
    ([0, 1, 2, 3, 4, 5, 1], 2, 2, 3, [3, 4, 5], "one more token is enough"),
    ([9, 9, 9, 9, 9, 9, 4, 5, 6, 4, 5], 6, 3, 3, [], "a match too close to the end gives fewer than n tokens"),
    ([7] * 10, 7, 2, 3, [], "the search stops at the most recent match, even a too short one"),
    ([0, 5, 6, 7, 8, 9, 10, 11, 5, 6], 7, 3, 4, [8, 9, 10, 11], "the pattern ends with id_last"),
]


@pytest.mark.parametrize("prompt,id_last,n,m,expected,why", CASES, ids=[c[-1] for c in CASES])
def test_table(prompt, id_last, n, m, expected, why):
    assert run_draft(prompt, id_last, n, m) == expected


def test_n_max_caps_the_draft():
    assert run_draft([0, 1, 2, 3, 4, 5, 6, 7, 8, 1], 2, n=2, m=5, n_max=2) == [3, 4]


def test_only_drafting_sequences_are_filled():
    drafter = NgramSimpleDrafter(SpecParams(ngram_simple_size_n=2, ngram_simple_size_m=3), n_seq=2)
    prompt = [0, 1, 2, 3, 4, 5, 6, 7, 8, 1]
    done = DraftParams(seq=0, n_max=8, pos0=10, id_last=2, prompt=prompt, drafting=False, result=[99])
    asked = DraftParams(seq=1, n_max=8, pos0=10, id_last=2, prompt=prompt)
    drafter.draft([done, asked])
    assert done.result == [99] and asked.result == [3, 4, 5]
    assert asked.probs is None  # n-gram drafts are one-hot for verification


def reference(prompt, id_last, n, m):
    """Literal transcription of the llama.cpp loop, position by position."""
    cur_len = len(prompt)
    if cur_len <= n + m + 1:
        return []
    pattern = prompt[cur_len - n + 1 :] + [id_last]
    for j in range(cur_len - n - 1, 0, -1):
        if all(prompt[j + k] == pattern[k] for k in range(n)):
            copy_max = min(m, cur_len - (j + n))
            return prompt[j + n : j + n + copy_max] if copy_max >= n else []
    return []


def test_vectorized_search_equals_the_literal_loop():
    rng = random.Random(0)
    hits = 0
    for _ in range(400):
        n, m = rng.randint(1, 4), rng.randint(1, 6)
        prompt = [rng.randrange(3) for _ in range(rng.randint(0, 40))]
        id_last = rng.randrange(3)
        expected = reference(prompt, id_last, n, m)
        hits += bool(expected)
        assert ngram_simple_draft(prompt, id_last, n, m) == expected
    assert hits > 50  # the random cases exercised real matches
