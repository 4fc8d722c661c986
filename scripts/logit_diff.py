"""Teacher-forced logits of spec-cli against llama.cpp (through llama-cpp-python) on the reference prompts.

For every greedy case of ../shared/reference/<model>.json (llama.cpp's own prompts and continuations), both engines
evaluate the prompt plus llama.cpp's continuation in one batch; per model it prints the largest |logit difference|
over the vocabulary and positions (median over positions too), and the positions where the argmaxes differ with
both engines' top-2 margins there, and the issue-12 criterion: llama.cpp's greedy tokens reproduced up to its first
top-2 margin below 0.1 (the positions before it where the argmaxes differ are counted as `prefix misses`).

    python scripts/logit_diff.py -m smollm2-135m gemma3-270m qwen2.5-coder-0.5b qwen2.5-coder-1.5b --dtype auto f32
"""

from __future__ import annotations

import spec_cli  # noqa: F401  (first: sets the OpenMP wait policy before torch loads)

# isort: split

import argparse
import json
import statistics
from pathlib import Path

import numpy as np
import torch

from spec_cli.model.batch import Batch
from spec_cli.model.catalog import resolve_model
from spec_cli.model.context import Context
from spec_cli.model.loader import load_model

REFERENCE = Path(__file__).resolve().parents[1] / "tests" / "reference"


def ours(loaded, tokens: list[int], n_out: int) -> np.ndarray:
    """[n_out, V]: row i predicts tokens[-n_out + i] (from the position before it)."""
    batch = Batch()
    for i, tok in enumerate(tokens):
        batch.add(tok, i, 0, len(tokens) - n_out - 1 <= i < len(tokens) - 1)
    return Context(loaded, n_ctx=2048).decode(batch).logits.numpy()


def theirs(llm, tokens: list[int], n_out: int) -> np.ndarray:
    llm.reset()
    llm.eval(tokens)
    return np.array(llm.scores[len(tokens) - n_out - 1 : len(tokens) - 1], dtype=np.float32)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-m", "--models", nargs="+", default=["smollm2-135m"])
    ap.add_argument("--dtype", nargs="+", default=["auto"])
    ap.add_argument("-t", "--threads", type=int, default=2)
    args = ap.parse_args()
    from llama_cpp import Llama

    torch.set_num_threads(args.threads)
    for name in args.models:
        path = resolve_model(name)
        ref = json.loads((REFERENCE / f"{name}.json").read_text())
        llm = Llama(model_path=str(path), n_ctx=2048, n_batch=2048, n_threads=args.threads, logits_all=True,
                    verbose=False)
        for dtype in args.dtype:
            loaded = load_model(path, device="cpu", dtype=dtype)
            worst, medians, flips, misses = 0.0, [], [], 0
            for case in ref["greedy"]:
                tokens = case["prompt_ids"] + case["output_ids"]
                n_out = len(case["output_ids"])
                a, b = ours(loaded, tokens, n_out), theirs(llm, tokens, n_out)
                diff = np.abs(a - b).max(axis=1)
                worst, medians = max(worst, float(diff.max())), medians + [float(np.median(diff))]
                margins = case["top1_minus_top2_logit"]
                safe = next((i for i, m in enumerate(margins) if m < 0.1), len(margins))
                misses += int((a.argmax(1) != b.argmax(1))[:safe].sum())
                for i in np.nonzero(a.argmax(1) != b.argmax(1))[0]:
                    ta, tb = np.sort(a[i])[-2:], np.sort(b[i])[-2:]
                    flips.append(f"{case['id']}@{i}: margins ours {ta[1] - ta[0]:.3f} llama.cpp {tb[1] - tb[0]:.3f}")
            print(f"{name} {dtype} ({loaded.weights}): max |logit diff| {worst:.3f}, median per position "
                  f"{statistics.median(medians):.3f}, prefix misses {misses}, argmax differs at {len(flips)} positions"
                  + (": " + "; ".join(flips[:6]) if flips else ""))


if __name__ == "__main__":
    main()
