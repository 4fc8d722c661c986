"""Engine speed on this machine, per weight path (--dtype) and --compile: load time, plain greedy generation and the
verify-cost curve.

For each model and each configuration (a dtype path: f32 = dequantized float32 weights, q = quantized kernels of
qlinear.py, ...; under each --compile value of --compile, `off` alone by default):
  load    `load_model` wall time (ms) in a fresh process (as a command sees it; the file is in the page cache
          after the first), median over --load-reps processes
  tg      tokens/s generating --n-gen tokens greedily after a short code prompt (ignore_eos), median over --reps;
          the time spent compiling (in the warm-up; any later compile too) is left out and shown as `compile s`
  verify  (--verify-models only) one target forward of k rows with logits, at depth --depth, for k = 1..16 (the
          verify batch of a speculative step: id_last + k - 1 drafts); median ns per k and cost(k) / cost(1)
Alternatives are interleaved in one process (f32, q, f32, q, ...) so that the load of a shared machine hits them
alike; the load average is printed with the results because absolute figures move with it. Ratios are the
figures to compare: `tg vs f32`, and with --compile off,on `compiled / eager` (each dtype's --compile on against its
off), both medians of the ratios within a round. A table goes to stdout, and one JSON document with every sample to --json.

  python scripts/measure_engine.py                                  # four models, f32 and q, 2 threads
  python scripts/measure_engine.py --models qwen2.5-coder-1.5b --dtypes q --reps 5 --json out.json
  python scripts/measure_engine.py --models smollm2-135m --dtypes q,f32 --compile off,on --verify-models "" \
      --load-reps 1 --n-gen 64 --reps 5                             # compiled against eager, per path
"""

from __future__ import annotations

import spec_cli  # noqa: F401  (first: sets the OpenMP wait policy before torch loads)

# isort: split

import argparse
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from spec_cli.bench.verify_cost import break_even_acceptance
from spec_cli.model.batch import Batch
from spec_cli.model.sampling import SamplingParams
from spec_cli.runtime.engine import EngineOptions
from spec_cli.runtime.generate import generate
from spec_cli.runtime.session import Session, open_session
from spec_cli.speculative.verify_costs import time_forwards

MODELS = ["smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"]
# llama.cpp on this machine kind, 2 threads, tg128 tokens/s: (llama-bench, llama-cpp-python)
LLAMA_CPP_TG = {"smollm2-135m": (138, 75), "gemma3-270m": (68, 47), "qwen2.5-coder-0.5b": (44, 28),
                "qwen2.5-coder-1.5b": (18.8, 15)}
PROMPT = "def quicksort(items):\n    \"\"\"Sort a list of numbers.\"\"\"\n"
REPORT_K = (1, 2, 4, 8, 16)


def load(model: str, dtype: str, compile: str, threads: int, n_ctx: int):
    return open_session(EngineOptions(model=model, dtype=dtype, compile=compile, device="cpu", threads=threads,
                                      n_ctx=n_ctx))


def config_name(dtype: str, compile: str, args) -> str:
    """The configuration's key in the table and the JSON: the dtype, with its --compile value when several run."""
    return dtype if args.compile == ["off"] else f"{dtype} --compile {compile}"


def load_ms_fresh_process(model: str, dtype: str, threads: int) -> float:
    code = ("import sys, torch; torch.set_num_threads(int(sys.argv[3])); from spec_cli.runtime.engine import resolve; "
            "from spec_cli.model.loader import load_model; "
            "print(load_model(resolve(sys.argv[1]), device='cpu', dtype=sys.argv[2]).load_ms)")
    out = subprocess.run([sys.executable, "-c", code, model, dtype, str(threads)], capture_output=True, text=True,
                         check=True, cwd=Path(__file__).resolve().parents[1])
    return float(out.stdout.split()[-1])


def generation_tps(session: Session, n_gen: int) -> float:
    session.reset()
    gen = session.generator()
    prompt = session.engine.tokenizer.encode(PROMPT, add_special=True, parse_special=False)
    generate(gen, prompt, SamplingParams(temp=0.0, ignore_eos=True), n_gen)
    return gen.timings.n_gen / (gen.timings.t_gen_ms / 1000)


def prefill(session: Session, depth: int) -> None:
    session.reset()
    ctx = session.engine.ctx
    rng = random.Random(0)
    batch = Batch()
    for i in range(depth):
        batch.add(rng.randrange(ctx.config.n_vocab), i, 0, i == depth - 1)
    ctx.decode(batch)


def measure_model(model: str, args) -> dict:
    dtypes = args.dtypes
    loads: dict[str, list[float]] = {d: [] for d in dtypes}
    for _ in range(args.load_reps):
        for d in dtypes:
            loads[d].append(load_ms_fresh_process(model, d, args.threads))
    configs = {config_name(d, c, args): (d, c) for d in dtypes for c in args.compile}
    sessions = {name: load(model, d, c, args.threads, max(args.depth + 32, 512)) for name, (d, c) in configs.items()}
    tps: dict[str, list[float]] = {name: [] for name in configs}
    for name in configs:
        generation_tps(sessions[name], 8)  # warm-up: the compiles of --compile on happen here
    for _ in range(args.reps):
        for name in configs:
            tps[name].append(generation_tps(sessions[name], args.n_gen))
    verify = verify_samples(sessions, args) if model in args.verify_models else {}
    result = {"model": model, "dtypes": {}}
    for name, (d, c) in configs.items():
        entry = {"dtype": d, "compile": c, "load_ms": loads[d], "load_ms_median": statistics.median(loads[d]),
                 "tg_tps": tps[name], "tg_tps_median": statistics.median(tps[name]),
                 "compile_s": sum(ctx.step.stats.seconds for ctx in sessions[name].engine.contexts if ctx.step)}
        if name in verify:
            med = {k: statistics.median(v) for k, v in verify[name].items()}
            entry["verify_ns"] = verify[name]
            entry["verify_curve"] = [{"k": k, "median_ms": med[k] / 1e6, "cost_ratio": med[k] / med[1],
                                      "break_even_acc": break_even_acceptance(med[k] / med[1], k)} for k in med]
        result["dtypes"][name] = entry
    sessions.clear()
    gc.collect()
    return result


