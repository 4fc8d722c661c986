"""ngram-cache: counting, the lax/strict/static drafting rules, llama.cpp's file format, the drafter and the tools."""

import random
import struct

import pytest

from spec_cli.errors import SpecCliError
from spec_cli.runtime.lookup_offline import build_static_cache, lookup_stats
from spec_cli.speculative.base import DraftParams, SpecParams
from spec_cli.speculative.ngram_cache import NgramCacheDrafter, make_ngram, ngram_cache_draft, ngram_cache_update
from spec_cli.speculative.ngram_cache_file import load_cache, merge_caches, save_cache


def g(*tokens):
    return make_ngram(list(tokens))


def test_update_counts_the_token_after_every_ngram():
    cache = {}
    ngram_cache_update(cache, 1, 2, [1, 2, 1, 2, 1, 3], 6)
    assert cache == {g(1): {2: 2, 3: 1}, g(2): {1: 2}, g(1, 2): {1: 2}, g(2, 1): {2: 1, 3: 1}}
    last_only = {}
    ngram_cache_update(last_only, 1, 2, [1, 2, 1, 2, 1, 3], 1)
    assert last_only == {g(1): {3: 1}, g(2, 1): {3: 1}}


def test_token_by_token_updates_equal_one_update():
    rng = random.Random(0)
    tokens = [rng.randrange(5) for _ in range(200)]
    whole, step = {}, {}
    ngram_cache_update(whole, 1, 4, tokens, len(tokens))
    for i in range(1, len(tokens) + 1):
        ngram_cache_update(step, 1, 4, tokens[:i], 1)
    assert whole == step


# (context, dynamic, static, expected first drafted token or None, why); the history is 1 2 3 4
RULES = [
    ({g(1, 2, 3, 4): {9: 1}}, {}, {}, 9, "context 4-gram: 1 sample is enough"),
    ({g(4): {9: 1}}, {}, {}, None, "context unigram: needs 2 samples"),
    ({g(4): {9: 2, 8: 1}}, {}, {}, 9, "context unigram: 67 % >= 66 %"),
    ({g(4): {9: 2, 8: 2}}, {}, {}, None, "context unigram: a tie picks the first, 50 % < 66 %"),
    ({g(3, 4): {9: 1, 8: 1}}, {}, {}, 9, "context bigram: 50 % is enough"),
    ({g(3, 4): {9: 1, 8: 1, 7: 1}, g(4): {6: 2}}, {}, {}, 6, "a failing longer n-gram falls back to a shorter one"),
    ({g(2, 3, 4): {7: 1}, g(4): {6: 5}}, {}, {}, 7, "the longest qualifying n-gram wins"),
    ({}, {g(4): {9: 3}}, {}, None, "dynamic unigram: needs 4 samples"),
    ({}, {g(4): {9: 3, 8: 1}}, {}, 9, "dynamic unigram: 75 %"),
    ({}, {g(4): {9: 5, 8: 2}}, {}, None, "dynamic unigram: 71 % < 75 %"),
    ({g(4): {9: 5, 8: 2}}, {}, {}, 9, "the same counts pass the lax context rule"),
    ({}, {g(1, 2, 3, 4): {9: 1}}, {}, None, "dynamic 4-gram: needs 2 samples"),
    ({g(4): {8: 2}}, {g(1, 2, 3, 4): {9: 9}}, {}, 8, "the context cache goes before the dynamic one"),
    ({}, {}, {g(3, 4): {8: 2}}, 8, "static bigram alone: 2 samples"),
    ({}, {}, {g(3, 4): {8: 1}}, None, "static bigram alone: 1 sample is not enough"),
    ({}, {}, {g(3, 4): {8: 1, 7: 1, 6: 1}}, None, "static bigram alone: 33 % < 50 %"),
    ({g(1, 2, 3, 4): {9: 2, 8: 2}}, {}, {g(3, 4): {8: 1}}, 8, "static weight x100 breaks the tie"),
    ({g(1, 2, 3, 4): {9: 3, 8: 1}}, {}, {}, 9, "75 % without static weighting"),
    ({g(1, 2, 3, 4): {9: 3, 8: 1}}, {}, {g(3, 4): {8: 1}}, None, "the weighted pick must pass with its own count"),
]


