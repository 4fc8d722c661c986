"""The server under load and faults: 16 concurrent streaming clients on -np 4 slots (continuous batching, one
target decode per step for all slots) each get exactly the single-request greedy output for their own prompt,
with and without speculation; per-request speculation overrides take effect and are echoed; queued requests
are served in arrival order; a client that disconnects (streaming or not) frees its slot at once."""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import ExitStack

import httpx
import openai
import pytest

from spec_cli.server import ServerSettings
from tests.server_harness import PROMPTS, LiveServer, greedy_reference, make_session, parse_metrics

N = 24  # tokens per answer
CLIENTS, REQUESTS = 16, 2
CONFIGS = {
    "plain": dict(),
    "ngram-simple": dict(spec_types="ngram-simple"),
    "suffix": dict(spec_types="suffix"),  # one drafter, its earlier outputs shared by the 4 slots
    "draft-simple": dict(spec_types="draft-simple", draft="same vocabulary"),
    "draft-simple, another vocabulary": dict(spec_types="draft-simple", draft="another vocabulary"),
}


@pytest.fixture(scope="module")
def ref(tiny_model_path):
    return greedy_reference(tiny_model_path, PROMPTS, N)


@pytest.fixture(scope="module")
def servers(tiny_model_path, tiny_draft_path, tiny_other_vocab_path):
    """Starts each -np 4 configuration on first use."""
    stack = ExitStack()
    started: dict[str, LiveServer] = {}
    drafts = {"same vocabulary": tiny_draft_path, "another vocabulary": tiny_other_vocab_path}

    def get(name: str) -> LiveServer:
        if name not in started:
            cfg = dict(CONFIGS[name])
            draft = drafts.get(cfg.pop("draft", None))
            session = make_session(tiny_model_path, n_seq=4, draft=draft, **cfg)
            started[name] = stack.enter_context(LiveServer(session, ServerSettings(metrics=True, slots=True)))
        return started[name]

    with stack:
        yield get


async def one_client(url: str, i: int, ref: dict, tok) -> list[bool]:
    """REQUESTS streaming requests in a row; even clients use the openai client, odd ones httpx on /completion."""
    results = []
    oai = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        for r in range(REQUESTS):
            prompt = PROMPTS[(i + 3 * r) % len(PROMPTS)]
            if i % 2 == 0:
                stream = await oai.completions.create(model="m", prompt=prompt, max_tokens=N, temperature=0,
                                                      stream=True)
                text = "".join([c.choices[0].text async for c in stream if c.choices])
                results.append(text == tok.decode(ref[prompt], special=False))
            else:
                tokens = []
                body = {"prompt": prompt, "n_predict": N, "temperature": 0, "stream": True, "return_tokens": True}
                async with http.stream("POST", "/completion", json=body) as resp:
                    async for line in resp.aiter_lines():
                        if line.startswith("data: "):
                            tokens.extend(json.loads(line[6:])["tokens"])
                results.append(tokens == ref[prompt])
    await oai.close()
    return results


@pytest.mark.parametrize("config", list(CONFIGS))
def test_concurrent_streaming_clients_get_their_own_greedy_output(servers, ref, config):
    srv = servers(config)
    tok = srv.session.engine.tokenizer
    before = parse_metrics(httpx.get(srv.url + "/metrics").text)

    async def main():
        return await asyncio.wait_for(
            asyncio.gather(*(one_client(srv.url, i, ref, tok) for i in range(CLIENTS))), timeout=240)

    t0 = time.perf_counter()
    results = asyncio.run(main())
    elapsed = time.perf_counter() - t0
    assert [len(r) for r in results] == [REQUESTS] * CLIENTS  # every response arrived
    assert all(all(r) for r in results), results  # each equals its own prompt's single-request greedy output
    m = parse_metrics(httpx.get(srv.url + "/metrics").text)
    n_tokens = m["llamacpp:tokens_predicted_total"] - before["llamacpp:tokens_predicted_total"]
    assert n_tokens == sum(len(ref[PROMPTS[(i + 3 * r) % len(PROMPTS)]]) for i in range(CLIENTS)
                           for r in range(REQUESTS))
    assert m["llamacpp:n_busy_slots_per_decode"] > 1.5  # the slots really decoded together
    assert m["llamacpp:requests_processing"] == 0 and m["llamacpp:requests_deferred"] == 0
    print(f"\n{config}: {CLIENTS * REQUESTS} requests, {n_tokens:.0f} tokens in {elapsed:.2f} s "
          f"= {n_tokens / elapsed:.0f} tok/s on -np 4")
    drafted = m["llamacpp:spec_decode_num_draft_tokens_total"]
    accepted = m["llamacpp:spec_decode_num_accepted_tokens_total"]
    per_pos = [v for k, v in m.items() if k.startswith("llamacpp:spec_decode_num_accepted_tokens_per_pos_total{")]
    assert sum(per_pos) == accepted and accepted <= drafted
    if config == "plain":
        assert drafted == 0
    else:
        assert accepted > 0 and m["llamacpp:spec_decode_num_drafts_total"] > 0, "nothing accepted: proves nothing"