def verify_samples(sessions: dict[str, Session], args) -> dict[str, dict[int, list[int]]]:
    """ns of one forward of k rows at --depth, per configuration and k, over --reps interleaved rounds."""
    rng = random.Random(1)
    verify: dict[str, dict[int, list[int]]] = {}
    for name, session in sessions.items():
        prefill(session, args.depth)
        verify[name] = {k: [] for k in range(1, args.k_max + 1)}
        time_forwards(session.engine.ctx, 0, range(1, args.k_max + 1), 1, rng, lambda: None)  # warm-up
    for _ in range(args.reps):
        for name, session in sessions.items():
            for k, ns in time_forwards(session.engine.ctx, 0, range(1, args.k_max + 1), 1, rng, lambda: None).items():
                verify[name][k] += ns
    return verify


def print_tables(results: list[dict], args) -> None:
    print(f"\nthreads {args.threads}, {args.n_gen} tokens greedy, medians of {args.reps} (load: {args.load_reps})")
    print("| model | dtype | compile | load ms | tg tok/s | llama-bench | llama-cpp-python | tg vs f32 "
          "| compiled / eager | compile s |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        by_config = {(e["dtype"], e["compile"]): e for e in r["dtypes"].values()}
        for (d, c), e in by_config.items():
            bench, py = LLAMA_CPP_TG.get(r["model"], ("-", "-"))
            vs_f32, vs_eager = (ratio(e, by_config.get(base)) for base in (("f32", c), (d, "off")))
            print(f"| {r['model']} | {d} | {c} | {e['load_ms_median']:.0f} | {e['tg_tps_median']:.1f} | {bench} | {py} "
                  f"| {vs_f32} | {vs_eager if c != 'off' else '-'} | {e['compile_s']:.1f} |")
    curves = [(r["model"], name, e) for r in results for name, e in r["dtypes"].items() if "verify_curve" in e]
    if curves:
        print(f"\nverify cost at depth {args.depth}: median ms of one forward of k rows, and cost(k)/cost(1)")
        print("| model | dtype | " + " | ".join(f"k={k}" for k in REPORT_K) + " | " +
              " | ".join(f"r{k}" for k in REPORT_K if k > 1) + " |")
        print("|---|---|" + "---:|" * (2 * len(REPORT_K) - 1))
        for model, name, e in curves:
            by_k = {c["k"]: c for c in e["verify_curve"]}
            ks = [k for k in REPORT_K if k in by_k]
            print(f"| {model} | {name} | " + " | ".join(f"{by_k[k]['median_ms']:.1f}" for k in ks) + " | " +
                  " | ".join(f"{by_k[k]['cost_ratio']:.2f}" for k in ks if k > 1) + " |")


def ratio(entry: dict, base: dict | None) -> str:
    """entry's tg speed over base's: the median of the rounds' ratios (each round runs every configuration once, so
    a round's pair saw about the same load), or '-' without a base."""
    if base is None:
        return "-"
    return f"{statistics.median(a / b for a, b in zip(entry['tg_tps'], base['tg_tps'])):.2f}x"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated names or paths")
    ap.add_argument("--dtypes", default="f32,q", help="comma-separated --dtype values, interleaved")
    ap.add_argument("--compile", default="off", help="comma-separated --compile values, each under every dtype, "
                    "interleaved (off,on: compiled / eager per dtype)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-gen", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--load-reps", type=int, default=3)
    ap.add_argument("--verify-models", default="qwen2.5-coder-0.5b,qwen2.5-coder-1.5b")
    ap.add_argument("--depth", type=int, default=256, help="cache cells before the verify rows")
    ap.add_argument("--k-max", type=int, default=16)
    ap.add_argument("--json", type=Path, help="write every sample here")
    args = ap.parse_args()
    args.dtypes = args.dtypes.split(",")
    args.compile = args.compile.split(",")
    args.verify_models = set(args.verify_models.split(",")) if args.verify_models else set()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    results = []
    for model in args.models.split(","):
        results.append(measure_model(model, args))
        print(f"{model}: done ({time.strftime('%H:%M:%S')}, load average {os.getloadavg()[0]:.1f})", file=sys.stderr)
    doc = {"threads": args.threads, "n_gen": args.n_gen, "reps": args.reps, "depth": args.depth,
           "load_average_before": load_before, "load_average_after": os.getloadavg(), "torch": torch.__version__,
           "cpu_capability": torch.backends.cpu.get_cpu_capability(), "llama_cpp_tg": LLAMA_CPP_TG,
           "results": results}
    print_tables(results, args)
    print(f"\nload average (1, 5, 15 min): before {load_before}, after {doc['load_average_after']}")
    if args.threads > 1 and load_before[0] > 0.5:
        print(f"note: other processes are running on these {os.cpu_count()} cores; a torch kernel split over "
              f"{args.threads} threads then waits at its barrier for a descheduled thread (a time slice per call), "
              "so compare with --threads 1 on a busy machine")
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1))
        print(f"JSON: {args.json}")


if __name__ == "__main__":
    main()
