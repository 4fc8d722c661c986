"""Tokenizer: llama.cpp's token ids for the real models, and the BPE/SPM rules on hand-made vocabularies."""

from __future__ import annotations

import random
import time
from functools import lru_cache

import pytest

from spec_cli.errors import SpecCliError
from spec_cli.model.gguf_file import GGUFFile
from spec_cli.text.pretokenize import pre_patterns, pre_tokenize
from spec_cli.text.tokenizer import Tokenizer
from tests.real_models import real_model, reference
from tests.tiny_vocab import tiny_bpe_metadata

MODELS = ["smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"]
UNICODE_TEXT = "héllo wörld — “quotes” 日本語のテキスト 한국어 🚀🔥👍🏽 Ω≈ç√∫ 𓀀ꙮ𐍈"  # the last three are byte pieces in every vocab


@lru_cache(maxsize=None)
def _real_tokenizer(name: str) -> Tokenizer:
    return Tokenizer.from_metadata(GGUFFile(real_model(name)).metadata)


def _tiny(**changes) -> Tokenizer:
    meta = tiny_bpe_metadata()
    for key, value in changes.items():
        full = f"tokenizer.ggml.{key}"
        if value is None:
            meta.pop(full, None)
        else:
            meta[full] = value
    return Tokenizer.from_metadata(meta)


def _id(tok: Tokenizer, text: str) -> int:
    return next(i for i in range(tok.n_vocab) if tok.token_text(i) == text)


# --- real models against llama.cpp ------------------------------------------------------------------------------------

@pytest.mark.real_model
@pytest.mark.parametrize("name", MODELS)
def test_tokenize_matches_llamacpp(name):
    tok = _real_tokenizer(name)
    for entry in reference(name)["tokenize"]:
        ids = tok.encode(entry["text"], add_special=entry["add_special"], parse_special=entry["parse_special"])
        assert ids == entry["ids"], entry["text"]


@pytest.mark.real_model
@pytest.mark.parametrize("name", MODELS)
def test_prompt_ids_match_llamacpp(name):
    tok = _real_tokenizer(name)
    for entry in reference(name)["greedy"]:
        assert tok.encode(entry["prompt_text"], True, entry["parse_special"]) == entry["prompt_ids"], entry["id"]


@pytest.mark.real_model
@pytest.mark.parametrize("name", MODELS)
def test_chat_template_renders_llamacpp_prompt(name):
    tok = _real_tokenizer(name)
    chats = [e for e in reference(name)["greedy"] if "messages" in e]
    if tok.chat_template is None:
        assert not chats
        with pytest.raises(SpecCliError, match="no chat template"):
            tok.apply_chat_template([{"role": "user", "content": "hi"}])
    for entry in chats:
        assert tok.apply_chat_template(entry["messages"]) == entry["prompt_text"], entry["id"]


@pytest.mark.real_model
@pytest.mark.parametrize("name", MODELS)
def test_round_trip_reference_texts(name):
    tok = _real_tokenizer(name)
    texts = [e["text"] for e in reference(name)["tokenize"]] + [e["prompt_text"] for e in reference(name)["greedy"]]
    for text in texts + [UNICODE_TEXT]:
        assert tok.decode(tok.encode(text, add_special=False)) == text
        # with BOS: control tokens render only when asked
        assert tok.decode(tok.encode(text, add_special=True), special=False) == text


@pytest.mark.real_model
@pytest.mark.parametrize("name", MODELS)
def test_stream_decoder_never_splits_a_character(name):
    tok = _real_tokenizer(name)
    ids = tok.encode(UNICODE_TEXT, add_special=False)
    assert len(ids) > 20  # the emoji/CJK pieces really are split across byte tokens somewhere
    stream = tok.stream()
    chunks = [stream.push(i) for i in ids] + [stream.flush()]
    assert "\ufffd" not in "".join(chunks)
    assert "".join(chunks) == UNICODE_TEXT
    assert any(c == "" for c in chunks[:-1]), "some token ends mid-character and must be held back"


@pytest.mark.real_model
@pytest.mark.parametrize("name, eog_texts", [
    ("smollm2-135m", ["<|im_end|>", "<|endoftext|>"]),
    ("gemma3-270m", ["<eos>", "<end_of_turn>"]),
    ("qwen2.5-coder-0.5b", ["<|im_end|>", "<|endoftext|>", "<|fim_pad|>", "<|file_sep|>"]),
])
def test_end_of_generation_tokens(name, eog_texts):
    tok = _real_tokenizer(name)
    for text in eog_texts:
        assert tok.is_eog(_id(tok, text)), text
    assert tok.is_eog(tok.eos_id)
    assert not tok.is_eog(tok.encode("Hello", add_special=False)[0])


