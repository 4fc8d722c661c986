"""Byte-level BPE pre-tokenization as llama.cpp does it: the split regexes per `tokenizer.ggml.pre` type
(llm_tokenizer_bpe's table in src/llama-vocab.cpp), run the way src/unicode.cpp `unicode_regex_split` runs them, and
GPT-2's byte <-> printable-character map."""

from __future__ import annotations

import re
import unicodedata
from functools import lru_cache

from spec_cli.errors import SpecCliError

# --- split regexes (llm_tokenizer_bpe's table) --------------------------------------------------------------

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")

# pre name -> (regexes, ignore_merges, default add_bos), grouped as llama_vocab::impl::load groups them.
_PRE_GROUPS = {
    ("default",): (_DEFAULT, False, False),
    ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"):
        ((_LLAMA3,), True, True),
    ("dbrx", "smaug-bpe"): ((_LLAMA3,), False, False),
    ("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan", "solar-open"):
        ((_QWEN2,), False, False),
    ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b", "mellum2"):
        ((r"\p{N}", _GPT2), False, False),
    ("gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0", "mellum", "modern-bert",
     "mpt", "olmo", "jais", "trillion", "granite-docling", "exaone4"): ((_GPT2,), False, False),
}
PRE_TYPES = {name: spec for names, spec in _PRE_GROUPS.items() for name in names}

# unicode_regex_split runs std::regex over a "collapsed" text: every non-ASCII codepoint becomes one byte standing for
# its category, and \p{X} in the regex becomes [<that byte> + the ASCII members of X]. Doing the same here gives
# llama.cpp's splits with Python's `re` (re.ASCII: C-locale \s, which skips \x1c-\x1f as std::regex does).
_CATEGORY_BYTE = {"N": "\xd1", "L": "\xd2", "P": "\xd3", "M": "\xd4", "S": "\xd5"}  # anything else: "\xd0"
_CATEGORY_CLASS = {"N": "\xd10-9", "L": "\xd2A-Za-z", "P": "\xd3!-#%-*,-/:-;?-@\\[-\\]_{}"}
_WHITESPACE = frozenset([0x85, 0xA0, 0x1680, *range(0x2000, 0x200B), 0x2028, 0x2029, 0x202F, 0x205F, 0x3000])


class _CollapseTable(dict):
    """str.translate table codepoint -> category byte, filled on first sight of each codepoint."""

    def __missing__(self, cp: int) -> int | str:
        if cp < 128:
            rep: int | str = cp
        elif cp in _WHITESPACE:
            rep = "\x0b"  # llama.cpp: vertical tab stands for every non-ASCII whitespace
        else:
            rep = _CATEGORY_BYTE.get(unicodedata.category(chr(cp))[0], "\xd0")
        self[cp] = rep
        return rep


_COLLAPSE = _CollapseTable()


@lru_cache(maxsize=None)
def pre_patterns(pre: str) -> tuple[re.Pattern, ...]:
    """The compiled split regexes of a BPE pre-tokenizer type (tokenizer.ggml.pre)."""
    if pre not in PRE_TYPES:
        raise SpecCliError(f"unsupported pre-tokenizer '{pre}' (supported: {', '.join(sorted(PRE_TYPES))})")
    return tuple(_compile_collapsed(r) for r in PRE_TYPES[pre][0])


def _compile_collapsed(expr: str) -> re.Pattern:
    out, inside, i = [], False, 0
    while i < len(expr):
        if expr.startswith("\\p{", i):
            body = _CATEGORY_CLASS[expr[i + 3]]
            out.append(body if inside else f"[{body}]")
            i += 5
        elif expr[i] == "\\":
            out.append(expr[i:i + 2])
            i += 2
        else:
            inside = {"[": True, "]": False}.get(expr[i], inside)
            out.append(expr[i])
            i += 1
    return re.compile("".join(out), re.ASCII)


def pre_tokenize(text: str, patterns: tuple[re.Pattern, ...]) -> list[str]:
    """Split text into words: each regex splits every piece so far, keeping both its matches and the gaps."""
    collapsed = text.translate(_COLLAPSE)
    spans = [(0, len(text))]
    for pattern in patterns:
        split = []
        for start, end in spans:
            pos = start
            for m in pattern.finditer(collapsed, start, end):
                if m.start() > pos:
                    split.append((pos, m.start()))
                split.append(m.span())
                pos = m.end()
            if pos < end:
                split.append((pos, end))
        spans = split
    return [text[s:e] for s, e in spans]


def _byte_chars() -> list[str]:
    """GPT-2's printable stand-in for each byte (unicode_byte_to_utf8_map): itself if printable, else chr(256 + n)."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    shifted = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(shifted)) for b in range(256)]


BYTE_TO_CHAR = _byte_chars()
CHAR_TO_BYTE = {c: b for b, c in enumerate(BYTE_TO_CHAR)}
