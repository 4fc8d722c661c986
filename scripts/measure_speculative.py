"""Speculative decoding, plain vs every drafter at a fixed --draft-max and at `auto`, on the code-editing task (rename
a variable in a 40-line file) or on a built-in prompt set.

Runs every configuration in ONE process, interleaved round by round (this machine drifts by up to ~30 % over
minutes), greedy, and prints tok/s, acceptance, mean acceptance length, verified draft tokens per step and speed-up
over the plain run of the same round (the median of the per-round ratios). The `auto` configurations share one verify-cost calibration, done before the
rounds at the first prompt's depth (its time is printed: a long-lived engine pays it once). Usage:

    python scripts/measure_speculative.py --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b -n 128 --rounds 2
    python scripts/measure_speculative.py --target qwen2.5-coder-0.5b --no-draft --threads 1
    python scripts/measure_speculative.py --target qwen2.5-coder-0.5b --no-draft --prompt-set writing
    python scripts/measure_speculative.py --prompt-set writing --configs ngram-mod,draft-simple   # plain always runs
"""

from __future__ import annotations

import spec_cli  # noqa: F401  (first: sets the OpenMP wait policy before torch loads)

# isort: split

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from spec_cli.model.catalog import resolve_model
from spec_cli.model.sampling import SamplingParams
from spec_cli.options import AUTO, draft_bound
from spec_cli.runtime.engine import Engine, EngineOptions
from spec_cli.runtime.generate import generate
from spec_cli.runtime.session import Session, open_session
from spec_cli.speculative.base import SpecParams
from spec_cli.text.prompt_sets import load_prompt_set, render_tokens

REFERENCE = Path(__file__).resolve().parents[1] / "tests" / "reference"
GREEDY = SamplingParams(temp=0.0)


def configs(with_draft: bool) -> list[tuple[str, list[str], int | str]]:
    out = [("plain", [], 16)]
    for label, types, fixed in (("ngram-simple", ["ngram-simple"], 16), ("ngram-mod", ["ngram-mod"], 16),
                                ("lookup (ngram-cache)", ["ngram-cache"], 8)):
        out += [(f"{label} {fixed}", types, fixed), (f"{label} auto", types, AUTO)]
    if with_draft:
        out += [("draft-simple 3", ["draft-simple"], 3), ("draft-simple 16", ["draft-simple"], 16),
                ("draft-simple auto", ["draft-simple"], AUTO)]
    return out


def load_prompts(engine: Engine, prompt_set: str | None) -> list[list[int]]:
    if prompt_set:
        return [render_tokens(p, engine.tokenizer) for p in load_prompt_set(prompt_set).prompts]
    case = next(c for c in json.loads((REFERENCE / "qwen2.5-coder-1.5b.json").read_text())["greedy"]
                if c["id"] == "code-edit-rename")
    return [case["prompt_ids"]]


def calibrate(session: Session, prompt: list[int]) -> float:
    """The shared verify-cost calibration of the auto runs, outside the timed rounds; returns its seconds."""
    session.reset()
    gen = session.generator()
    gen.start(0, prompt, GREEDY, 1)
    t0 = time.perf_counter()
    session.engine.costs.calibrate(session.engine.ctx, 0)
    return time.perf_counter() - t0


def run_config(session: Session, prompts: list[list[int]], n: int) -> dict:
    """Every prompt once on `session`, a cold one (fresh drafters and planner); generation time excludes the
    prefills."""
    totals = dict(tokens=0, gen_s=0.0, n_drafted=0, n_accepted=0, steps=0, draft_ms=0.0, verify_ms=0.0)
    for prompt in prompts:
        gen = session.generator()
        t0 = time.perf_counter()
        seq = generate(gen, prompt, GREEDY, n)
        totals["gen_s"] += time.perf_counter() - t0 - gen.timings.t_prompt_ms / 1000
        totals["tokens"] += seq.n_generated
        totals["n_drafted"] += seq.n_drafted
        totals["n_accepted"] += seq.n_accepted
        totals["steps"] += seq.n_steps
        totals["draft_ms"] += gen.timings.t_draft_ms
        totals["verify_ms"] += gen.timings.t_verify_ms
    return dict(totals, tok_s=totals["tokens"] / totals["gen_s"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--no-draft", action="store_true")
    ap.add_argument("--prompt-set", help="a built-in prompt set (code-edit, writing, ...) instead of the rename task")
    ap.add_argument("--configs", help="comma list of configuration name prefixes to run (default: all)")
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with_draft = not args.no_draft
    spec = SpecParams(types=["draft-simple"] if with_draft else [], draft_p_min=0.75)
    session = open_session(EngineOptions(model=str(resolve_model(args.target)),
                                         model_draft=str(resolve_model(args.draft)) if with_draft else None,
                                         n_ctx=4096, dtype=args.dtype, spec=spec))
    engine = session.engine
    prompts = load_prompts(engine, args.prompt_set)
    calibration_s = calibrate(session, prompts[0])
    curve = " ".join(f"{k}:{engine.costs(k) / engine.costs(1):.2f}" for k in engine.costs.rows)
    print(f"calibration {calibration_s:.2f} s at depth {len(prompts[0])}; cost(k)/cost(1) {curve}", flush=True)
    chosen = [c for c in configs(with_draft)
              if c[0] == "plain" or not args.configs or c[0].startswith(tuple(args.configs.split(",")))]
    results: dict[str, list[dict]] = {}
    for rnd in range(args.rounds):
        for name, types, draft_max in chosen:
            bound, adaptive = draft_bound(draft_max)
            session = session.renew(types=types, draft_max=bound, adaptive=adaptive)
            r = run_config(session, prompts, args.n)
            results.setdefault(name, []).append(r)
            print(f"round {rnd} {name:26s} {r['tok_s']:7.2f} tok/s", flush=True)
    plain = [r["tok_s"] for r in results["plain"]]
    print(f"\ntarget {args.target}, draft {args.draft if with_draft else '-'}, {args.prompt_set or 'code-edit-rename'}"
          f" ({len(prompts)} prompts), {args.n} tokens, greedy, {args.threads} threads, medians of {args.rounds} "
          f"interleaved rounds")
    print(f"{'config':26s} {'tok/s':>7s} {'speedup':>8s} {'accept %':>9s} {'mean len':>9s} {'draft/step':>10s} "
          f"{'draft ms':>9s} {'verify ms':>9s}")
    rows = []
    for name, runs in results.items():
        tok_s = statistics.median(r["tok_s"] for r in runs)
        speedup = statistics.median(r["tok_s"] / base for r, base in zip(runs, plain))
        r = runs[-1]
        acc = 100 * r["n_accepted"] / r["n_drafted"] if r["n_drafted"] else 0.0
        mean_len = (r["steps"] + r["n_accepted"]) / r["steps"] if r["steps"] else 0.0
        per_step = r["n_drafted"] / r["steps"] if r["steps"] else 0.0
        rows.append(dict(config=name, tok_s=tok_s, speedup=speedup, accept=acc, mean_len=mean_len,
                         draft_per_step=per_step, runs=[x["tok_s"] for x in runs]))
        print(f"{name:26s} {tok_s:7.2f} {speedup:7.2f}x {acc:8.1f} {mean_len:9.2f} {per_step:10.2f} "
              f"{r['draft_ms']:9.0f} {r['verify_ms']:9.0f}")
    print(json.dumps(dict(calibration_s=calibration_s, rows=rows)))


if __name__ == "__main__":
    main()
