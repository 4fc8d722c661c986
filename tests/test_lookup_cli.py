"""The lookup family on the tiny model: llama.cpp's cache file format, merge sums, the offline simulation's
figures, lossless lookup decoding that saves a dynamic cache the next run drafts from, one-line errors."""

from __future__ import annotations

import json
import struct
import sys

import pytest

from spec_cli.model.sampling import SamplingParams
from spec_cli.runtime import lookup_offline
from spec_cli.runtime.engine import EngineOptions, build_engine
from spec_cli.runtime.generate import generate
from spec_cli.runtime.lookup import load_tokenizer, open_lookup_session, save_dynamic_cache, tokenize_corpus
from spec_cli.runtime.lookup_offline import build_static_cache
from spec_cli.speculative.base import SpecParams
from spec_cli.speculative.ngram_cache import (
    NGRAM_MAX,
    NGRAM_MIN,
    NGRAM_STATIC,
    SPEC_N_DRAFT,
    TOKEN_NULL,
    NgramCacheDrafter,
    ngram_cache_update,
)
from spec_cli.speculative.ngram_cache_file import load_cache, save_cache

PROMPT = "Hello world, the cat sat on the mat. Hello world, the cat sat"
CORPUS = "Hello world, the cat sat on the mat. def f(): return the world.\n" * 20


