"""What one draft costs next to a target forward, paired in one process: a one-row target decode against, for an
EAGLE-3 head, a one-row head decode (a draft step: the head's layer, its output over the draft vocabulary), or for a
DFlash drafter, one block decode (the anchor and --block - 1 masks over the injected context, the masks' output over
the draft vocabulary: a whole draft), at the same depth, interleaved, medians of many.

    python scripts/measure_head_cost.py -m qwen2.5-coder-1.5b [--type eagle3|dflash] [-md FILE] [-t 2] [--depth 256]
        [--reps 200] [--block 8]

Without -md the drafter is one of the trainer's shape for the target (the target's hidden size and FFN width; EAGLE-3:
a 16,000-token draft vocabulary; DFlash: its default layers, draft layers and 32,000-token vocabulary) with random
weights: the cost depends on the shapes only.
"""

from __future__ import annotations

import spec_cli  # noqa: F401  (first: sets the OpenMP wait policy before torch loads)

# isort: split

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from spec_cli.model.batch import Batch
from spec_cli.model.catalog import resolve_model
from spec_cli.model.context import Context
from spec_cli.model.dflash_file import load_dflash_head, write_dflash_gguf
from spec_cli.model.dflash_head import DFlashContext, DFlashHead, DFlashLayout
from spec_cli.model.eagle3_file import load_eagle3_head, write_eagle3_gguf
from spec_cli.model.eagle3_head import Eagle3Head, Eagle3Layout
from spec_cli.model.head_context import HeadContext
from spec_cli.model.loader import load_model
from spec_cli.options import train_default
from spec_cli.train import dflash, eagle3

DRAFT_VOCAB = 16000


def shaped_head(loaded, path: Path, kind: str, block: int) -> Path:
    """A file of the trainer's shapes for this target, random weights."""
    n_layer = loaded.config.n_layer_main
    if kind == "eagle3":
        cfg = eagle3.head_config(loaded.config, 0)
        head = Eagle3Head(cfg, Eagle3Layout(eagle3.default_layers(n_layer), cfg.n_embd, False, False, False),
                          loaded.model, {"output"}, DRAFT_VOCAB)
        write = write_eagle3_gguf
    else:
        cfg = dflash.head_config(loaded.config, train_default("dflash", "draft_layers"))
        layout = DFlashLayout(dflash.default_layers(n_layer), cfg.n_embd, block, cfg.n_vocab - 1)
        head = DFlashHead(cfg, layout, loaded.model, {"output"}, train_default("dflash", "draft_vocab"))
        write = write_dflash_gguf
    for p in head.parameters():
        torch.nn.init.normal_(p, std=0.02)
    head.draft_vocab = torch.arange(head.output.weight.shape[0])
    return write(head, loaded.gguf.path, path)


def draft_context(kind: str, path: Path, target, n: int, depth: int):
    """A draft at position `pos` of a drafter's context holding `depth` positions, and what one draft is."""
    if kind == "eagle3":
        hctx = HeadContext(load_eagle3_head(path, target), n_ctx=n)
        hctx.decode(Batch([100] * depth, list(range(depth)), [0] * depth, [False] * depth))
        return lambda pos: hctx.decode(Batch([100], [pos], [0], [True])).logits.argmax(), "draft token"
    head = load_dflash_head(path, target)
    dctx = DFlashContext(head, n_ctx=n)
    features = torch.randn(depth, len(head.target_layers), target.config.n_embd)
    dctx.inject([0] * depth, list(range(depth)), head.fuse(features))
    B = head.layout.block_size

    def block(pos: int):  # after `depth` positions whatever `pos`: mirroring accepted rows is not drafting
        dctx.decode(Batch([100] + [head.layout.mask_token] * (B - 1), list(range(depth, depth + B)), [0] * B,
                          [False] + [True] * (B - 1))).logits.argmax(-1)
        dctx.seq_rm(0, depth)

    return block, f"block of {B}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("-md", "--model-draft")
    ap.add_argument("--type", choices=("eagle3", "dflash"), default="eagle3")
    ap.add_argument("--block", type=int, default=8, help="DFlash block size of the shaped drafter")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--depth", type=int, default=256)
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = load_model(resolve_model(args.model), device="cpu")
    n = args.depth + args.reps + args.block + 2
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(args.model_draft) if args.model_draft else shaped_head(target, Path(tmp) / "head.gguf", args.type,
                                                                           args.block)
        draft, what = draft_context(args.type, path, target, n, args.depth)
    ctx = Context(target, n_ctx=n)
    ctx.decode(Batch([100] * args.depth, list(range(args.depth)), [0] * args.depth, [False] * args.depth))
    times = {"target": [], "draft": []}
    for i in range(args.reps):
        pos = args.depth + i
        t0 = time.perf_counter()
        ctx.decode(Batch([100], [pos], [0], [True])).logits.argmax()
        t1 = time.perf_counter()
        draft(pos)
        times["target"].append(t1 - t0)
        times["draft"].append(time.perf_counter() - t1)
    target_ms, draft_ms = (statistics.median(times[k]) * 1000 for k in ("target", "draft"))
    ratio = statistics.median(d / t for d, t in zip(times["draft"], times["target"]))
    print(f"{args.model} at depth {args.depth}, {args.threads} threads: target decode {target_ms:.2f} ms, "
          f"{what} {draft_ms:.2f} ms, ratio {ratio:.3f} (median of the paired ratios)")


if __name__ == "__main__":
    main()