@pytest.mark.real_model
@pytest.mark.parametrize("name", MODELS)
def test_builds_fast(name):
    meta = GGUFFile(real_model(name)).metadata
    start = time.perf_counter()
    Tokenizer.from_metadata(meta)
    assert time.perf_counter() - start < 3.0  # measured ~0.05-0.2 s; a loose bound against regressions


# --- tiny byte-level BPE ----------------------------------------------------------------------------------------------

def _naive_bpe(word: str, merges: list[str]) -> list[str]:
    """Textbook BPE: merge the lowest-ranked adjacent pair (leftmost on ties) until no pair has a rank."""
    ranks = {m: r for r, m in reversed(list(enumerate(merges)))}
    syms = list(word)
    while True:
        ranked = [(ranks[f"{a} {b}"], i) for i, (a, b) in enumerate(zip(syms, syms[1:])) if f"{a} {b}" in ranks]
        if not ranked:
            return syms
        _, i = min(ranked)
        syms[i:i + 2] = [syms[i] + syms[i + 1]]


def test_tiny_merges_follow_rank_order():
    tok = _tiny()
    assert tok.encode("Hello world", add_special=False) == [_id(tok, "Hello"), _id(tok, "Ġworld")]
    assert tok.encode(" return", add_special=False) == [_id(tok, "Ġreturn")]
    merges = tiny_bpe_metadata()["tokenizer.ggml.merges"]
    rng = random.Random(1)
    for _ in range(300):  # one pre-token each: a space and letters
        letters = "".join(rng.choice("ethrnoaiusdlwfHb") for _ in range(rng.randint(1, 12)))
        got = [tok.token_text(i) for i in tok.encode(" " + letters, add_special=False)]
        assert got == _naive_bpe("Ġ" + letters, merges), letters


def test_tiny_round_trips_random_text():
    tok = _tiny()
    rng = random.Random(0)
    alphabet = [chr(c) for c in range(0x20, 0x7F)] + list("\t\n\r \u00a0\u3000éü—“”日本語한국🚀👍🏽\u200b\x00\x1f")
    for _ in range(200):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        assert tok.decode(tok.encode(text, add_special=False)) == text
        assert tok.decode(tok.encode(text, parse_special=True)) == text


def test_special_tokens_parsed_only_when_asked():
    tok = _tiny()
    start, end = _id(tok, "<|im_start|>"), _id(tok, "<|im_end|>")
    text = "<|im_start|>user\nHi<|im_end|>\n"
    parsed = tok.encode(text, parse_special=True)
    assert parsed[0] == start and end in parsed
    plain = tok.encode(text, parse_special=False)
    assert start not in plain and end not in plain
    assert tok.decode(parsed) == tok.decode(plain) == text
    assert tok.decode(parsed, special=False) == "user\nHi\n"


def test_longest_special_first_and_user_defined_always_parsed():
    meta = tiny_bpe_metadata()
    meta["tokenizer.ggml.tokens"] = meta["tokenizer.ggml.tokens"] + ["<|im"]
    meta["tokenizer.ggml.token_type"] = meta["tokenizer.ggml.token_type"] + [4]  # user-defined
    tok = Tokenizer.from_metadata(meta)
    im, start = _id(tok, "<|im"), _id(tok, "<|im_start|>")
    # the longer control token wins over the user-defined prefix it contains
    assert tok.encode("<|im_start|>", parse_special=True) == [start]
    # control tokens are text without parse_special, but user-defined ones are still cut out
    plain = tok.encode("<|im_start|>", parse_special=False)
    assert plain[0] == im and start not in plain
    assert tok.decode(plain) == "<|im_start|>"


@pytest.mark.parametrize("changes, expect_bos", [
    ({}, False),                                             # metadata says no
    ({"add_bos_token": True}, True),                         # metadata says yes
    ({"add_bos_token": None}, False),                        # BPE default: no BOS
    ({"add_bos_token": None, "pre": "llama-bpe"}, True),     # ... except llama3-style vocabularies
])
def test_add_bos_rules(changes, expect_bos):
    tok = _tiny(**changes)
    assert tok.add_bos is expect_bos
    ids = tok.encode("Hi")
    assert (ids[0] == tok.bos_id) is expect_bos
    assert tok.encode("Hi", add_special=False) == ids[1:] if expect_bos else ids
    assert tok.encode("", add_special=True) == ([tok.bos_id] if expect_bos else [])


