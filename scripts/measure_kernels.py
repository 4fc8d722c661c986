"""Throughput of the compiled kernels' weight products per GGUF block type and activation row count: GB/s of weights
read and int8 products per second as a share of the measured multiply peak.

Random blocks (64 MB per type, sane fp16 scales) so that the weights come from memory, not cache; the median call
of those made in --seconds per cell (a single call of a few ms swings by +-15 % on a VM, the median of a second's
calls by a few %). The peak is that of the instruction the packed products multiply with (kernels.int8_peak: AVX-512
VNNI vpdpbusd, else AVX2 vpmaddubsw), on the same threads.

    python scripts/measure_kernels.py -t 1 -k 1536
"""

from __future__ import annotations

import spec_cli  # noqa: F401  (first: sets the OpenMP wait policy before torch loads)

# isort: split

import argparse
import statistics
import time

import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from spec_cli.model import kernels

TYPES = (T.Q4_K, T.Q6_K, T.Q5_0, T.Q8_0, T.Q4_1)


def random_layer(qtype: T, n_in: int, mb: int) -> tuple[kernels.LinearDesc, int]:
    """A layer of `mb` MB of random blocks of `qtype` with K = n_in, and its number of weights."""
    block, size = GGML_QUANT_SIZES[qtype]
    n_out = mb * 10**6 // (n_in // block * size)
    raw = torch.randint(0, 256, (n_out, n_in // block * size), dtype=torch.uint8)
    d = 208 if qtype == T.Q6_K else 0  # where each block's fp16 scale d lives
    raw.view(n_out, n_in // block, size)[:, :, d : d + 2] = torch.tensor([0, 0x20], dtype=torch.uint8)  # d = 2**-7
    return kernels.LinearDesc([(qtype, raw)], n_in, None), n_out * n_in


def median_call(fn, seconds: float) -> float:
    """Seconds of the median call of fn among those made in `seconds` (at least 3)."""
    times: list[float] = []
    end = time.perf_counter() + seconds
    while len(times) < 3 or time.perf_counter() < end:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-t", "--threads", type=int, default=1)
    ap.add_argument("-k", "--n-in", type=int, default=2048)
    ap.add_argument("--mb", type=int, default=64)
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--seconds", type=float, default=1.0, help="time spent on each cell")
    ap.add_argument("--avx2", action="store_true", help="the AVX2 kernels where the CPU also has AVX-512 VNNI")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    kernels.use_vnni(not args.avx2)
    peak = max(kernels.int8_peak() for _ in range(3))  # the first call also starts the pool's threads
    print(f"int8 multiply peak: {peak / 1e9:.1f} G products/s on {args.threads} thread(s)")
    for qtype in TYPES:
        layer, n_weights = random_layer(qtype, args.n_in, args.mb)
        n_bytes = sum(p.numel() for _, p in layer.packed)
        cells = []
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, args.n_in)
            call = median_call(lambda: kernels.linear(layer, x), args.seconds)
            share = n_weights * rows / call / peak * 100
            cells.append(f"{rows:2d} rows {n_bytes / call / 1e9:5.1f} GB/s {share:3.0f} %")
        print(f"{qtype.name:5s} " + "  ".join(cells))


if __name__ == "__main__":
    main()