@pytest.mark.parametrize("context,dynamic,static,expected,why", RULES, ids=[r[-1] for r in RULES])
def test_drafting_rules(context, dynamic, static, expected, why):
    draft = ngram_cache_draft([1, 2, 3, 4], 1, 1, 4, context, dynamic, static)
    assert draft == ([] if expected is None else [expected])


def test_drafted_tokens_extend_the_history_up_to_n_draft():
    context = {g(1, 2, 3, 4): {5: 1}, g(2, 3, 4, 5): {6: 1}, g(3, 4, 5, 6): {7: 1}}
    assert ngram_cache_draft([1, 2, 3, 4], 8, 1, 4, context, {}, {}) == [5, 6, 7]
    assert ngram_cache_draft([1, 2, 3, 4], 2, 1, 4, context, {}, {}) == [5, 6]
    assert ngram_cache_draft([4], 8, 1, 4, {g(4): {9: 5}}, {}, {}) == []  # one token of history


# --- files

RECORDS = (
    struct.pack("<4i", 5, 6, -1, -1) + struct.pack("<i", 2) + struct.pack("<4i", 7, 3, 8, 1)
    + struct.pack("<4i", 1, 2, 3, 4) + struct.pack("<i", 1) + struct.pack("<2i", 9, 2)
)
CACHE = {(5, 6, -1, -1): {7: 3, 8: 1}, (1, 2, 3, 4): {9: 2}}


def test_load_reads_llama_cpp_records(tmp_path):
    (tmp_path / "c.bin").write_bytes(RECORDS)
    assert load_cache(str(tmp_path / "c.bin")) == CACHE
    (tmp_path / "empty.bin").write_bytes(b"")
    assert load_cache(str(tmp_path / "empty.bin")) == {}


def test_save_writes_llama_cpp_records(tmp_path):
    save_cache(CACHE, str(tmp_path / "c.bin"))
    assert (tmp_path / "c.bin").read_bytes() == RECORDS


def test_round_trip(tmp_path):
    rng = random.Random(1)
    cache = {}
    ngram_cache_update(cache, 1, 4, [rng.randrange(300_000) for _ in range(500)], 500)
    save_cache(cache, str(tmp_path / "c.bin"))
    assert load_cache(str(tmp_path / "c.bin")) == cache


def test_merge_adds_counts():
    a = {g(1): {2: 1}}
    merge_caches(a, {g(1): {2: 2, 3: 1}, g(4, 5): {6: 1}})
    assert a == {g(1): {2: 3, 3: 1}, g(4, 5): {6: 1}}


@pytest.mark.parametrize(
    "data",
    [
        RECORDS[:-4], RECORDS[:-1], RECORDS[:10],
        struct.pack("<5i", 1, -1, -1, -1, 0), struct.pack("<7i", 1, -1, -1, -1, 1, 2, 0),
    ],
    ids=["truncated pair", "not whole int32", "truncated ngram", "zero tokens", "zero count"],
)
def test_corrupt_file_is_an_error_naming_it(tmp_path, data):
    path = tmp_path / "corrupt.bin"
    path.write_bytes(data)
    with pytest.raises(SpecCliError, match="corrupt.bin"):
        load_cache(str(path))


# --- the drafter


def run(drafter, prompt, id_last, seq=0, n_max=64):
    p = DraftParams(seq=seq, n_max=n_max, pos0=len(prompt), id_last=id_last, prompt=prompt)
    drafter.draft([p])
    return p.result