def test_add_eos_appends_eos():
    tok = _tiny(add_eos_token=True)
    assert tok.encode("Hi")[-1] == tok.eos_id
    assert tok.encode("Hi", add_special=False)[-1] != tok.eos_id


def test_eog_and_pieces_of_control_tokens():
    tok = _tiny()
    im_end, eot = _id(tok, "<|im_end|>"), _id(tok, "<|endoftext|>")
    assert tok.eos_id == im_end and tok.is_eog(im_end) and tok.is_eog(eot)
    assert tok.eot_id == im_end  # llama.cpp's list: <|im_end|> before <|endoftext|>
    assert not tok.is_eog(_id(tok, "<|im_start|>")) and not tok.is_eog(_id(tok, "Hello"))
    assert tok.token_to_piece(im_end) == b"<|im_end|>" and tok.token_to_piece(im_end, special=False) == b""
    assert tok.token_to_piece(_id(tok, "Ġthe")) == b" the"
    assert tok.token_to_piece(_id(tok, "Ċ")) == b"\n"


def test_stream_decoder_holds_partial_characters():
    tok = _tiny()
    text = "a🚀b日"
    ids = tok.encode(text, add_special=False)
    assert len(ids) == len(text.encode())  # no merges for these: one token per byte
    stream = tok.stream()
    chunks = [stream.push(i) for i in ids]
    assert chunks == ["a", "", "", "", "🚀", "b", "", "", "日"]
    assert stream.flush() == ""
    cut = tok.stream()
    assert cut.push(ids[1]) == "" and cut.flush() == "\ufffd"  # a truncated character surfaces only at the end


def test_properties():
    tok = _tiny()
    meta = tiny_bpe_metadata()
    assert tok.n_vocab == len(meta["tokenizer.ggml.tokens"])
    assert tok.vocab_type == "bpe"
    assert tok.token_text(0) == meta["tokenizer.ggml.tokens"][0]
    assert tok.chat_template == meta["tokenizer.chat_template"]
    with pytest.raises(SpecCliError, match="out of range"):
        tok.token_to_piece(tok.n_vocab)


def test_errors():
    with pytest.raises(SpecCliError, match="no tokenizer"):
        Tokenizer.from_metadata({})
    with pytest.raises(SpecCliError, match="'bert'"):
        _tiny(model="bert")
    with pytest.raises(SpecCliError, match="'no-such-pre'"):
        _tiny(pre="no-such-pre")
    with pytest.raises(SpecCliError, match="merges"):
        _tiny(merges=None)
    with pytest.warns(UserWarning, match="default"):
        tok = _tiny(pre=None)
    assert tok.decode(tok.encode("Hello world 123")) == "Hello world 123"


@pytest.mark.parametrize("pre, words", [
    ("qwen2", ["abc", " ", "1", "2", "3", "4", "5", " x"]),          # \p{N}: one digit per word
    ("llama-bpe", ["abc", " ", "123", "45", " x"]),                   # \p{N}{1,3}
    ("smollm", ["abc", " ", "1", "2", "3", "4", "5", " x"]),         # digits split first, then the GPT-2 regex
    ("default", ["abc", " ", "123", "45", " x"]),                     # \p{N}+ then [0-9]{3}
])
def test_pre_tokenizer_digit_rules(pre, words):
    assert pre_tokenize("abc 12345 x", pre_patterns(pre)) == words


def test_pre_tokenizer_unicode_categories():
    qwen = pre_patterns("qwen2")
    assert pre_tokenize("naïve café 日本語", qwen) == ["naïve", " café", " 日本語"]  # letters outside ASCII
    assert pre_tokenize("a🚀🚀b", qwen) == ["a", "🚀🚀", "b"]                      # a symbol is not a letter
    assert pre_tokenize("x\u3000\u3000y", qwen) == ["x", "\u3000", "\u3000y"]       # non-ASCII whitespace is \s
    assert pre_tokenize("it's", qwen) == ["it", "'s"]


# --- tiny SentencePiece (SPM) -----------------------------------------------------------------------------------------

SPM_PIECES = {"▁": -1.0, "a": -2.0, "b": -2.0, "ab": -1.5, "▁a": -1.2, "▁ab": -0.5, "bb": -0.1, "abb": -0.3, "\n": -3.0}


