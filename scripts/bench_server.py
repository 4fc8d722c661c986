"""Throughput and latency of `spec-cli server` under concurrent clients.

For every (-np, speculation) pair it starts `spec-cli server` as a subprocess on a loopback port, then for every
client count runs that many concurrent clients, each sending --requests greedy `/completion` requests of
exactly -n tokens (ignore_eos, so every configuration generates the same amount). Reported per cell: total
generated tokens per second of wall time, per-request latency (mean and p90), time to first token (mean, from
streamed requests), generation tokens per second (each client's requests' predicted_n over the server's
predicted_ms, summed over the clients, who generate at the same time: the aggregate rate of the slots' generation,
prompt processing left out; only where every client has a slot of its own, else requests wait and do not
overlap) and the pooled draft acceptance. A markdown table goes to stdout and, with --json, one JSON document with
every cell.

  python scripts/bench_server.py -m qwen2.5-coder-0.5b --np 1,4,8 --clients 1,4,8 --spec none,ngram-mod
  python scripts/bench_server.py -m qwen2.5-coder-1.5b --spec none,draft --draft qwen2.5-coder-0.5b
  python scripts/bench_server.py -m qwen2.5-coder-1.5b --np 1,4 --clients 1,4 --spec ngram-mod --set code-edit
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import subprocess
import sys
import time

import httpx

from spec_cli.text.prompt_sets import load_prompt_set

PROMPTS = [
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n",
    "Write a Python function that checks whether a string is a palindrome.\n\n```python\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "# Sort a list of dictionaries by the 'age' key, then by 'name'.\npeople = [\n",
    "import json\n\n\ndef load_config(path):\n    \"\"\"Read a JSON config file and return a dict.\"\"\"\n",
    "SELECT name, COUNT(*) FROM orders\n",
    "fn main() {\n    let numbers = vec![1, 2, 3, 4, 5];\n",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, n_parallel: int, spec: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    flags = [] if spec == "none" else ["--spec-type", spec]
    if spec == "draft":  # the draft model given with --draft
        if not args.draft:
            sys.exit("--spec draft needs --draft MODEL")
        flags = ["-md", args.draft, "--spec-type", "draft-simple"]
    cmd = [sys.executable, "-m", "spec_cli", "server", "-m", args.model, "--port", str(port), "-np", str(n_parallel),
           "-c", str(args.ctx_per_slot * n_parallel), "--metrics", *flags, *args.server_args.split()]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + args.start_timeout
    while True:
        if proc.poll() is not None:
            sys.exit(f"server failed: {' '.join(cmd)}\n{proc.stderr.read()}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            proc.terminate()
            sys.exit("server did not start in time")
        time.sleep(0.5)


async def one_request(client: httpx.AsyncClient, prompt: str | list[dict], n: int) -> dict:
    """A streamed greedy request of raw text (/completion) or chat messages (/v1/chat/completions): latency, time to
    first token and the final timings."""
    t0 = time.perf_counter()
    ttft, final = None, None
    common = {"temperature": 0, "ignore_eos": True, "stream": True, "cache_prompt": False}
    if isinstance(prompt, str):
        route, body = "/completion", {"prompt": prompt, "n_predict": n, **common}
    else:
        route, body = "/v1/chat/completions", {"messages": prompt, "max_tokens": n, **common}
    async with client.stream("POST", route, json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if ttft is None:
                ttft = time.perf_counter() - t0
            if "timings" in obj:
                final = obj
    return {"latency": time.perf_counter() - t0, "ttft": ttft, "timings": final["timings"]}


async def run_cell(url: str, n_parallel: int, n_clients: int, n_requests: int, n: int, prompts: list) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=None) as client:
        async def one_client(i: int) -> list[dict]:  # the client's requests one after another
            return [await one_request(client, prompts[(i + k) % len(prompts)], n) for k in range(n_requests)]

        t0 = time.perf_counter()
        done = await asyncio.gather(*(one_client(i) for i in range(n_clients)))
        wall = time.perf_counter() - t0
    runs = [r for rs in done for r in rs]
    latencies = sorted(r["latency"] for r in runs)
    n_tokens = sum(r["timings"]["predicted_n"] for r in runs)
    drafted = sum(r["timings"].get("draft_n", 0) for r in runs)
    accepted = sum(r["timings"].get("draft_n_accepted", 0) for r in runs)
    gen_rate = None if n_clients > n_parallel else sum(
        1e3 * sum(r["timings"]["predicted_n"] for r in rs) / sum(r["timings"]["predicted_ms"] for r in rs)
        for rs in done)
    return {
        "clients": n_clients, "requests": len(runs), "tokens": n_tokens, "wall_s": round(wall, 3),
        "tok_s": round(n_tokens / wall, 2), "gen_tok_s": None if gen_rate is None else round(gen_rate, 2),
        "latency_mean_s": round(statistics.mean(latencies), 3),
        "latency_p90_s": round(latencies[min(len(latencies) - 1, int(0.9 * len(latencies)))], 3),
        "ttft_mean_s": round(statistics.mean(r["ttft"] for r in runs), 3),
        "acceptance": round(accepted / drafted, 3) if drafted else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--draft", help="draft model for --spec draft")
    ap.add_argument("--np", default="1,4,8", help="comma list of -np values")
    ap.add_argument("--clients", default="1,4,8", help="comma list of concurrent client counts")
    ap.add_argument("--spec", default="none,ngram-mod", help="comma list: none, draft, or a --spec-type (one drafter)")
    ap.add_argument("-n", type=int, default=64, help="tokens per request")
    ap.add_argument("--requests", type=int, default=2, help="requests per client")
    ap.add_argument("--ctx-per-slot", type=int, default=1024)
    ap.add_argument("--server-args", default="", help="extra flags for spec-cli server, e.g. '-dev cuda'")
    ap.add_argument("--start-timeout", type=float, default=300)
    ap.add_argument("--set", help="a built-in prompt set or .jsonl file instead of the built-in completions (chat "
                                  "messages go to /v1/chat/completions)")
    ap.add_argument("--json", help="write every cell to this file")
    args = ap.parse_args()
    prompts = [p.messages or p.text for p in load_prompt_set(args.set).prompts] if args.set else PROMPTS
    cells = []
    print("| -np | spec | clients | requests | tokens | tok/s | gen tok/s | latency mean s | latency p90 s | TTFT s "
          "| accept |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for spec in args.spec.split(","):
        for n_parallel in (int(x) for x in args.np.split(",")):
            proc, url = start_server(args, n_parallel, spec)
            try:
                asyncio.run(run_cell(url, n_parallel, 1, 1, 8, prompts))  # warm-up
                for n_clients in (int(x) for x in args.clients.split(",")):
                    result = asyncio.run(run_cell(url, n_parallel, n_clients, args.requests, args.n, prompts))
                    cell = {"np": n_parallel, "spec": spec, **result}
                    cells.append(cell)
                    acc = "" if cell["acceptance"] is None else f"{cell['acceptance']:.3f}"
                    gen = "-" if cell["gen_tok_s"] is None else f"{cell['gen_tok_s']:.2f}"
                    print(f"| {n_parallel} | {spec} | {n_clients} | {cell['requests']} | {cell['tokens']} | "
                          f"{cell['tok_s']:.2f} | {gen} | {cell['latency_mean_s']:.2f} | "
                          f"{cell['latency_p90_s']:.2f} | {cell['ttft_mean_s']:.2f} | {acc} |", flush=True)
            finally:
                proc.terminate()
                proc.wait(timeout=60)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "draft": args.draft, "n": args.n, "cells": cells}, f, indent=1)


if __name__ == "__main__":
    main()
