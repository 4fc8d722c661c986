"""A real model behind the real server (-np 4): the same greedy request gives the same tokens however it is
served, because the CPU kernels make a sequence's logits independent of the batch (tests/test_batch_invariance.py):

- alone, without prompt cache or speculation (the reference);
- concurrently with 3 other, different requests (their rows in the same decodes as its rows), each of which
  also gets its own alone answer;
- with its prompt partly served from a slot's cache (the rest prefilled as a shorter batch), then almost wholly
  (only the last prompt token decoded), then with cache_prompt false again;
- with n-gram speculation (k-row verify batches, rejected drafts rolled back).
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from spec_cli.server import ServerSettings
from tests.real_models import real_model
from tests.server_harness import LiveServer, make_session, parse_metrics

pytestmark = pytest.mark.real_model

MODEL = "smollm2-135m"
N = 32  # tokens per answer
# smollm2 continues the pattern (div, pow, ...), so n-gram drafts are often accepted
PROMPT = ("def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
          "def mul(a, b):\n    return a * b\n\ndef")
OTHERS = [
    "The capital of France is",
    "Here is a list of fruits: apple, banana,",
    "import numpy as np\n\nx = np.arange(10)\n",
]


@pytest.fixture(scope="module")
def srv():
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    # n-gram speculation loaded, but off unless a request asks for it
    session = make_session(real_model(MODEL), n_seq=4, spec_types="ngram-simple")
    try:
        with LiveServer(session, ServerSettings(metrics=True)) as s:
            yield s
    finally:
        torch.set_num_threads(old)


@pytest.fixture(scope="module")
def http(srv):
    with httpx.Client(base_url=srv.url, timeout=120) as client:
        yield client


def complete(http: httpx.Client, prompt: str, **fields) -> dict:
    body = {"prompt": prompt, "n_predict": N, "temperature": 0.0, "return_tokens": True, "cache_prompt": False,
            "speculative": False, **fields}
    r = http.post("/completion", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def metrics(http: httpx.Client) -> dict[str, float]:
    return parse_metrics(http.get("/metrics").text)


def test_greedy_answer_is_the_same_however_it_is_served(http):
    alone = complete(http, PROMPT)
    tokens, text = alone["tokens"], alone["content"]
    n_prompt = alone["tokens_evaluated"]
    assert len(tokens) == N and alone["timings"]["cache_n"] == 0
    others_alone = [complete(http, p)["tokens"] for p in OTHERS]

    # concurrently with 3 other requests: all four start together and share the decodes
    before = metrics(http)
    start = threading.Barrier(4)

    def send(prompt: str) -> dict:
        start.wait()
        return complete(http, prompt, n_predict=N + 16 if prompt != PROMPT else N)

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(send, [OTHERS[0], PROMPT, OTHERS[1], OTHERS[2]]))
    after = metrics(http)
    mine, others = results[1], [results[0], results[2], results[3]]
    assert mine["tokens"] == tokens and mine["content"] == text, "answer changed beside 3 other requests"
    for prompt, got, want in zip(OTHERS, others, others_alone):
        assert got["tokens"][:N] == want, f"{prompt!r}: answer changed beside the other requests"
    n_tokens = after["llamacpp:tokens_predicted_total"] - before["llamacpp:tokens_predicted_total"]
    n_decodes = after["llamacpp:n_decode_total"] - before["llamacpp:n_decode_total"]
    assert n_tokens / n_decodes > 1.5, f"the requests did not overlap: {n_tokens} tokens in {n_decodes} decodes"

    # the prompt cache: a slot holding a prompt that shares a prefix with PROMPT, then PROMPT twice
    complete(http, PROMPT[: PROMPT.index("def sub")] + "def neg(a):\n", n_predict=4, id_slot=0, cache_prompt=True)
    partly = complete(http, PROMPT, id_slot=0, cache_prompt=True)
    assert 0 < partly["timings"]["cache_n"] < n_prompt - 1
    assert partly["tokens"] == tokens, f"answer changed with {partly['timings']['cache_n']} prompt tokens cached"
    again = complete(http, PROMPT, id_slot=0, cache_prompt=True)
    assert again["timings"]["cache_n"] == n_prompt - 1 and again["timings"]["prompt_n"] == 1
    assert again["tokens"] == tokens, "answer changed with the whole prompt but its last token cached"
    uncached = complete(http, PROMPT, id_slot=0, cache_prompt=False)
    assert uncached["timings"]["cache_n"] == 0 and uncached["tokens"] == tokens

    # n-gram speculation: the same tokens through k-row verify batches
    spec = complete(http, PROMPT, speculative=True)
    assert spec["timings"].get("draft_n_accepted", 0) > 0, f"no accepted drafts: {spec['timings']}"
    assert spec["tokens"] == tokens, (f"answer changed with speculation ({spec['timings']['draft_n']} drafted, "
                                      f"{spec['timings'].get('draft_n_accepted')} accepted)")
