"""The lookup tools' n-gram work on plain token lists, with no model and no files (llama.cpp examples/lookup):
lookup-create's bigram counts and lookup-stats' replay of a text as if it were generated.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from spec_cli.speculative.ngram_cache import NGRAM_MAX, NGRAM_MIN, NGRAM_STATIC, ngram_cache_draft, ngram_cache_update
from spec_cli.speculative.ngram_cache_file import NgramCache, merge_caches

PROGRESS_CHUNK = 65536  # tokens counted between two progress updates of lookup-create


def build_static_cache(tokens: list[int], progress: Callable[[int], None] | None = None) -> NgramCache:
    """llama-lookup-create: bigram counts over a corpus, counted in chunks so that `progress(n_tokens_done)` can
    be called between them."""
    cache: NgramCache = {}
    for start in range(0, len(tokens), PROGRESS_CHUNK):
        end = min(start + PROGRESS_CHUNK, len(tokens))
        # the chunk's first bigrams need the NGRAM_STATIC tokens before it
        window = tokens[max(start - NGRAM_STATIC, 0) : end]
        ngram_cache_update(cache, NGRAM_STATIC, NGRAM_STATIC, window, end - start)
        if progress:
            progress(end)
    return cache


def lookup_stats(
    tokens: list[int], n_ctx: int, n_draft: int, nc_static: NgramCache, nc_dynamic: NgramCache
) -> dict:
    """llama-lookup-stats: replay `tokens` in chunks of n_ctx as if generated, drafting at every step.

    Each chunk starts with an empty context cache that is merged into nc_dynamic (in place) afterwards.
    As upstream, only chunks followed by more input are replayed (`i_start + n_ctx < n_input`).
    """
    n_drafted = n_accept = 0
    t_draft = 0.0

    def commit() -> None:  # the next chunk token becomes output and is counted (timed as drafting)
        nonlocal t_draft
        out.append(chunk[len(out)])
        t0 = time.perf_counter()
        ngram_cache_update(nc_context, NGRAM_MIN, NGRAM_MAX, out, 1)
        t_draft += time.perf_counter() - t0

    for i_start in range(0, max(len(tokens) - n_ctx, 0), n_ctx):
        chunk = tokens[i_start : i_start + n_ctx]
        nc_context: NgramCache = {}
        out = [chunk[0]]

        while len(out) < n_ctx:
            t0 = time.perf_counter()
            draft = ngram_cache_draft(out, n_draft, NGRAM_MIN, NGRAM_MAX, nc_context, nc_dynamic, nc_static)
            t_draft += time.perf_counter() - t0
            n_drafted += len(draft)
            for token in draft:  # accepted while it equals the ground truth
                if len(out) >= n_ctx or chunk[len(out)] != token:
                    break
                n_accept += 1
                commit()
            if len(out) < n_ctx:  # the token the target samples itself
                commit()
        merge_caches(nc_dynamic, nc_context)
    return {
        "n_draft": n_draft,
        "n_predict": len(tokens) - len(tokens) % n_ctx,
        "n_drafted": n_drafted,
        "n_accept": n_accept,
        "accept": 100.0 * n_accept / n_drafted if n_drafted else 0.0,
        "t_draft_ms": 1e3 * t_draft,
    }
