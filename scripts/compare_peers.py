"""spec-cli against llama.cpp (through llama-cpp-python) on the same GGUF, the same prompt tokens, in one process.

Greedy decoding of every prompt of a built-in prompt set (chat template applied by spec-cli; llama.cpp gets the same
token ids), every configuration back to back on each prompt, because this kind of machine drifts by tens of percent
over minutes. Speed is generation only: tokens after the first one over the time after the first one (prompt
processing excluded on both sides). A round's speed pools its prompts; tok/s is the median over rounds, and every
ratio the median of the rounds' own ratios (paired: a slow round slows every configuration in it). Configurations:

  spec-cli    plain, and speculative configurations given as
              TYPES:DRAFT_MAX (default: ngram-mod:16, draft-simple:16, ngram-mod,draft-simple:16 and the same with
              draft-max auto)
  llama.cpp   plain, and prompt-lookup decoding (llama-cpp-python's LlamaPromptLookupDecoding), when installed;
              each in a worker process of its own (scripts/llama_cpp_worker.py), away from torch and spec-cli's
              OpenMP policy

The last line is machine-readable: `spec-cli best / llama.cpp best: <ratio>x` (`n/a` without llama-cpp-python).

    python scripts/compare_peers.py -m qwen2.5-coder-1.5b -md qwen2.5-coder-0.5b --prompts code-edit -n 128 -t 2
"""

from __future__ import annotations

import spec_cli  # noqa: F401  (first: sets the OpenMP wait policy before torch loads)

# isort: split

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from spec_cli.model.catalog import resolve_model
from spec_cli.model.sampling import SamplingParams
from spec_cli.options import OPTIONS, draft_bound
from spec_cli.runtime.engine import EngineOptions
from spec_cli.runtime.session import Session, open_session
from spec_cli.speculative.base import SpecParams
from spec_cli.speculative.stats import DrafterStats
from spec_cli.text.prompt_sets import load_prompt_set, render_tokens

LOOKUP_DRAFT = 10  # tokens llama.cpp's prompt lookup drafts per step (LlamaPromptLookupDecoding's num_pred_tokens)
DEFAULT_SPECS = ("ngram-mod:16", "draft-simple:16", "ngram-mod,draft-simple:16",
                 "ngram-mod:auto", "draft-simple:auto", "ngram-mod,draft-simple:auto")


@dataclass
class Run:
    """One configuration on one prompt."""

    n_tokens: int  # generated after the first token
    seconds: float  # from the first token to the last
    stats: dict[str, DrafterStats] = field(default_factory=dict)  # per drafter (spec-cli only)


@dataclass
class Config:
    backend: str  # "spec-cli" | "llama.cpp"
    name: str
    run: Callable[[list[int]], Run]
    runs: list[list[Run]] = field(default_factory=list)  # per round, per prompt

    def round_tok_s(self, rnd: int) -> float:
        """All tokens / all time over the prompt set in round `rnd`."""
        return sum(r.n_tokens for r in self.runs[rnd]) / sum(r.seconds for r in self.runs[rnd])

    def tok_s(self) -> float:
        """Median over rounds."""
        return statistics.median(self.round_tok_s(i) for i in range(len(self.runs)))

    def vs(self, other: Config) -> float:
        """Median over rounds of this configuration's tok/s over `other`'s in the same round: paired, so the
        machine's drift between rounds (up to 10 % on these VMs) cancels instead of landing in the ratio."""
        return statistics.median(self.round_tok_s(i) / other.round_tok_s(i) for i in range(len(self.runs)))

    def drafter_stats(self) -> dict[str, DrafterStats]:
        """Counters pooled over every run (llama.cpp's pooled statistics, not means of ratios)."""
        pooled: dict[str, DrafterStats] = {}
        for r in (r for rnd in self.runs for r in rnd):
            for name, st in r.stats.items():
                pooled.setdefault(name, DrafterStats(name)).merge(st)
        return pooled

    def acceptance(self) -> float | None:
        stats = self.drafter_stats().values()
        drafted = sum(st.n_gen_tokens for st in stats)
        return sum(st.n_acc_tokens for st in stats) / drafted if drafted else None