def _tiny_spm(**changes) -> Tokenizer:
    pieces = SPM_PIECES
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + list(pieces)
    meta = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [0.0] * 259 + list(pieces.values()),
        "tokenizer.ggml.token_type": [2, 3, 3] + [6] * 256 + [1] * len(pieces),
    }
    meta.update({f"tokenizer.ggml.{k}": v for k, v in changes.items()})
    return Tokenizer.from_metadata(meta)


def test_spm_merges_by_score_with_space_prefix_and_byte_fallback():
    tok = _tiny_spm()
    assert tok.vocab_type == "spm" and tok.add_bos and tok.bos_id == 1 and tok.eos_id == 2
    # "bb" (-0.1) merges first, leftmost; the new pair "a"+"bb" (-0.3) then beats "▁a" (-1.2)
    assert [tok.token_text(i) for i in tok.encode("abbb", add_special=False)] == ["▁", "abb", "b"]
    assert [tok.token_text(i) for i in tok.encode("ab", add_special=False)] == ["▁ab"]  # via "▁a" + "b"
    # é is no piece: it falls back to its two UTF-8 byte tokens
    assert [tok.token_text(i) for i in tok.encode("é", add_special=False)] == ["▁", "<0xC3>", "<0xA9>"]
    assert tok.encode("ab")[0] == tok.bos_id
    for text in ["ab ab", "é a\nb", "  leading", "trailing  "]:
        assert tok.decode(tok.encode(text, add_special=False)) == text  # the added "▁" prefix comes off again


def test_spm_without_space_prefix():
    tok = _tiny_spm(add_space_prefix=False)
    assert [tok.token_text(i) for i in tok.encode("ab", add_special=False)] == ["ab"]
    assert tok.decode(tok.encode(" ab", add_special=False)) == " ab"


def _naive_spm(text: str) -> list[str]:
    """Textbook SentencePiece BPE: merge the best-scored adjacent pair that is a piece (leftmost on ties)."""
    syms = list(text)
    while True:
        scored = [(-SPM_PIECES[a + b], i) for i, (a, b) in enumerate(zip(syms, syms[1:])) if a + b in SPM_PIECES]
        if not scored:
            return syms
        _, i = min(scored)
        syms[i:i + 2] = [syms[i] + syms[i + 1]]


def test_spm_matches_textbook_merge_order():
    tok = _tiny_spm()
    rng = random.Random(2)
    for _ in range(300):
        text = "".join(rng.choice("ab a") for _ in range(rng.randint(1, 14)))
        got = [tok.token_text(i) for i in tok.encode(text, add_special=False)]
        assert got == _naive_spm("▁" + text.replace(" ", "▁")), text


# --- min_tokens: a lower bound from the text's length ---------------------------------------------------------------

HOSTILE = [*"abc xyz<>|_", "\n", "\t", " " * 7, " " * 40, "\u2581", "\u2581" * 5, "é", "日本", "🚀", "\x04", "\x1d",
           "\U00040000", "\ud800", "<|im_end|>", "<|endoftext|>", "<start_of_turn>", "<s>", "</s>", "<unk>"]


@pytest.mark.parametrize("name", ["tiny-bpe", "tiny-spm", *(pytest.param(m, marks=pytest.mark.real_model)
                                                            for m in MODELS[:3])])
def test_min_tokens_never_exceeds_the_token_count(name):
    tok = {"tiny-bpe": _tiny, "tiny-spm": _tiny_spm}.get(name, lambda: _real_tokenizer(name))()
    assert tok.min_tokens("x" * 1000) > 0  # a real bound (smollm2's vocabulary lacks some bytes: it drops them)
    rng = random.Random(4)
    tight = 0
    for _ in range(300):
        text = "".join(rng.choice(HOSTILE) for _ in range(rng.randint(0, 60)))
        bound = tok.min_tokens(text)
        for add_special in (False, True):
            for parse_special in (False, True):
                n = len(tok.encode(text, add_special, parse_special))
                assert bound <= n, (text, bound, n)
                tight += bound == n
    assert tight  # and some texts meet it (runs of the longest token)


def test_min_tokens_gives_no_bound_when_bpe_could_drop_text():
    merges = tiny_bpe_metadata()["tokenizer.ggml.merges"]
    tok = _tiny(merges=[*merges, "Ġ Q"])  # "ĠQ" is no token: BPE would fall back to bytes and drop some
    assert tok.min_tokens("x" * 1000) == 0