def native(srv, **body):
    r = httpx.post(srv.url + "/completion", json={"temperature": 0, "n_predict": N, "return_tokens": True, **body},
                   timeout=60)
    return r


def test_per_request_speculation_overrides(servers, ref):
    srv = servers("ngram-simple")
    runs = {p: native(srv, prompt=p).json() for p in PROMPTS}
    prompt = max(PROMPTS, key=lambda p: runs[p]["timings"].get("draft_n", 0))
    default = runs[prompt]
    assert default["timings"]["draft_n"] > 0 and default["tokens"] == ref[prompt]
    gs = default["generation_settings"]
    assert gs["speculative"] is True and gs["speculative.types"] == ["ngram-simple"]
    assert gs["speculative.n_max"] == srv.session.spec.draft_max

    off = native(srv, prompt=prompt, speculative=False).json()
    assert off["tokens"] == ref[prompt] and "draft_n" not in off["timings"]
    assert off["generation_settings"]["speculative"] is False and off["generation_settings"]["speculative.types"] == []

    one = native(srv, prompt=prompt, speculative={"n_max": 1}).json()
    assert one["tokens"] == ref[prompt] and one["generation_settings"]["speculative.n_max"] == 1
    # at most one draft token per step, and every step yields at least one token
    assert 0 < one["timings"]["draft_n"] <= one["timings"]["predicted_n"]

    typed = native(srv, prompt=prompt, speculative={"types": ["ngram-simple"], "n_min": 0}).json()
    assert typed["generation_settings"]["speculative.types"] == ["ngram-simple"]
    assert typed["generation_settings"]["speculative.n_min"] == 0 and typed["tokens"] == ref[prompt]

    none = native(srv, prompt=prompt, speculative={"types": []}).json()
    assert "draft_n" not in none["timings"] and none["generation_settings"]["speculative"] is False

    r = native(srv, prompt=prompt, speculative={"types": ["draft-simple"]})
    assert r.status_code == 400 and "ngram-simple" in r.json()["error"]["message"]
    r = native(srv, prompt=prompt, speculative={"n_min": 5, "n_max": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "speculative.n_min"
    r = httpx.post(srv.url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "speculative": {"n_max": 2}})
    assert r.status_code == 200 and r.json()["generation_settings"]["speculative.n_max"] == 2
    latest = max(httpx.get(srv.url + "/slots").json(), key=lambda s: s["id_task"])  # the chat request's slot
    assert latest["speculative"] is True and latest["params"]["speculative.n_max"] == 2


def test_draft_model_p_min_override(servers, ref):
    srv = servers("draft-simple")
    prompt = PROMPTS[0]
    default = native(srv, prompt=prompt).json()
    t = default["timings"]
    assert default["tokens"] == ref[prompt] and t["draft_n"] > 0 and 0 <= t["draft_n_accepted"] <= t["draft_n"]
    # p_min 1: the draft model's top-1 probability never reaches 1, so it never drafts
    strict = native(srv, prompt=prompt, speculative={"p_min": 1.0}).json()
    assert strict["tokens"] == ref[prompt] and "draft_n" not in strict["timings"]
    assert strict["generation_settings"]["speculative.p_min"] == 1.0


# --- queueing and disconnects on a single slot ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def single(tiny_model_path):
    with LiveServer(make_session(tiny_model_path, n_seq=1, n_ctx_slot=2048),
                    ServerSettings(metrics=True, slots=True)) as s:
        yield s


LONG = 1500  # tokens a cancelled request would generate if nobody stopped it


async def hold_stream(c: httpx.AsyncClient, prompt: str, leave: asyncio.Event) -> None:
    """A streaming request of LONG tokens whose client goes away once `leave` is set (the response half-read)."""
    body = {"prompt": prompt, "n_predict": LONG, "ignore_eos": True, "temperature": 0, "stream": True}
    async with c.stream("POST", "/completion", json=body):  # entered at the first token: the job has a slot
        await leave.wait()


def test_queue_is_fifo_and_stream_disconnect_frees_the_slot(single):
    """A long stream holds the one slot while B, C and D queue behind it in that order. Each time the client of
    the stream on the slot leaves, the slot goes to the oldest queued request at once: read on the server (/slots;
    task ids count arrivals), not from the order responses reach this client's event loop."""
    async def main():
        async with httpx.AsyncClient(base_url=single.url, timeout=60) as c:
            async def slot() -> dict:
                return (await c.get("/slots")).json()[0]

            async def deferred() -> float:
                return parse_metrics((await c.get("/metrics")).text)["llamacpp:requests_deferred"]

            async def wait_until(read, ok, what: str):
                deadline = time.monotonic() + 10
                while not ok(value := await read()):
                    assert time.monotonic() < deadline, f"never saw {what}"
                    await asyncio.sleep(0.01)
                return value

            leave = {name: asyncio.Event() for name in "LBCD"}
            clients = [asyncio.create_task(hold_stream(c, "long", leave["L"]))]
            first = (await wait_until(slot, lambda s: s["is_processing"], "the long stream on the slot"))["id_task"]
            for n, name in enumerate("BCD", 1):  # each one queued behind the previous
                clients.append(asyncio.create_task(hold_stream(c, f"queued {name}", leave[name])))
                await wait_until(deferred, lambda d, n=n: d == n, f"{n} queued")
            served = []  # arrival numbers of the requests the slot ran, in the order it ran them
            while len(served) < 4:
                taken = await wait_until(slot, lambda s: s["is_processing"] and s["id_task"] - first not in served,
                                         f"the slot taken after {len(served)} streams")
                served.append(taken["id_task"] - first)
                leave["LBCD"[served[-1]]].set()
            await asyncio.wait_for(asyncio.gather(*clients), timeout=60)
            return served

    assert asyncio.run(main()) == [0, 1, 2, 3]
    assert not httpx.get(single.url + "/slots").json()[0]["is_processing"]
    m = parse_metrics(httpx.get(single.url + "/metrics").text)
    assert m["llamacpp:tokens_predicted_total"] < LONG  # all four stopped when their clients left


def test_a_client_gone_while_its_prompt_is_decoded_frees_the_slot_and_keeps_the_decoded_prefix(tiny_model_path):
    """Prompts are decoded a ubatch's room per step (1 row here: 8000 steps, seconds on the tiny model): a client
    that leaves before its long prompt is in frees the slot at the next step, nothing is generated for it, and the
    rows decoded so far stay as the slot's cached prefix."""
    prompt = [40 + i % 50 for i in range(8000)]
    with LiveServer(make_session(tiny_model_path, n_seq=1, n_ctx_slot=8192, n_ubatch=1),
                    ServerSettings(metrics=True, slots=True)) as srv:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(srv.url + "/completion", timeout=0.3, json={"prompt": prompt, "n_predict": 8})
        deadline = time.monotonic() + 30
        while (slot := httpx.get(srv.url + "/slots").json()[0])["is_processing"]:
            assert time.monotonic() < deadline, "the slot is still busy after its client left"
            time.sleep(0.01)
        assert slot["next_token"][0]["n_decoded"] == 0
        assert 0 < slot["n_cached_tokens"] < len(prompt)
        assert parse_metrics(httpx.get(srv.url + "/metrics").text)["llamacpp:tokens_predicted_total"] == 0
        r = httpx.post(srv.url + "/completion", json={"prompt": prompt[:50], "n_predict": 3}, timeout=30)
        assert r.status_code == 200 and r.json()["tokens_predicted"] == 3 and r.json()["timings"]["cache_n"] > 0


def test_non_streaming_disconnect_frees_the_slot(single):
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(single.url + "/completion", timeout=0.5,
                   json={"prompt": "abandoned", "n_predict": LONG, "ignore_eos": True})
    deadline = time.monotonic() + 5
    while True:
        slot = httpx.get(single.url + "/slots").json()[0]
        if not slot["is_processing"]:
            break
        assert time.monotonic() < deadline, "the slot is still busy after its client left"
        time.sleep(0.01)
    assert slot["next_token"][0]["n_decoded"] < LONG
    r = httpx.post(single.url + "/completion", json={"prompt": "next", "n_predict": 3}, timeout=30)
    assert r.status_code == 200 and r.json()["tokens_predicted"] == 3
