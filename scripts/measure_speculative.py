"""Speculative decoding on the code-editing task (rename a variable in a 40-line file), plain vs every drafter.

Runs every configuration in ONE process, interleaved round by round (this machine drifts by up to ~30 % over
minutes), greedy, and prints tok/s, acceptance, mean acceptance length and speed-up over the plain run of the same
round. Usage:

    python scripts/measure_speculative.py --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b -n 128 --rounds 2
    python scripts/measure_speculative.py --target qwen2.5-coder-0.5b --no-draft
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from spec_cli.engine import EngineOptions, build_chain, build_engine
from spec_cli.generate import generate
from spec_cli.models import resolve_model
from spec_cli.sampling import SamplingParams
from spec_cli.speculative.base import SpecParams

REFERENCE = Path(__file__).resolve().parents[1] / "tests" / "reference"


def configs(with_draft: bool) -> list[tuple[str, list[str], int]]:
    out = [("plain", [], 16), ("ngram-simple", ["ngram-simple"], 16), ("ngram-mod", ["ngram-mod"], 16),
           ("lookup (ngram-cache)", ["ngram-cache"], 8)]
    if with_draft:
        out += [("draft-simple max 3", ["draft-simple"], 3), ("draft-simple max 16", ["draft-simple"], 16)]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--no-draft", action="store_true")
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    case = next(c for c in json.loads((REFERENCE / "qwen2.5-coder-1.5b.json").read_text())["greedy"]
                if c["id"] == "code-edit-rename")
    prompt = case["prompt_ids"]
    with_draft = not args.no_draft
    spec = SpecParams(types=["draft-simple"] if with_draft else [], draft_p_min=0.75)
    engine = build_engine(EngineOptions(model=str(resolve_model(args.target)),
                                        model_draft=str(resolve_model(args.draft)) if with_draft else None,
                                        n_ctx=2048, dtype=args.dtype, spec=spec))
    results: dict[str, list[dict]] = {}
    for rnd in range(args.rounds):
        for name, types, draft_max in configs(with_draft):
            engine.spec.types, engine.spec.draft_max = types, draft_max
            engine.reset()
            engine.chain = build_chain(engine)  # cold: empty n-gram state every run
            gen = engine.generator()
            t0 = time.perf_counter()
            seq = generate(gen, prompt, SamplingParams(temp=0.0), args.n)
            total = time.perf_counter() - t0
            gen_s = total - gen.timings.t_prompt_ms / 1000
            results.setdefault(name, []).append(dict(
                tok_s=seq.n_generated / gen_s, n_drafted=seq.n_drafted, n_accepted=seq.n_accepted,
                steps=seq.n_steps, draft_ms=gen.timings.t_draft_ms, verify_ms=gen.timings.t_verify_ms))
            print(f"round {rnd} {name:22s} {seq.n_generated / gen_s:7.2f} tok/s", flush=True)
    plain = statistics.median(r["tok_s"] for r in results["plain"])
    print(f"\ntarget {args.target}, draft {args.draft if with_draft else '-'}, {args.n} tokens, greedy, "
          f"{args.threads} threads, medians of {args.rounds} interleaved rounds")
    print(f"{'config':22s} {'tok/s':>7s} {'speedup':>8s} {'accept %':>9s} {'mean len':>9s} {'draft ms':>9s} {'verify ms':>9s}")
    rows = []
    for name, runs in results.items():
        tok_s = statistics.median(r["tok_s"] for r in runs)
        r = runs[-1]
        acc = 100 * r["n_accepted"] / r["n_drafted"] if r["n_drafted"] else 0.0
        mean_len = (r["steps"] + r["n_accepted"]) / r["steps"] if r["steps"] else 0.0
        rows.append(dict(config=name, tok_s=tok_s, speedup=tok_s / plain, accept=acc, mean_len=mean_len))
        print(f"{name:22s} {tok_s:7.2f} {tok_s / plain:7.2f}x {acc:8.1f} {mean_len:9.2f} {r['draft_ms']:9.0f} "
              f"{r['verify_ms']:9.0f}")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