def spec_cli_runner(base: Session, types: list[str], draft_max, n_gen: int) -> Callable[[list[int]], Run]:
    bound, adaptive = draft_bound(draft_max)

    def run(prompt: list[int]) -> Run:
        session = base.renew(types=types, draft_max=bound, adaptive=adaptive)  # cold n-gram state for every prompt
        gen = session.generator()
        gen.start(0, prompt, SamplingParams(temp=0.0), n_gen)
        s, t0 = gen.active[0], time.perf_counter()
        n_first = s.n_generated
        while not s.done:
            gen.step()
        seconds = time.perf_counter() - t0
        gen.finish(0)
        return Run(s.n_generated - n_first, seconds, dict(session.stats))

    return run


def parse_spec(text: str) -> tuple[list[str], int | str]:
    types, _, draft_max = text.rpartition(":")
    if not types:
        raise SystemExit(f"--spec '{text}': expected TYPES:DRAFT_MAX, e.g. ngram-mod:16 or ngram-mod:auto")
    return OPTIONS["spec_type"].value(types, "--spec"), OPTIONS["draft_max"].value(draft_max, "--spec")


def llama_cpp_runner(model_path: str, threads: int, n_ctx: int, n_gen: int, eog: set[int],
                     lookup: int) -> Callable[[list[int]], Run]:
    """llama.cpp in a worker process of its own (scripts/llama_cpp_worker.py: OpenMP defaults, no torch)."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    worker = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("llama_cpp_worker.py")), model_path, str(n_ctx), str(threads),
         str(n_gen), str(lookup), ",".join(map(str, sorted(eog)))],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    if not json.loads(worker.stdout.readline() or "{}").get("ready"):
        raise SystemExit("the llama.cpp worker did not start (see its error above)")

    def run(prompt: list[int]) -> Run:
        worker.stdin.write(json.dumps(prompt) + "\n")
        worker.stdin.flush()
        result = json.loads(worker.stdout.readline())
        return Run(result["n_tokens"], result["seconds"])

    return run


def measure(configs: list[Config], prompts: list[list[int]], rounds: int) -> None:
    """Fill every configuration's runs: an untimed warmup, then `rounds` interleaved rounds over the prompts."""
    for cfg in configs:  # untimed warmup: one-time costs (allocations, auto's verify-cost calibration) stay out
        cfg.run(prompts[0])
    for rnd in range(rounds):
        for cfg in configs:
            cfg.runs.append([])
        # every configuration back to back on each prompt, so drift hits them alike; every other prompt in
        # reverse order, so that no configuration always runs first (or right after another one)
        for i, prompt in enumerate(prompts):
            flip = (rnd * len(prompts) + i) % 2
            for cfg in configs[::-1] if flip else configs:
                cfg.runs[-1].append(cfg.run(prompt))
        for cfg in configs:
            print(f"round {rnd + 1}/{rounds}  {cfg.backend:9s} {cfg.name:38s} {cfg.round_tok_s(rnd):7.2f} tok/s "
                  f"({cfg.round_tok_s(rnd) / configs[0].round_tok_s(rnd):.3f}x plain)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("-md", "--model-draft", default="qwen2.5-coder-0.5b", help="'' = no draft model")
    ap.add_argument("--prompts", default="code-edit", help="built-in prompt set or .jsonl file")
    ap.add_argument("--n-prompts", type=int, default=0, help="first N prompts of the set (0 = all)")
    ap.add_argument("-n", "--n-gen", type=int, default=128)
    ap.add_argument("-t", "--threads", type=int, default=2, help="for both engines")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--spec", action="append", help=f"TYPES:DRAFT_MAX, repeatable (default: {' '.join(DEFAULT_SPECS)})")
    ap.add_argument("--no-llama-cpp", action="store_true", help="spec-cli configurations only")
    ap.add_argument("--json", action="store_true", help="also print the table as JSON")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    model_path = str(resolve_model(args.model))
    draft_path = str(resolve_model(args.model_draft)) if args.model_draft else None
    specs = [parse_spec(s) for s in (args.spec or DEFAULT_SPECS)]
    specs = [(t, dm) for t, dm in specs if draft_path or "draft-simple" not in t]
    every_type = sorted({t for types, _ in specs for t in types})  # the engine loads what any configuration needs
    session = open_session(EngineOptions(model=model_path, model_draft=draft_path, n_ctx=4096, threads=args.threads,
                                         spec=SpecParams(types=every_type)))
    engine = session.engine
    prompt_set = load_prompt_set(args.prompts)
    prompts = [render_tokens(p, engine.tokenizer) for p in prompt_set.prompts[: args.n_prompts or None]]

    configs = [Config("spec-cli", "plain", spec_cli_runner(session, [], 0, args.n_gen))]
    configs += [Config("spec-cli", f"{','.join(t)} draft-max {dm}", spec_cli_runner(session, t, dm, args.n_gen))
                for t, dm in specs]
    has_llama_cpp = importlib.util.find_spec("llama_cpp") is not None
    if has_llama_cpp and not args.no_llama_cpp:
        eog = set(engine.tokenizer.eog_ids)
        # the lookup worker keeps n_ctx rows of logits (150k floats each for qwen): a context just long enough, with
        # room for a lookup step's drafts past the last token kept (llama-cpp-python would cut them to fit)
        n_ctx = max(map(len, prompts)) + args.n_gen + LOOKUP_DRAFT
        configs.append(Config("llama.cpp", "plain", llama_cpp_runner(model_path, args.threads, n_ctx, args.n_gen, eog,
                                                                     lookup=0)))
        configs.append(Config("llama.cpp", f"prompt lookup ({LOOKUP_DRAFT})", llama_cpp_runner(
            model_path, args.threads, n_ctx, args.n_gen, eog, lookup=LOOKUP_DRAFT)))

    measure(configs, prompts, args.rounds)
    report(configs, args, prompt_set.name, len(prompts), has_llama_cpp)


def report(configs: list[Config], args, set_name: str, n_prompts: int, has_llama_cpp: bool) -> None:
    """The table (speed against spec-cli plain, acceptance), drafter statistics and the machine-readable last line."""
    print(f"\n{args.model} (draft {args.model_draft or '-'}), prompt set {set_name} ({n_prompts} prompts), "
          f"{args.n_gen} tokens greedy, {args.threads} threads, median of {args.rounds} interleaved rounds "
          "(ratios: median of the rounds' own)")
    print(f"{'backend':9s}  {'configuration':38s} {'tok/s':>7s} {'vs spec-cli plain':>18s} {'accept %':>9s}")
    rows = []
    for cfg in configs:
        acc, tok_s, vs_plain = cfg.acceptance(), cfg.tok_s(), cfg.vs(configs[0])
        rows.append({"backend": cfg.backend, "config": cfg.name, "tok_s": tok_s, "vs_plain": vs_plain,
                     "acceptance": acc})
        print(f"{cfg.backend:9s}  {cfg.name:38s} {tok_s:7.2f} {vs_plain:17.3f}x "
              f"{'-' if acc is None else f'{100 * acc:.1f}':>9s}")
    for cfg in configs:
        for st in cfg.drafter_stats().values():
            print(f"{cfg.name:38s} {st.name:12s} mean acc len {st.mean_acc_len:5.2f}, acc rate/pos "
                  f"({', '.join(f'{r:.3f}' for r in st.acc_rate_per_pos[:8])})")
    if args.json:
        print(json.dumps(rows))
    ours = max((c for c in configs if c.backend == "spec-cli"), key=Config.tok_s)
    theirs = [c for c in configs if c.backend == "llama.cpp"]
    if not has_llama_cpp and not args.no_llama_cpp:
        print("llama-cpp-python is not installed: `pip install llama-cpp-python` (builds llama.cpp from source)")
    print(f"spec-cli best / llama.cpp best: {ours.vs(max(theirs, key=Config.tok_s)):.2f}x" if theirs else
          "spec-cli best / llama.cpp best: n/a")


if __name__ == "__main__":
    main()
