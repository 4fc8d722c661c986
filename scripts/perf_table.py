"""The README's performance table: spec-cli against llama.cpp, plain and best against best, for qwen2.5-coder-1.5b and
0.5b on code edits and free writing at 1 and 2 threads, one `scripts/compare_peers.py` run per cell (each a fresh
process, its configurations interleaved per prompt). Prints the markdown table, then each cell's best configuration.

    python scripts/perf_table.py --rounds 2
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

COMPARE = Path(__file__).with_name("compare_peers.py")
SETS = ("code-edit", "writing")
THREADS = (2, 1)
NGRAM_SPECS = ("ngram-simple:auto", "ngram-mod:auto", "ngram-cache:auto")
# target -> (draft model, the spec-cli configurations run against plain)
MODELS = {
    "qwen2.5-coder-1.5b": ("qwen2.5-coder-0.5b", NGRAM_SPECS + ("draft-simple:auto", "ngram-mod,draft-simple:auto")),
    "qwen2.5-coder-0.5b": ("", NGRAM_SPECS),
}
BEST = re.compile(r"spec-cli best / llama\.cpp best: ([0-9.]+)x")


def run_cell(model: str, prompts: str, threads: int, args) -> dict:
    """One compare_peers run: spec-cli plain against llama.cpp plain, best against best, and which was best."""
    draft, specs = MODELS[model]
    cmd = [sys.executable, str(COMPARE), "-m", model, "-md", draft, "--prompts", prompts, "--n-prompts",
           str(args.n_prompts), "-n", str(args.n_gen), "-t", str(threads), "--rounds", str(args.rounds), "--json"]
    for spec in specs:
        cmd += ["--spec", spec]
    print("$", " ".join(cmd[1:]), file=sys.stderr, flush=True)
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    lines = out.splitlines()
    rows = json.loads(next(line for line in lines if line.startswith("[{")))
    best = BEST.search(lines[-1])
    if best is None:
        raise SystemExit(f"no llama.cpp figures in the {model} {prompts} -t {threads} run: is llama-cpp-python "
                         "installed?")
    llama_plain = next(r for r in rows if r["backend"] == "llama.cpp" and r["config"] == "plain")
    ours = max((r for r in rows if r["backend"] == "spec-cli"), key=lambda r: r["tok_s"])
    return {"plain": 1 / llama_plain["vs_plain"], "best": float(best.group(1)), "best_config": ours["config"],
            "best_vs_plain": ours["vs_plain"], "plain_tok_s": rows[0]["tok_s"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--n-prompts", type=int, default=4)
    ap.add_argument("-n", "--n-gen", type=int, default=128)
    args = ap.parse_args()
    cells = {(m, s, t): run_cell(m, s, t, args) for m in MODELS for t in THREADS for s in SETS}
    head = " | ".join(f"{s}: {what}" for s in SETS for what in ("plain", "best / best"))
    print(f"| x llama.cpp | {head} |")
    print("|---|" + "---:|" * 2 * len(SETS))
    for m in MODELS:
        for t in THREADS:
            cols = " | ".join(f"{cells[m, s, t]['plain']:.2f}x | **{cells[m, s, t]['best']:.2f}x**" for s in SETS)
            print(f"| {m}, {t} thread{'s' if t > 1 else ''} | {cols} |")
    print()
    for (m, s, t), cell in cells.items():
        print(f"{m} {s} -t {t}: plain {cell['plain_tok_s']:.2f} tok/s; best {cell['best_config']} "
              f"({cell['best_vs_plain']:.2f}x of plain)")


if __name__ == "__main__":
    main()
