"""llama.cpp (llama-cpp-python) greedy generation in a process of its own, for scripts/compare_peers.py.

In the process that runs spec-cli, llama.cpp ran 30-40 % slower on the small models (qwen2.5-coder-0.5b 29 instead of
42 tok/s with 2 threads): torch's OpenMP runtime beside ggml's, and spec-cli's OMP_WAIT_POLICY=PASSIVE, which makes
ggml's OpenMP threads sleep between graphs. Here it gets OpenMP's defaults and no torch.

    python scripts/llama_cpp_worker.py MODEL N_CTX THREADS N_GEN LOOKUP EOG_IDS(comma list)

LOOKUP: tokens prompt-lookup decoding drafts per step, 0 = plain decoding.
stdin: one JSON list of prompt token ids per line; stdout: one JSON object {"n_tokens", "seconds"} per prompt
(tokens after the first one, and the time from the first one to the last).
"""

import json
import sys
import time

from llama_cpp import Llama
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding


def main() -> None:
    model, n_ctx, threads, n_gen, lookup, eog = sys.argv[1:7]
    threads, n_gen, lookup = int(threads), int(n_gen), int(lookup)
    eog_ids = {int(t) for t in eog.split(",") if t}
    draft = LlamaPromptLookupDecoding(num_pred_tokens=lookup) if lookup else None
    # with a draft model llama-cpp-python keeps every position's logits but sizes that buffer for n_batch rows
    # unless logits_all is asked for: a prompt plus its generation past 512 tokens failed ("could not broadcast")
    llm = Llama(model_path=model, n_ctx=int(n_ctx), n_threads=threads, n_threads_batch=threads, verbose=False,
                draft_model=draft, logits_all=draft is not None)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        prompt = json.loads(line)
        llm.reset()
        n, t0 = 0, 0.0
        for tok in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
            if tok in eog_ids:
                break
            n += 1
            if n == 1:
                t0 = time.perf_counter()
            if n >= n_gen:
                break
        print(json.dumps({"n_tokens": n - 1, "seconds": time.perf_counter() - t0}), flush=True)


if __name__ == "__main__":
    main()
