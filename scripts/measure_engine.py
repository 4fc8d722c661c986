"""Engine speed on this machine, per weight path (--dtype): load time, plain greedy generation and the verify-cost curve.

For each model and each dtype path (f32 = dequantized float32 weights, q = quantized kernels of qlinear.py, ...):
  load    `load_model` wall time (ms) in a fresh process (as a command sees it; the file is in the page cache
          after the first), median over --load-reps processes
  tg      tokens/s generating --n-gen tokens greedily after a short code prompt (ignore_eos), median over --reps
  verify  (--verify-models only) one target forward of k rows with logits, at depth --depth, for k = 1..16 (the
          verify batch of a speculative step: id_last + k - 1 drafts); median ns per k and cost(k) / cost(1)
Alternatives are interleaved in one process (f32, q, f32, q, ...) so that the load of a shared machine hits them
alike; the load average is printed with the results because absolute figures move with it. Ratios are the
figures to compare. A table goes to stdout, and one JSON document with every sample to --json.

  python scripts/measure_engine.py                                  # four models, f32 and q, 2 threads
  python scripts/measure_engine.py --models qwen2.5-coder-1.5b --dtypes q --reps 5 --json out.json
"""

from __future__ import annotations

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

import spec_cli  # noqa: F401  (first: sets the OpenMP wait policy before torch loads)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from spec_cli.bench.verify_cost import break_even_acceptance  # noqa: E402
from spec_cli.model.batch import Batch  # noqa: E402
from spec_cli.model.sampling import SamplingParams  # noqa: E402
from spec_cli.runtime.engine import EngineOptions  # noqa: E402
from spec_cli.runtime.generate import generate  # noqa: E402
from spec_cli.runtime.session import Session, open_session  # noqa: E402
from spec_cli.speculative.verify_costs import time_forwards  # noqa: E402

MODELS = ["smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"]
# llama.cpp on this machine kind, 2 threads, tg128 tokens/s: (llama-bench, llama-cpp-python)
LLAMA_CPP_TG = {"smollm2-135m": (138, 75), "gemma3-270m": (68, 47), "qwen2.5-coder-0.5b": (44, 28),
                "qwen2.5-coder-1.5b": (18.8, 15)}
PROMPT = "def quicksort(items):\n    \"\"\"Sort a list of numbers.\"\"\"\n"
REPORT_K = (1, 2, 4, 8, 16)


def load(model: str, dtype: str, threads: int, n_ctx: int):
    return open_session(EngineOptions(model=model, dtype=dtype, device="cpu", threads=threads, n_ctx=n_ctx))


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
    sessions = {d: load(model, d, args.threads, max(args.depth + 32, 512)) for d in dtypes}
    tps: dict[str, list[float]] = {d: [] for d in dtypes}
    for d in dtypes:
        generation_tps(sessions[d], 8)  # warm-up
    for _ in range(args.reps):
        for d in dtypes:
            tps[d].append(generation_tps(sessions[d], args.n_gen))
    result = {"model": model, "dtypes": {}}
    verify: dict[str, dict[int, list[int]]] = {}
    if model in args.verify_models:
        rng = random.Random(1)
        for d in dtypes:
            prefill(sessions[d], args.depth)
            verify[d] = {k: [] for k in range(1, args.k_max + 1)}
            time_forwards(sessions[d].engine.ctx, 0, range(1, args.k_max + 1), 1, rng, lambda: None)  # warm-up
        for _ in range(args.reps):
            for d in dtypes:
                for k, ns in time_forwards(sessions[d].engine.ctx, 0, range(1, args.k_max + 1), 1, rng, lambda: None).items():
                    verify[d][k] += ns
    for d in dtypes:
        entry = {"load_ms": loads[d], "load_ms_median": statistics.median(loads[d]), "tg_tps": tps[d],
                 "tg_tps_median": statistics.median(tps[d])}
        if d in verify:
            med = {k: statistics.median(v) for k, v in verify[d].items()}
            entry["verify_ns"] = verify[d]
            entry["verify_curve"] = [{"k": k, "median_ms": med[k] / 1e6, "cost_ratio": med[k] / med[1],
                                      "break_even_acc": break_even_acceptance(med[k] / med[1], k)} for k in med]
        result["dtypes"][d] = entry
    sessions.clear()
    gc.collect()
    return result


def print_tables(results: list[dict], args) -> None:
    print(f"\nthreads {args.threads}, {args.n_gen} tokens greedy, medians of {args.reps} (load: {args.load_reps})")
    print("| model | dtype | load ms | tg tok/s | llama-bench | llama-cpp-python | tg vs f32 |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in results:
        base = r["dtypes"].get("f32", {}).get("tg_tps_median")
        for d, e in r["dtypes"].items():
            bench, py = LLAMA_CPP_TG.get(r["model"], ("-", "-"))
            vs = f"{e['tg_tps_median'] / base:.2f}x" if base else "-"
            print(f"| {r['model']} | {d} | {e['load_ms_median']:.0f} | {e['tg_tps_median']:.1f} | {bench} | {py} | {vs} |")
    curves = [(r["model"], d, e) for r in results for d, e in r["dtypes"].items() if "verify_curve" in e]
    if curves:
        print(f"\nverify cost at depth {args.depth}: median ms of one forward of k rows, and cost(k)/cost(1)")
        print("| model | dtype | " + " | ".join(f"k={k}" for k in REPORT_K) + " | " +
              " | ".join(f"r{k}" for k in REPORT_K if k > 1) + " |")
        print("|---|---|" + "---:|" * (2 * len(REPORT_K) - 1))
        for model, d, e in curves:
            by_k = {c["k"]: c for c in e["verify_curve"]}
            ks = [k for k in REPORT_K if k in by_k]
            print(f"| {model} | {d} | " + " | ".join(f"{by_k[k]['median_ms']:.1f}" for k in ks) + " | " +
                  " | ".join(f"{by_k[k]['cost_ratio']:.2f}" for k in ks if k > 1) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated names or paths")
    ap.add_argument("--dtypes", default="f32,q", help="comma-separated --dtype values, interleaved")
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
