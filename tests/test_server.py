"""`spec-cli server` routes against a real server on a loopback port: the official `openai` client (chat and
completions, streaming and not) and httpx for the llama.cpp-native routes. Invariants: greedy answers equal
the single-request greedy output, streamed pieces add up to the whole answer, stop strings cut the text before
them, the prompt cache reuses the slot's prefix without changing the output, bad input gets a 4xx error in
OpenAI's shape and the server keeps answering."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

from spec_cli.server import ServerSettings
from spec_cli.server.task import StopText
from tests.server_harness import N_CTX_SLOT, PROMPTS, LiveServer, greedy_reference, make_session, parse_metrics

N = 16  # tokens per answer
GREEDY_SETTINGS = dict(temperature=0.0)


@pytest.fixture(scope="module")
def srv(tiny_model_path):
    session = make_session(tiny_model_path, n_seq=4)
    with LiveServer(session, ServerSettings(metrics=True, slots=True, alias="tiny")) as s:
        yield s


@pytest.fixture(scope="module")
def http(srv):
    with httpx.Client(base_url=srv.url, timeout=30) as client:
        yield client


@pytest.fixture(scope="module")
def oai(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def ref(tiny_model_path):
    return greedy_reference(tiny_model_path, PROMPTS[:3], N)


@pytest.fixture(scope="module")
def tok(srv):
    return srv.session.engine.tokenizer


def text_of(tok, tokens):
    return tok.decode(tokens, special=False)


def native(http, **body):
    r = http.post("/completion", json={"temperature": 0.0, **body})
    assert r.status_code == 200, r.text
    return r.json()


# --- OpenAI client ----------------------------------------------------------------------------------------------

def test_openai_completions_equal_single_request_greedy(oai, ref, tok):
    for prompt in PROMPTS[:3]:
        r = oai.completions.create(model="tiny", prompt=prompt, max_tokens=N, temperature=0)
        expected = ref[prompt]
        assert r.choices[0].text == text_of(tok, expected)
        assert r.choices[0].finish_reason == ("length" if len(expected) == N else "stop")
        assert r.usage.completion_tokens == len(expected)
        assert r.usage.prompt_tokens == len(tok.encode(prompt, parse_special=True))
        assert r.model == "tiny"


def test_openai_completions_stream_adds_up(oai, ref, tok):
    prompt = PROMPTS[1]
    chunks = list(oai.completions.create(model="tiny", prompt=prompt, max_tokens=N, temperature=0, stream=True,
                                         stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == text_of(tok, ref[prompt])
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] in ("length", "stop") and all(r is None for r in reasons[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref[prompt])


def test_openai_chat_stream_and_not(oai, tok, tiny_model_path):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Hello world"}]
    rendered = tok.apply_chat_template(messages, True)
    expected = greedy_reference(tiny_model_path, [rendered], N)[rendered]
    r = oai.chat.completions.create(model="tiny", messages=messages, max_tokens=N, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == text_of(tok, expected)
    assert r.usage.prompt_tokens == len(tok.encode(rendered, parse_special=True))
    chunks = list(oai.chat.completions.create(model="tiny", messages=messages, max_tokens=N, temperature=0,
                                              stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == r.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == len(expected)  # llama.cpp: usage rides on the last chunk


def test_openai_client_sees_context_overflow_as_bad_request(oai):
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model="tiny", prompt="x " * (2 * N_CTX_SLOT), max_tokens=4)
    assert e.value.body["type"] == "exceed_context_size_error"


# --- native routes ----------------------------------------------------------------------------------------------

def test_native_completion_tokens_and_timings(http, ref, tok):
    prompt = PROMPTS[2]
    body = native(http, prompt=prompt, n_predict=N, return_tokens=True, cache_prompt=False)
    assert body["tokens"] == ref[prompt]
    assert body["content"] == text_of(tok, ref[prompt])
    t = body["timings"]
    n_prompt = len(tok.encode(prompt, parse_special=True))
    assert t["cache_n"] == 0 and t["prompt_n"] == n_prompt and t["predicted_n"] == len(ref[prompt])
    for key in ("prompt_ms", "prompt_per_token_ms", "prompt_per_second", "predicted_ms", "predicted_per_token_ms",
                "predicted_per_second"):
        assert t[key] > 0
    assert t["predicted_per_second"] == pytest.approx(1e3 * t["predicted_n"] / t["predicted_ms"])
    assert "draft_n" not in t  # nothing drafted: the draft fields are left out, as llama.cpp does
    assert body["tokens_evaluated"] == n_prompt and body["stop"] is True
    assert body["generation_settings"]["n_predict"] == N and body["generation_settings"]["speculative"] is False


def test_native_stream_adds_up(http, ref, tok):
    prompt = PROMPTS[0]
    pieces, tokens, final = [], [], None
    with http.stream("POST", "/completion", json={"prompt": prompt, "n_predict": N, "temperature": 0, "stream": True,
                                                  "return_tokens": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                obj = json.loads(line[6:])
                if obj["stop"]:
                    final = obj
                else:
                    pieces.append(obj["content"])
                    tokens.extend(obj["tokens"])
    assert tokens == ref[prompt] and "".join(pieces) == text_of(tok, ref[prompt])
    assert final["timings"]["predicted_n"] == len(ref[prompt])


def test_stop_string_cuts_the_text(http, ref, tok):
    prompt = PROMPTS[0]
    full = native(http, prompt=prompt, n_predict=N)["content"]
    assert full == text_of(tok, ref[prompt])
    start = next(i for i in range(3, len(full) - 1) if full[i:i + 2].isprintable() and "\ufffd" not in full[i:i + 2])
    stop = full[start:start + 2]
    cut = full.index(stop)
    body = native(http, prompt=prompt, n_predict=N, stop=[stop, "never-there"])
    assert body["content"] == full[:cut]
    assert body["stop_type"] == "word" and body["stopping_word"] == stop
    streamed = []
    with http.stream("POST", "/completion", json={"prompt": prompt, "n_predict": N, "temperature": 0, "stream": True,
                                                  "stop": stop}) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                streamed.append(json.loads(line[6:])["content"])
    assert "".join(streamed) == full[:cut]  # a possible stop prefix is held back, never sent and taken back


def test_stop_text_holds_back_a_possible_stop_prefix(tok):
    ids = tok.encode("Hello world, the end", parse_special=False)
    out = StopText(tok, ["d, t", "zzz"])
    sent = []
    for t in ids:
        stopped = out.push(t)
        sent.append(out.take(final=stopped))
        if stopped:
            break
    assert out.text == "Hello worl" and out.stopping_word == "d, t"
    assert "".join(sent) == "Hello worl"
    assert all("d" not in piece for piece in sent)  # "d" could start "d, t": it was held, then dropped


def test_prompt_cache_reuses_the_slot_prefix(http, tok):
    prompt = "\u00a7 cached prompt. The same words again."
    n_prompt = len(tok.encode(prompt, parse_special=True))
    first = native(http, prompt=prompt, n_predict=8, id_slot=2, return_tokens=True)
    again = native(http, prompt=prompt, n_predict=8, id_slot=2, return_tokens=True)
    assert again["timings"]["cache_n"] == n_prompt - 1 and again["timings"]["prompt_n"] == 1
    assert again["tokens"] == first["tokens"]
    # no id_slot: the slot holding the longest common prefix is chosen
    longer = native(http, prompt=prompt + " More text.", n_predict=8)
    assert longer["id_slot"] == 2 and longer["timings"]["cache_n"] >= n_prompt
    uncached = native(http, prompt=prompt, n_predict=8, id_slot=2, return_tokens=True, cache_prompt=False)
    assert uncached["timings"]["cache_n"] == 0 and uncached["tokens"] == first["tokens"]


def test_n_predict_zero_only_evaluates_the_prompt(http, tok):
    prompt = "\u00b6 warm the cache"
    body = native(http, prompt=prompt, n_predict=0, id_slot=1)
    assert body["content"] == "" and body["tokens_predicted"] == 0
    warm = native(http, prompt=prompt, n_predict=2, id_slot=1)
    assert warm["timings"]["cache_n"] == len(tok.encode(prompt, parse_special=True)) - 1


def test_context_limits(http, tok):
    r = http.post("/completion", json={"prompt": [65] * (N_CTX_SLOT + 10), "n_predict": 4})
    assert r.status_code == 400 and r.json()["error"]["type"] == "exceed_context_size_error"
    assert str(N_CTX_SLOT - 1) in r.json()["error"]["message"]
    n_prompt = N_CTX_SLOT - 6
    body = native(http, prompt=[66] * n_prompt, n_predict=100, ignore_eos=True)
    assert body["stop_type"] == "limit" and 1 <= body["tokens_predicted"] <= N_CTX_SLOT - n_prompt + 1
    r = http.post("/v1/completions", json={"prompt": [66] * n_prompt, "max_tokens": 100, "ignore_eos": True})
    assert r.json()["choices"][0]["finish_reason"] == "length"


def test_tokenize_detokenize_round_trip(http, tok):
    text = "Hello world <|im_end|> again"
    r = http.post("/tokenize", json={"content": text}).json()
    assert r["tokens"] == tok.encode(text, add_special=False, parse_special=True)
    assert tok.token_to_piece(r["tokens"][0]) == b"Hello"
    assert http.post("/detokenize", json={"tokens": r["tokens"]}).json()["content"] == text
    pieces = http.post("/tokenize", json={"content": text, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == r["tokens"] and pieces[0]["piece"] == "Hello"
    literal = http.post("/tokenize", json={"content": "<|im_end|>", "parse_special": False}).json()["tokens"]
    assert len(literal) > 1  # the marker as plain text, not the control token


def test_health_models_slots_metrics(http, srv):
    assert http.get("/health").json() == {"status": "ok"}
    models = http.get("/v1/models").json()
    assert models["data"][0]["id"] == "tiny" and models["data"][0]["meta"]["n_ctx_slot"] == N_CTX_SLOT
    native(http, prompt="metrics please", n_predict=3)
    slots = http.get("/slots").json()
    assert [s["id"] for s in slots] == [0, 1, 2, 3]
    assert all(s["n_ctx"] == N_CTX_SLOT and not s["is_processing"] for s in slots)
    assert all(s["speculative"] is False and s["params"]["speculative.types"] == [] for s in slots)
    m = parse_metrics(http.get("/metrics").text)
    for name in ("prompt_tokens_total", "prompt_tokens_cached_total", "prompt_seconds_total", "tokens_predicted_total",
                 "tokens_predicted_seconds_total", "n_decode_total", "n_tokens_max", "prompt_tokens_seconds",
                 "predicted_tokens_seconds", "requests_processing", "requests_deferred", "n_busy_slots_per_decode",
                 "spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
                 "spec_decode_num_accepted_tokens_total"):
        assert f"llamacpp:{name}" in m, name
    assert m["llamacpp:tokens_predicted_total"] >= 3 and m["llamacpp:requests_processing"] == 0
    assert m["llamacpp:n_decode_total"] >= m["llamacpp:tokens_predicted_total"] - 1
    assert 1.0 <= m["llamacpp:n_busy_slots_per_decode"] <= 4.0


# --- bad input ----------------------------------------------------------------------------------------------------

BAD = [
    ("POST", "/v1/completions", b"{bad json", 400),
    ("POST", "/v1/completions", b"[1, 2]", 400),
    ("POST", "/v1/completions", b"", 400),
    ("POST", "/v1/completions", b"[" * 100000, 400),
    ("POST", "/v1/completions", b'{"prompt": "x", "temperature": NaN}', 400),
    ("POST", "/v1/completions", {"max_tokens": 4}, 400),
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": "ten"}, 400),
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": -5}, 400),
    ("POST", "/v1/completions", {"prompt": "x", "temperature": -1}, 400),
    ("POST", "/v1/completions", {"prompt": "x", "top_p": 1.5}, 400),
    ("POST", "/v1/completions", {"prompt": "x", "n": 2}, 400),
    ("POST", "/v1/completions", {"prompt": "x", "stream": "yes"}, 400),
    ("POST", "/v1/completions", {"prompt": "x", "frobnicate": 1}, 400),
    ("POST", "/v1/completions", {"prompt": ["a", "b"]}, 400),
    ("POST", "/v1/completions", {"prompt": "x", "logprobs": 2}, 400),
    ("POST", "/v1/completions", {"prompt": "x", "seed": "abc"}, 400),
    ("POST", "/v1/completions", {"prompt": "x", "stop": 5}, 400),
    ("POST", "/v1/completions", {"prompt": "x", "stop": ["s"] * 17}, 400),
    ("POST", "/v1/completions", {"prompt": "x", "id_slot": 99}, 400),
    ("POST", "/v1/chat/completions", {"messages": []}, 400),
    ("POST", "/v1/chat/completions", {"messages": "hi"}, 400),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": []}, 400),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image"}]}]}, 400),
    ("POST", "/completion", {"prompt": [999999]}, 400),
    ("POST", "/completion", {"prompt": [1, "a"]}, 400),
    ("POST", "/completion", {"prompt": ""}, 400),
    ("POST", "/completion", {"prompt": "x", "n_predict": -2}, 400),
    ("POST", "/completion", {"prompt": "x", "speculative": {"n_max": -1}}, 400),
    ("POST", "/completion", {"prompt": "x", "speculative": {"types": ["ngram-mod"]}}, 400),
    ("POST", "/completion", {"prompt": "x", "speculative": {"bogus": 1}}, 400),
    ("POST", "/completion", {"prompt": "x", "speculative": "on"}, 400),
    ("POST", "/completion", {"prompt": "x", "n_probs": 3}, 400),
    ("POST", "/detokenize", {"tokens": ["a"]}, 400),
    ("POST", "/detokenize", {"tokens": [-1]}, 400),
    ("POST", "/tokenize", {"content": 5}, 400),
    ("GET", "/v1/completions", None, 405),
    ("GET", "/nope", None, 404),
]


def test_malformed_requests_get_openai_errors_then_a_good_request_works(http, ref, tok):
    for method, path, body, status in BAD:
        if isinstance(body, bytes):
            r = http.request(method, path, content=body, headers={"content-type": "application/json"})
        else:
            r = http.request(method, path, json=body)
        assert r.status_code == status, (path, body if not isinstance(body, bytes) else body[:40], r.text)
        err = r.json()["error"]
        assert isinstance(err["message"], str) and err["message"] and err["code"] == status
        assert isinstance(err["type"], str) and "param" in err
    r = http.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == text_of(tok, ref[PROMPTS[0]][:4])


def test_bad_field_is_named(http):
    err = http.post("/completion", json={"prompt": "x", "speculative": {"n_max": -1}}).json()["error"]
    assert err["param"] == "speculative.n_max"
    err = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": 5}]}).json()["error"]
    assert err["param"] == "messages.0.content"


def test_engine_error_fails_the_request_and_the_server_recovers(http, ref, tok, srv):
    scheduler = srv.app.state.scheduler

    def broken_step():
        raise RuntimeError("injected fault")

    scheduler.gen.step = broken_step  # the engine thread is idle: no request in flight
    r = http.post("/completion", json={"prompt": PROMPTS[0], "n_predict": 8, "temperature": 0})
    assert r.status_code == 500 and "injected fault" in r.json()["error"]["message"]
    assert r.json()["error"]["type"] == "server_error"
    # the caches were reset and a fresh generator took over: the same request now succeeds, unchanged
    body = native(http, prompt=PROMPTS[0], n_predict=8, return_tokens=True)
    assert body["tokens"] == ref[PROMPTS[0]][:8] and body["timings"]["cache_n"] == 0


# --- API key, disabled endpoints ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def locked(tiny_model_path):
    with LiveServer(make_session(tiny_model_path), ServerSettings(api_key="sekrit")) as s:
        yield s


def test_api_key_guards_every_route_but_health(locked):
    with httpx.Client(base_url=locked.url, timeout=30) as c:
        assert c.get("/health").status_code == 200
        for method, path in (("GET", "/v1/models"), ("POST", "/completion"), ("POST", "/v1/chat/completions"),
                             ("POST", "/tokenize"), ("GET", "/slots"), ("GET", "/metrics")):
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"X-Api-Key": "sekri"}):
                r = c.request(method, path, headers=headers, content=b"{bad")
                assert r.status_code == 401, (path, headers)
                assert r.json()["error"]["type"] == "authentication_error"
        assert c.get("/v1/models", headers={"Authorization": "Bearer sekrit"}).status_code == 200
        assert c.get("/v1/models", headers={"X-Api-Key": "sekrit"}).status_code == 200
        # the key opens the door; the disabled endpoints then say so
        assert c.get("/slots", headers={"X-Api-Key": "sekrit"}).status_code == 501
        assert c.get("/metrics", headers={"X-Api-Key": "sekrit"}).status_code == 501
    good = openai.OpenAI(base_url=locked.url + "/v1", api_key="sekrit", max_retries=0, timeout=30)
    assert good.completions.create(model="m", prompt="hi", max_tokens=2).usage.completion_tokens <= 2
    bad = openai.OpenAI(base_url=locked.url + "/v1", api_key="nope", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="m", prompt="hi", max_tokens=2)


# --- the command line -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("sig, exit_code", [(signal.SIGTERM, 0), (signal.SIGINT, 130)])
def test_cli_server_command(tiny_model_path, sig, exit_code):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "spec_cli", "server", "-m", str(tiny_model_path), "--port", str(port), "-np", "2",
           "-c", "512", "-a", "tiny-cli", "--api-key", "k", "--temp", "0", "-n", "5", "--allowed-hosts",
           "models.example,other.example", "--max-body-mib", "1", "--slots", "--read-timeout", "20"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url, key = f"http://127.0.0.1:{port}", {"X-Api-Key": "k"}
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stderr.read()
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.2)
        meta = httpx.get(url + "/v1/models", headers=key).json()["data"][0]
        assert meta["id"] == "tiny-cli" and meta["meta"]["n_slots"] == 2 and meta["meta"]["n_ctx_slot"] == 256
        body = httpx.post(url + "/completion", json={"prompt": "Hello"}, headers=key, timeout=30).json()
        # the sampling flags and -n are the request defaults
        assert body["generation_settings"]["temperature"] == 0.0 and body["tokens_predicted"] <= 5
        assert httpx.get(url + "/metrics", headers=key).status_code == 501  # no --metrics
        assert len(httpx.get(url + "/slots", headers=key).json()) == 2  # --slots
        assert httpx.get(url + "/v1/models", headers={**key, "Host": "other.example"}).status_code == 200
        assert httpx.get(url + "/v1/models", headers={**key, "Host": "evil.example"}).status_code == 403
        big = httpx.post(url + "/completion", json={"prompt": "x" * (1 << 20)}, headers=key)
        assert big.status_code == 413 and "1048576 bytes" in big.json()["error"]["message"]
    finally:
        proc.send_signal(sig)
        code = proc.wait(timeout=30)
    # a graceful shutdown, quietly: 0 for a requested stop (SIGTERM), 130 for an interrupt (SIGINT)
    assert code == exit_code and "Traceback" not in proc.stderr.read()


def test_cli_server_rejects_bad_flags():
    r = subprocess.run([sys.executable, "-m", "spec_cli", "server", "-np", "0"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and "-np" in r.stderr
