"""Glue of the lookup tools (llama.cpp examples/lookup: llama-lookup, -create, -merge, -stats) around the n-gram
cache of `spec_cli.speculative.ngram_cache`: a tokenizer without weights, cache files, llama-lookup's figures
(the counting and replay on plain token lists are in lookup_offline.py).

`lookup` itself generates through the shared Generator with the chain ["ngram-cache"]; this module opens the session
of that chain (timing the cache loading as llama-lookup's t_draft_flat) and saves the dynamic cache afterwards.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace

from spec_cli.errors import SpecCliError
from spec_cli.model.gguf_file import GGUFFile
from spec_cli.runtime.engine import Engine, resolve
from spec_cli.runtime.generate import Sequence
from spec_cli.runtime.lookup_offline import lookup_stats
from spec_cli.runtime.session import Session
from spec_cli.speculative.base import DraftParams, SpecParams
from spec_cli.speculative.ngram_cache import NgramCacheDrafter
from spec_cli.speculative.ngram_cache_file import NgramCache, load_cache, merge_caches
from spec_cli.text.tokenizer import Tokenizer


def load_tokenizer(model: str | None) -> Tokenizer:
    """The model's tokenizer from its GGUF metadata; the weights are never read."""
    return Tokenizer.from_metadata(GGUFFile(resolve(model)).metadata)


def tokenize_corpus(tok: Tokenizer, path: str) -> list[int]:
    """As llama.cpp's lookup tools: BOS per the model, special tokens in the text recognized."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise SpecCliError(f"cannot read {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise SpecCliError(f"{path} is not UTF-8 text") from None
    return tok.encode(text, add_special=True, parse_special=True)


# --- lookup-merge


def merge_cache_files(paths: list[str]) -> NgramCache:
    """llama-lookup-merge: every file's counts added together (the caller writes the result)."""
    merged = load_cache(paths[0])
    for path in paths[1:]:
        merge_caches(merged, load_cache(path))
    return merged


def load_dynamic_cache(path: str | None) -> NgramCache:
    """A dynamic cache that does not exist yet is empty: the tools create it."""
    return load_cache(path) if path and os.path.exists(path) else {}


# --- lookup


def open_lookup_session(engine: Engine, spec: SpecParams, n_draft: int) -> tuple[Session, float]:
    """A session on `engine` with the chain ["ngram-cache"] drafting `n_draft` tokens per step (`spec` names the
    cache files); returns it and the ms spent loading the static and dynamic caches (part of llama-lookup's
    t_draft_flat).

    The engine is built without spec types so that this load happens here, once, under the timer.
    """
    t0 = time.perf_counter()
    session = Session(engine, replace(spec, types=["ngram-cache"], draft_max=n_draft))
    t_load_ms = (time.perf_counter() - t0) * 1e3
    lookup_drafter(session).n_draft = n_draft
    return session, t_load_ms


def lookup_drafter(session: Session) -> NgramCacheDrafter:
    return session.chain.drafters[0]


def save_dynamic_cache(session: Session, s: Sequence) -> None:
    """End of llama-lookup: context cache (every token of the text) merged into the dynamic cache, saved to -lcd."""
    drafter = lookup_drafter(session)
    # The drafter indexes the history when asked for a draft; the last step's tokens came after the last
    # draft call, so ask once more with no room to draft (outside the chain: not counted as a draft call).
    drafter.draft([DraftParams(s.seq, 0, s.n_past, s.id_last, s.tokens)])
    drafter.save_dynamic()


def draft_figures(n_draft: int, n_predict: int, n_drafted: int, n_accept: int, t_flat_ms: float,
                  t_draft_ms: float) -> dict:
    """llama-lookup's / llama-lookup-stats' closing figures as one object."""
    return {
        "n_draft": n_draft,
        "n_predict": n_predict,
        "n_drafted": n_drafted,
        "t_draft_flat_ms": round(t_flat_ms, 3),
        "t_draft_ms": round(t_draft_ms, 3),
        "t_draft_us_per_token": round(1e3 * t_draft_ms / n_drafted, 3) if n_drafted else 0.0,
        "draft_tokens_per_second": round(n_drafted / (t_draft_ms * 1e-3), 3) if t_draft_ms > 0 else 0.0,
        "n_accept": n_accept,
        "accept": 100.0 * n_accept / n_drafted if n_drafted else 0.0,
    }


def lookup_figures(session: Session, s: Sequence, t_load_ms: float) -> dict:
    """The figures of one `lookup` run. t_draft_flat = cache loading + indexing the prompt (the chain's begin);
    t_draft = the drafter's draft calls, which also index each accepted token, as llama-lookup times them."""
    st = session.stats["ngram-cache"]
    return draft_figures(session.n_draft, s.n_generated, s.n_drafted, s.n_accepted,
                         t_load_ms + st.t_begin_us / 1e3, st.t_draft_us / 1e3)


# --- lookup-stats


def simulate(tokens: list[int], n_ctx: int, n_draft: int, static_path: str | None, dynamic_path: str | None) -> dict:
    """llama-lookup-stats: replay `tokens` in chunks of n_ctx with the static and dynamic caches (not saved)."""
    t0 = time.perf_counter()
    nc_static = load_cache(static_path) if static_path else {}
    nc_dynamic = load_dynamic_cache(dynamic_path)
    t_flat_ms = (time.perf_counter() - t0) * 1e3
    r = lookup_stats(tokens, n_ctx, n_draft, nc_static, nc_dynamic)
    return draft_figures(n_draft, r["n_predict"], r["n_drafted"], r["n_accept"], t_flat_ms, r["t_draft_ms"])