def test_cache_files_at_construction(tmp_path):
    with pytest.raises(SpecCliError, match="missing-static.bin"):
        NgramCacheDrafter(SpecParams(lookup_cache_static=str(tmp_path / "missing-static.bin")), 1)
    NgramCacheDrafter(SpecParams(lookup_cache_dynamic=str(tmp_path / "missing-dynamic.bin")), 1)  # starts empty
    (tmp_path / "bad.bin").write_bytes(RECORDS[:-4])
    with pytest.raises(SpecCliError, match="bad.bin"):
        NgramCacheDrafter(SpecParams(lookup_cache_dynamic=str(tmp_path / "bad.bin")), 1)
    save_cache({g(3, 4): {8: 2}}, str(tmp_path / "static.bin"))
    drafter = NgramCacheDrafter(SpecParams(lookup_cache_static=str(tmp_path / "static.bin")), 1)
    drafter.begin(0, [1, 2, 3])
    assert run(drafter, [1, 2, 3], 4) == [8]


def test_context_follows_the_generated_history_and_is_reset_per_request():
    drafter = NgramCacheDrafter(SpecParams(), 2)
    drafter.begin(0, [1, 2, 3, 4, 5])
    assert run(drafter, [1, 2, 3, 4, 5, 6, 7, 1, 2, 3], 4) == [5, 6, 7, 1, 2, 3, 4, 5]  # n_draft is 8
    assert run(drafter, [1, 2, 3, 4, 5, 6, 7, 1, 2, 3], 4, n_max=3) == [5, 6, 7]
    drafter.begin(1, [1, 2, 3, 4, 5])
    drafter.begin(0, [7, 8, 9])  # a new request does not see the previous one (unlike llama.cpp, #27852)
    assert run(drafter, [7, 8, 9, 1, 2, 3], 4) == []
    assert run(drafter, [1, 2, 3, 4, 5, 1, 2, 3], 4, seq=1, n_max=1) == [5]  # each sequence keeps its own


def test_save_dynamic_merges_the_context_and_a_later_run_drafts_from_it(tmp_path):
    path = str(tmp_path / "dynamic.bin")
    first = NgramCacheDrafter(SpecParams(lookup_cache_dynamic=path), 1)
    first.begin(0, [1, 2, 3, 4, 5] * 2)
    first.save_dynamic()
    assert load_cache(path) == first.contexts[0]
    later = NgramCacheDrafter(SpecParams(lookup_cache_dynamic=path), 1)
    later.begin(0, [1, 2, 3])
    assert run(later, [1, 2, 3], 4) == [5]  # the 4-gram was seen twice: passes the strict rule
    without = NgramCacheDrafter(SpecParams(), 1)
    without.begin(0, [1, 2, 3])
    assert run(without, [1, 2, 3], 4) == []


# --- tools


def test_static_cache_counts_bigrams_only():
    assert build_static_cache([1, 2, 1, 2, 3]) == {g(1, 2): {1: 1, 3: 1}, g(2, 1): {2: 1}}


def test_lookup_stats_replays_chunks_and_feeds_the_dynamic_cache():
    tokens = list(range(1, 9)) * 20  # 160 tokens: two chunks of 64 are followed by more input
    dynamic = {}
    stats = lookup_stats(tokens, 64, 4, {}, dynamic)
    assert stats["n_draft"] == 4 and stats["n_predict"] == 128
    assert 50 < stats["n_drafted"] and 0.9 * stats["n_drafted"] <= stats["n_accept"] <= stats["n_drafted"]
    assert stats["accept"] == pytest.approx(100 * stats["n_accept"] / stats["n_drafted"])
    assert sum(sum(part.values()) for ngram, part in dynamic.items() if ngram[1] == -1) == 2 * 63
    never_repeats = lookup_stats(list(range(200)), 50, 4, {}, {})
    assert never_repeats["n_drafted"] == 0 and never_repeats["accept"] == 0.0
