"""Throughput of the compiled kernels' weight products per GGUF block type: GB/s of weights read for 1, 2, 4, 8 rows.

Random blocks (64 MB per type, sane fp16 scales) so that the weights come from memory, not cache; best of 3.

    python scripts/measure_kernels.py -t 1 -k 2048
"""

from __future__ import annotations

import argparse
import time

import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

import spec_cli  # noqa: F401  (first: sets the OpenMP wait policy before torch loads)
from spec_cli.model import kernels


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-t", "--threads", type=int, default=1)
    ap.add_argument("-k", "--n-in", type=int, default=2048)
    ap.add_argument("--mb", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    K = args.n_in
    for qtype in (T.Q4_K, T.Q6_K, T.Q5_0, T.Q8_0, T.Q4_1):
        block, size = GGML_QUANT_SIZES[qtype]
        N = args.mb * 10**6 // (K // block * size)
        raw = torch.randint(0, 256, (N, K // block * size), dtype=torch.uint8)
        d = 208 if qtype == T.Q6_K else 0  # where each block's fp16 scale d lives
        raw.view(N, K // block, size)[:, :, d : d + 2] = torch.tensor([0, 0x20], dtype=torch.uint8)  # d = 2**-7
        layer = kernels.LinearDesc([(qtype, raw)], K, None)
        cells = []
        for rows in (1, 2, 4, 8):
            x = torch.randn(rows, K)
            best = float("inf")
            for _ in range(3):
                t0 = time.perf_counter()
                kernels.linear(layer, x)
                best = min(best, time.perf_counter() - t0)
            cells.append(f"{rows} rows {raw.numel() / best / 1e9:5.1f} GB/s")
        print(f"{qtype.name:5s} " + "  ".join(cells))


if __name__ == "__main__":
    main()
