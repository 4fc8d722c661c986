"""Writes a GGUF with a real model's shapes and random F16 weights, for timing where the real file cannot go.

A lent GPU machine reaches no package index, so the real GGUF files (from PyPI) cannot be installed there, and they
are larger than what may travel to it. Decode speed depends on the shapes, not on the weights' values: this file has
the named model's architecture, block count, widths, head counts and vocabulary size (its tokens are the test
vocabulary padded with placeholder tokens), so plain decode and verify-cost timings on it are the real model's.
Acceptance rates are not: random weights agree with no draft.

    python scripts/shaped_gguf.py qwen2.5-coder-1.5b /tmp/m/q15.gguf
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gguf import GGMLQuantizationType  # noqa: E402

from tests.tiny_gguf import write_tiny_gguf  # noqa: E402
from tests.tiny_vocab import tiny_bpe_metadata  # noqa: E402

# (block count, widths) read from the real files' metadata: gguf.GGUFReader on ~/.cache/spec-cli/models/*.gguf
SHAPES = {
    "qwen2.5-coder-1.5b": dict(n_layer=28, n_vocab=151936,
                               dims=dict(n_embd=1536, n_ff=8960, n_head=12, n_head_kv=2, head_dim=128)),
    "qwen2.5-coder-0.5b": dict(n_layer=24, n_vocab=151936,
                               dims=dict(n_embd=896, n_ff=4864, n_head=14, n_head_kv=2, head_dim=64)),
}


def padded_vocab(n_vocab: int) -> dict:
    """The tiny BPE vocabulary's tokenizer keys with placeholder tokens appended up to n_vocab (types: unused)."""
    vocab = tiny_bpe_metadata()
    tokens = list(vocab["tokenizer.ggml.tokens"])
    n_pad = n_vocab - len(tokens)
    return {"tokenizer.ggml.tokens": tokens + [f"<|placeholder_{i}|>" for i in range(n_pad)],
            "tokenizer.ggml.token_type": list(vocab["tokenizer.ggml.token_type"]) + [5] * n_pad}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("like", choices=sorted(SHAPES))
    ap.add_argument("out", type=Path)
    args = ap.parse_args()
    shape = SHAPES[args.like]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_tiny_gguf(args.out, arch="qwen2", n_layer=shape["n_layer"], n_ctx_train=32768, qtype=GGMLQuantizationType.F16,
                    vocab_changes=padded_vocab(shape["n_vocab"]), dims=shape["dims"])
    print(f"{args.out}: {args.out.stat().st_size / 1e9:.2f} GB, shaped like {args.like}")


if __name__ == "__main__":
    main()
