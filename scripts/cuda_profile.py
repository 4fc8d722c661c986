"""Where a CUDA decode step's time goes: the torch profiler over single-token decodes, eager or under CUDA graphs.

    python scripts/cuda_profile.py MODEL.gguf [--compile on|off] [--tokens 32] [--host]

Decodes a short warm-up first (under CUDA graphs that records the graph for the key-range bucket the profiled
tokens fall in), then profiles --tokens decodes at positions inside that one bucket and prints, per token: wall time,
summed GPU kernel time, kernel launches, and the kernels that take the most GPU time; with --host, the unprofiled
wall time per token and where the host's Python spends it (cProfile: the functions with the most own time per
token), for a step the GPU waits on. Diagnostic only (docs/cuda.md).
"""

from __future__ import annotations

import spec_cli  # noqa: F401  (first: sets the OpenMP wait policy before torch loads)

# isort: split

import argparse
import cProfile
import pstats
import time

import torch
from torch.profiler import ProfilerActivity, profile

from spec_cli.model.batch import Batch
from spec_cli.model.context import Context
from spec_cli.model.loader import load_model

START = 70  # first profiled position: warm-up fills 0..START-1, the profiled decodes stay in the 128-key bucket


def one_token(ctx: Context, pos: int, tok: int) -> int:
    b = Batch()
    b.add(tok, pos, 0, True)
    logits = ctx.decode(b).logits
    return int(logits[-1].argmax())  # a host sync per token, as generation has


def decode_span(ctx: Context, start: int, stop: int, tok: int) -> int:
    """The cache rolled back to `start`, then one-token decodes at positions start..stop-1; the last token."""
    ctx.seq_rm(0, start)
    for pos in range(start, stop):
        tok = one_token(ctx, pos, tok)
    return tok


def ms_per_token(ctx: Context, tok: int, n: int) -> tuple[float, int]:
    """Unprofiled wall time per token of n decodes from START; the last token."""
    t0 = time.perf_counter()
    tok = decode_span(ctx, START, START + n, tok)
    return (time.perf_counter() - t0) / n * 1e3, tok


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--compile", default="on", choices=("on", "off"))
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--host", action="store_true", help="cProfile the host instead of the torch profiler")
    args = ap.parse_args()
    lm = load_model(args.model, device="cuda")
    ctx = Context(lm, n_ctx=START + args.tokens + 1, compile=args.compile)
    tok = decode_span(ctx, 0, START, 1)
    tok = decode_span(ctx, START, START + 4, tok)  # the bucket's graph recorded and replayed once before the clock
    ctx.seq_rm(0, START)
    torch.cuda.synchronize()
    if args.host:
        return profile_host(ctx, tok, args.tokens)
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        decode_span(ctx, START, START + args.tokens, tok)
        torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / args.tokens
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu_us = sum(e.device_time for e in kernels) / args.tokens
    print(f"--compile {args.compile}: {wall * 1e3:.2f} ms wall/token (profiled), {gpu_us / 1e3:.2f} ms GPU/token, "
          f"{len(kernels) / args.tokens:.0f} kernels/token")
    print(prof.key_averages().table(sort_by="device_time_total", row_limit=15, max_name_column_width=70))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70))


def profile_host(ctx: Context, tok: int, n: int) -> None:
    """Unprofiled wall time per token over the bucket's positions, then the same decodes under cProfile."""
    ms, tok = ms_per_token(ctx, tok, n)
    print(f"--compile: {ms:.3f} ms wall/token (unprofiled)")
    prof = cProfile.Profile()
    prof.enable()
    tok = decode_span(ctx, START, START + n, tok)
    prof.disable()
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(30)
    # what dynamo's guard checks cost: the same decodes with them skipped (unsafe in general: not for spec-cli)
    with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
        ms, _ = ms_per_token(ctx, tok, n)
    print(f"--compile, guards skipped: {ms:.3f} ms wall/token (unprofiled)")


if __name__ == "__main__":
    main()
