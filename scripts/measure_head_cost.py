"""What one EAGLE-3 draft token costs next to a target forward, paired in one process: a one-row target decode and a
one-row head decode (a draft step: the head's layer, its output over the draft vocabulary) at the same depth,
interleaved, medians of many.

    python scripts/measure_head_cost.py -m qwen2.5-coder-1.5b [-md head.gguf] [-t 2] [--depth 256] [--reps 200]

Without -md the head is one of the trainer's shape for the target (the target's hidden size and FFN width, a
16,000-token draft vocabulary) with its initial weights: the cost depends on the shapes only.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from spec_cli.model.batch import Batch
from spec_cli.model.catalog import resolve_model
from spec_cli.model.context import Context
from spec_cli.model.eagle3_file import load_eagle3_head, write_eagle3_gguf
from spec_cli.model.eagle3_head import Eagle3Head, Eagle3Layout
from spec_cli.model.head_context import HeadContext
from spec_cli.model.loader import load_model
from spec_cli.train.eagle3 import default_layers, head_config

DRAFT_VOCAB = 16000


def shaped_head(loaded, path: Path) -> Path:
    """An eagle3 file of the trainer's shapes for this target, random weights."""
    cfg = head_config(loaded.config, 0)
    layers = default_layers(loaded.config.n_layer_main)
    head = Eagle3Head(cfg, Eagle3Layout(layers, cfg.n_embd, False, False, False), loaded.model, {"output"},
                      DRAFT_VOCAB)
    for p in head.parameters():
        torch.nn.init.normal_(p, std=0.02)
    head.draft_vocab = torch.arange(DRAFT_VOCAB)
    return write_eagle3_gguf(head, loaded.gguf.path, path)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("-md", "--model-draft")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--depth", type=int, default=256)
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = load_model(resolve_model(args.model), device="cpu")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(args.model_draft) if args.model_draft else shaped_head(target, Path(tmp) / "head.gguf")
        head = load_eagle3_head(path, target)
    n = args.depth + args.reps + 2
    ctx, hctx = Context(target, n_ctx=n), HeadContext(head, n_ctx=n)
    ctx.decode(Batch([100] * args.depth, list(range(args.depth)), [0] * args.depth, [False] * args.depth))
    hctx.decode(Batch([100] * args.depth, list(range(args.depth)), [0] * args.depth, [False] * args.depth))
    times = {"target": [], "head": []}
    for i in range(args.reps):
        pos = args.depth + i
        for name, c in (("target", ctx), ("head", hctx)):
            t0 = time.perf_counter()
            c.decode(Batch([100], [pos], [0], [True])).logits.argmax()
            times[name].append(time.perf_counter() - t0)
    target_ms, head_ms = (statistics.median(times[k]) * 1000 for k in ("target", "head"))
    print(f"{args.model} at depth {args.depth}, {args.threads} threads: target decode {target_ms:.2f} ms, "
          f"draft token {head_ms:.2f} ms, ratio {head_ms / target_ms:.3f}")


if __name__ == "__main__":
    main()