def cli(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    """Run `spec-cli ARGS` in-process through main() (one-line errors, exit codes); returns (code, stdout, stderr)."""
    from spec_cli.cli import main

    monkeypatch.setattr(sys, "argv", ["spec-cli", *args])
    try:
        main()
        code = 0
    except SystemExit as e:
        code = e.code or 0
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(CORPUS, encoding="utf-8")
    return path


def records(raw: bytes):
    """Walk llama.cpp's format by hand: ngram (4 x int32), ntokens (int32), ntokens x (token, count) int32."""
    pos = 0
    while pos < len(raw):
        ngram = struct.unpack_from("<4i", raw, pos)
        (n_tokens,) = struct.unpack_from("<i", raw, pos + 16)
        pairs = struct.unpack_from(f"<{2 * n_tokens}i", raw, pos + 20)
        yield ngram, dict(zip(pairs[::2], pairs[1::2]))
        pos += 20 + 8 * n_tokens
    assert pos == len(raw), "the last record must end exactly at the end of the file"


def test_lookup_create_writes_llamacpp_bigram_cache(monkeypatch, capsys, tmp_path, tiny_model_path, corpus):
    out = tmp_path / "static.bin"
    code, _, err = cli(monkeypatch, capsys, "lookup-create", "-m", str(tiny_model_path), "-f", str(corpus),
                       "-lcs", str(out))
    assert code == 0, err
    tokens = tokenize_corpus(load_tokenizer(str(tiny_model_path)), str(corpus))
    raw = out.read_bytes()
    first_ngram, first_part = next(records(raw))
    assert first_ngram[:NGRAM_STATIC] == tuple(tokens[:NGRAM_STATIC])  # the first bigram of the corpus comes first
    assert first_ngram[NGRAM_STATIC:] == (TOKEN_NULL,) * (4 - NGRAM_STATIC)
    assert first_part[tokens[NGRAM_STATIC]] >= 1
    by_hand = dict(records(raw))
    assert by_hand == load_cache(str(out)) == build_static_cache(tokens)
    # every position with two tokens before it is counted exactly once
    assert sum(sum(part.values()) for part in by_hand.values()) == len(tokens) - NGRAM_STATIC


def test_chunked_static_cache_equals_one_pass(monkeypatch):
    tokens = [(7 * i * i + 3 * i) % 11 for i in range(100)]
    one_pass = build_static_cache(tokens)
    monkeypatch.setattr(lookup_offline, "PROGRESS_CHUNK", 7)
    done: list[int] = []
    assert build_static_cache(tokens, done.append) == one_pass
    assert done == sorted(done) and done[-1] == len(tokens)


def test_lookup_merge_sums_counts(monkeypatch, capsys, tmp_path):
    a = {(1, 2, -1, -1): {3: 2, 4: 1}, (5, -1, -1, -1): {6: 1}}
    b = {(1, 2, -1, -1): {3: 5, 9: 1}, (7, 8, 9, -1): {1: 4}}
    c = {(5, -1, -1, -1): {6: 10}}
    paths = []
    for name, cache in (("a", a), ("b", b), ("c", c)):
        save_cache(cache, str(tmp_path / f"{name}.bin"))
        paths.append(str(tmp_path / f"{name}.bin"))
    out = tmp_path / "merged.bin"
    code, _, err = cli(monkeypatch, capsys, "lookup-merge", *paths, str(out))
    assert code == 0, err
    merged = load_cache(str(out))
    assert set(merged) == set(a) | set(b) | set(c)
    for ngram, part in merged.items():
        for token, count in part.items():
            assert count == sum(x.get(ngram, {}).get(token, 0) for x in (a, b, c))


def test_lookup_merge_needs_two_inputs_and_an_output(monkeypatch, capsys, tmp_path):
    save_cache({(1, -1, -1, -1): {2: 1}}, str(tmp_path / "a.bin"))
    code, _, err = cli(monkeypatch, capsys, "lookup-merge", str(tmp_path / "a.bin"), str(tmp_path / "out.bin"))
    assert code == 2
    assert "lookup-merge needs" in err
    assert not (tmp_path / "out.bin").exists()


def test_lookup_stats_figures_are_consistent(monkeypatch, capsys, tmp_path, tiny_model_path, corpus):
    static = tmp_path / "static.bin"
    model = str(tiny_model_path)
    assert cli(monkeypatch, capsys, "lookup-create", "-m", model, "-f", str(corpus), "-lcs", str(static))[0] == 0
    args = ["lookup-stats", "-m", model, "-f", str(corpus), "-c", "64", "--draft-max", "4", "-lcs", str(static)]
    code, out, err = cli(monkeypatch, capsys, *args, "--json")
    assert code == 0, err
    d = json.loads(out)
    n_tokens = len(tokenize_corpus(load_tokenizer(model), str(corpus)))
    assert d["n_draft"] == 4
    assert d["n_predict"] == n_tokens - n_tokens % 64
    assert 0 < d["n_accept"] <= d["n_drafted"]  # the corpus repeats itself: drafts are accepted
    assert d["accept"] == pytest.approx(100 * d["n_accept"] / d["n_drafted"])
    code, out, err = cli(monkeypatch, capsys, *args)
    assert code == 0 and "n_accept" in err and "us per token" in err


def lookup_json(monkeypatch, capsys, model, *args: str) -> dict:
    code, out, err = cli(monkeypatch, capsys, "lookup", "-m", model, "-p", PROMPT, "--temp", "0", "-n", "48",
                         "-c", "256", "-dev", "cpu", "--json", *args)
    assert code == 0, err
    return json.loads(out)


def test_lookup_is_lossless_and_the_saved_dynamic_cache_helps(monkeypatch, capsys, tmp_path, tiny_model_path):
    model = str(tiny_model_path)
    code, out, err = cli(monkeypatch, capsys, "run", "-m", model, "-p", PROMPT, "--temp", "0", "-n", "48",
                         "-c", "256", "-dev", "cpu", "--json")
    assert code == 0, err
    plain = json.loads(out)["content"]
    dynamic = tmp_path / "dynamic.bin"
    fixed = ("--draft-max", "8")  # draft lengths not planned from timings: the counts below compare the caches only
    first = lookup_json(monkeypatch, capsys, model, "-lcd", str(dynamic), *fixed)
    assert first["content"] == plain
    assert 0 <= first["n_accept"] <= first["n_drafted"] and first["n_predict"] == 48
    saved = load_cache(str(dynamic))
    assert saved  # the context cache of the run, merged into the (empty) dynamic cache
    second = lookup_json(monkeypatch, capsys, model, "-lcd", str(dynamic), *fixed)
    assert second["content"] == plain
    assert second["n_drafted"] >= first["n_drafted"] and second["n_accept"] >= first["n_accept"]
    assert (second["n_drafted"], second["n_accept"]) != (first["n_drafted"], first["n_accept"])
    # the second run's text was merged on top of the first: every saved count grew
    grown = load_cache(str(dynamic))
    assert all(grown[g][t] > c for g, part in saved.items() for t, c in part.items())


def test_lookup_draft_max_is_the_draft_length(monkeypatch, capsys, tiny_model_path):
    # longer than the spec type's fixed 8: llama-lookup drafts --draft-max tokens
    d = lookup_json(monkeypatch, capsys, str(tiny_model_path), "--draft-max", "12")
    (stats,) = d["drafters"]
    assert d["n_draft"] == 12 and stats["name"] == "ngram-cache"
    assert SPEC_N_DRAFT < len(stats["n_gen_tokens_per_pos"]) <= 12
    assert NgramCacheDrafter(SpecParams(), 1).n_draft == SPEC_N_DRAFT == 8  # the spec type keeps llama.cpp's 8


def test_saved_dynamic_cache_counts_the_whole_text(tmp_path, tiny_model_path):
    """As llama-lookup: every token of the text, up to the last one sampled, ends in the saved context counts."""
    path = str(tmp_path / "dynamic.bin")
    engine = build_engine(EngineOptions(model=str(tiny_model_path), n_ctx=256, device="cpu"))
    session, _ = open_lookup_session(engine, SpecParams(lookup_cache_dynamic=path), 4)
    prompt = session.engine.tokenizer.encode(PROMPT, add_special=True, parse_special=True)
    s = generate(session.generator(), prompt, SamplingParams(temp=0.0), 30)
    save_dynamic_cache(session, s)
    expected = {}
    ngram_cache_update(expected, NGRAM_MIN, NGRAM_MAX, s.tokens + [s.id_last], len(s.tokens) + 1)
    assert len(s.tokens) + 1 == len(prompt) + 30
    assert load_cache(path) == expected


@pytest.mark.parametrize("command", ["lookup", "lookup-stats"])
def test_missing_static_cache_is_a_one_line_error(monkeypatch, capsys, tmp_path, tiny_model_path, corpus, command):
    missing = str(tmp_path / "nope.bin")
    args = ["-p", PROMPT] if command == "lookup" else ["-f", str(corpus)]
    code, _, err = cli(monkeypatch, capsys, command, "-m", str(tiny_model_path), *args, "-lcs", missing)
    assert code == 1
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and missing in lines[0]
    assert "Traceback" not in err
