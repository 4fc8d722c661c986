"""A prompt set as an agent loop sends it: one chat request after another through one server per speculation
setting, the servers side by side so that every request goes to each of them in turn (paired, on the same machine
state). Reported per setting: generation tokens per second from the server's own timings (prompt time left out;
sum of predicted_n over sum of predicted_ms), its ratio to plain decoding and to --ref, the acceptance, and whether
every answer equals plain decoding's (greedy speculation is lossless). Each pass starts fresh servers (cold drafter
state, as a new process); within a pass, earlier answers are what `suffix` drafts later ones from.

  python scripts/bench_agentic.py -m qwen2.5-coder-1.5b --spec none,ngram-cache,suffix --passes 2
"""

from __future__ import annotations

import argparse
import json
import sys

import httpx
from bench_server import start_server

from spec_cli.text.prompt_sets import load_prompt_set


def chat(url: str, messages: list[dict], n: int) -> dict:
    body = {"messages": messages, "max_tokens": n, "temperature": 0}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=None)
    r.raise_for_status()
    obj = r.json()
    return {"text": obj["choices"][0]["message"]["content"], **obj["timings"]}


def one_pass(args, specs: list[str], prompts) -> dict[str, list[dict]]:
    """Every prompt to every setting's server (the order of settings turning by one per prompt)."""
    servers = {spec: start_server(args, 1, spec) for spec in specs}
    answers: dict[str, list[dict]] = {spec: [] for spec in specs}
    try:
        for i, prompt in enumerate(prompts):
            for spec in specs[i % len(specs):] + specs[: i % len(specs)]:
                answers[spec].append(chat(servers[spec][1], prompt.messages, args.n))
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait()
    return answers


def summary(answers: dict[str, list[dict]], ref: str | None) -> list[dict]:
    plain = answers.get("none")
    rows = []
    for spec, runs in answers.items():
        n, ms = sum(r["predicted_n"] for r in runs), sum(r["predicted_ms"] for r in runs)
        drafted = sum(r.get("draft_n", 0) for r in runs)
        accepted = sum(r.get("draft_n_accepted", 0) for r in runs)
        same = None if plain is None else [r["text"] for r in runs] == [r["text"] for r in plain]
        rows.append({"spec": spec, "tokens": n, "gen_ms": round(ms, 1), "tok_s": round(1000 * n / ms, 2),
                     "acceptance": round(accepted / drafted, 3) if drafted else None, "same_as_plain": same})
    by_spec = {r["spec"]: r for r in rows}
    for r in rows:
        r["vs_plain"] = round(r["tok_s"] / by_spec["none"]["tok_s"], 3) if "none" in by_spec else None
        r["vs_ref"] = round(r["tok_s"] / by_spec[ref]["tok_s"], 3) if ref in by_spec else None
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--spec", default="none,ngram-cache,suffix", help="comma list: none, draft, or a --spec-type each")
    ap.add_argument("--ref", default="ngram-cache", help="the setting vs_ref divides by")
    ap.add_argument("--set", default="agentic", help="a built-in prompt set or a .jsonl file")
    ap.add_argument("-n", type=int, default=256, help="max tokens per answer")
    ap.add_argument("--passes", type=int, default=1, help="passes over the set, each on fresh servers")
    ap.add_argument("--ctx-per-slot", type=int, default=4096)
    ap.add_argument("--server-args", default="", help="extra flags for spec-cli server, e.g. '-t 2 --draft-max 8'")
    ap.add_argument("--start-timeout", type=float, default=600)
    ap.add_argument("--draft", help="draft model for --spec draft")
    ap.add_argument("--json", help="write the per-pass summaries to this file")
    args = ap.parse_args()
    specs, prompts = args.spec.split(","), load_prompt_set(args.set).prompts
    passes = []
    print("| pass | spec | tokens | gen tok/s | vs plain | vs " + args.ref + " | acceptance | same as plain |")
    print("|---:|---|---:|---:|---:|---:|---:|---|")
    for k in range(args.passes):
        rows = summary(one_pass(args, specs, prompts), args.ref)
        passes.append(rows)
        for r in rows:
            print(f"| {k + 1} | {r['spec']} | {r['tokens']} | {r['tok_s']} | {r['vs_plain']} | {r['vs_ref']} | "
                  f"{r['acceptance']} | {r['same_as_plain']} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(passes, f, indent=2)
    if any(r["same_as_plain"] is False for rows in passes for r in rows):
        sys.exit("an answer differed from plain decoding's")


if __name__ == "__main__":
    main()
