"""The n-gram cache's data and llama.cpp's lookup-cache file format (common/ngram-cache.cpp
`common_ngram_cache_save/_load/_merge`): read, write, add counts together.

A file is a sequence of records, little-endian int32: the n-gram (4 tokens, padded with -1), the number of
following tokens, then (token, count) for each of them.
"""

from __future__ import annotations

import numpy as np

from spec_cli.errors import SpecCliError

Ngram = tuple[int, int, int, int]  # LLAMA_NGRAM_MAX tokens, an n-gram shorter than that padded with -1
NgramCache = dict[Ngram, dict[int, int]]  # n-gram -> {following token: count}


def load_cache(path: str) -> NgramCache:
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise SpecCliError(f"cannot read lookup cache {path}: {e.strerror}") from None
    if len(raw) % 4:
        raise SpecCliError(f"lookup cache {path} is corrupt: {len(raw)} bytes is not a whole number of int32")
    data = np.frombuffer(raw, dtype="<i4").tolist()
    cache: NgramCache = {}
    pos = 0
    while pos < len(data):
        n_tokens = data[pos + 4] if pos + 5 <= len(data) else 0
        end = pos + 5 + 2 * n_tokens
        if n_tokens <= 0 or end > len(data):
            raise SpecCliError(f"lookup cache {path} is corrupt: bad or truncated record at byte {4 * pos}")
        counts = data[pos + 6 : end : 2]
        if min(counts) <= 0:
            raise SpecCliError(f"lookup cache {path} is corrupt: non-positive count at byte {4 * pos}")
        # A repeated n-gram keeps its first record, as std::map::emplace does.
        cache.setdefault(tuple(data[pos : pos + 4]), dict(zip(data[pos + 5 : end : 2], counts)))
        pos = end
    return cache


def save_cache(cache: NgramCache, path: str) -> None:
    out: list[int] = []
    for ngram, part in cache.items():
        out += ngram
        out.append(len(part))
        for token, count in part.items():
            out += (token, count)
    try:
        with open(path, "wb") as f:
            f.write(np.asarray(out, dtype="<i4").tobytes())
    except OSError as e:
        raise SpecCliError(f"cannot write n-gram cache {path}: {e.strerror}") from None


def merge_caches(target: NgramCache, add: NgramCache) -> None:
    """Add every count of `add` into `target` (in place)."""
    for ngram, part in add.items():
        merged = target.setdefault(ngram, {})
        for token, count in part.items():
            merged[token] = merged.get(token, 0) + count


