"""Record a drafter's acceptance trace from a real run, for tests that replay it through the adaptive planner.

Runs one drafter at a fixed --draft-max (every draft verified whole, so its accepted count says how much of it any
shorter cut would have kept) greedily over a built-in prompt set, and writes a compact JSON document:
  verify_ms  the target's verify-cost curve at the first prompt's depth (rows -> ms, the planner's calibration)
  prompts    per prompt, per step: [draft tokens proposed (= verified), tokens accepted, drafting us]
plus the model, settings, date and commit. Usage (the trace in tests/traces/ was made so):

    python scripts/record_acceptance_trace.py --target qwen2.5-coder-0.5b --spec-type ngram-mod \
        --prompt-set code-edit -n 64 --out tests/traces/ngram-mod-code-edit-0.5b.json
"""

from __future__ import annotations

import spec_cli  # noqa: F401  (first: sets the OpenMP wait policy before torch loads)

# isort: split

import argparse
import json
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

import torch

from spec_cli.model.catalog import resolve_model
from spec_cli.model.sampling import SamplingParams
from spec_cli.runtime.engine import EngineOptions
from spec_cli.runtime.session import Session, open_session
from spec_cli.speculative.base import SpecParams
from spec_cli.text.prompt_sets import load_prompt_set, render_tokens

GREEDY = SamplingParams(temp=0.0)


def verify_curve(session: Session, prompt: list[int]) -> dict[str, float]:
    """The verify-cost calibration at `prompt`'s depth, in ms per row count."""
    session.reset()
    session.generator().start(0, prompt, GREEDY, 1)
    costs = session.engine.costs
    costs.calibrate(session.engine.ctx, 0)
    return {str(rows): round(seconds * 1000, 3) for rows, seconds in zip(costs.rows, costs.seconds)}


def record_prompt(session: Session, prompt: list[int], n_predict: int) -> list[list[int]]:
    """[proposed, accepted, drafting us] per step of one greedy generation."""
    gen = session.generator()
    gen.start(0, prompt, GREEDY, n_predict)
    s = gen.active[0]
    steps = []
    while not s.done:
        drafted, accepted, draft_ms = s.n_drafted, s.n_accepted, gen.timings.t_draft_ms
        gen.step()
        steps.append([s.n_drafted - drafted, s.n_accepted - accepted, round((gen.timings.t_draft_ms - draft_ms) * 1000)])
    gen.finish(0)
    return steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="qwen2.5-coder-0.5b")
    ap.add_argument("--spec-type", default="ngram-mod")
    ap.add_argument("--prompt-set", default="code-edit")
    ap.add_argument("--draft-max", type=int, default=16)
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    spec = SpecParams(types=[args.spec_type], draft_max=args.draft_max)
    session = open_session(EngineOptions(model=str(resolve_model(args.target)), n_ctx=4096, spec=spec))
    prompts = [render_tokens(p, session.engine.tokenizer) for p in load_prompt_set(args.prompt_set).prompts]
    curve = verify_curve(session, prompts[0])
    t0 = time.perf_counter()
    steps = [record_prompt(session, prompt, args.n) for prompt in prompts]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    trace = dict(target=args.target, spec_type=args.spec_type, prompt_set=args.prompt_set, n_predict=args.n,
                 draft_max=args.draft_max, threads=args.threads, date=date.today().isoformat(), commit=commit,
                 command=" ".join(["python", *sys.argv]), verify_ms=curve, prompts=steps)
    Path(args.out).write_text(json.dumps(trace, separators=(",", ":")) + "\n")
    n_steps = sum(map(len, steps))
    print(f"{n_steps} steps in {time.perf_counter() - t0:.1f} s, curve (ms) {curve}")


if __name__ == "__main__":
    main()
