"""The server against hostile or careless clients and operators, on a real server on a loopback port: text that
is not Unicode, bodies and prompts too big to handle, chat templates that fail or never end, requests from web
pages (DNS rebinding, cross-site POSTs) and a shutdown with requests in flight. Invariants: every refusal is a
JSON error in OpenAI's shape with the right status, the connection stays usable, a prompt too long for a slot
is refused before it is tokenized (and one that fits never is), and a stopped server ends every request with a
response: its answer, or the 503."""

from __future__ import annotations

import json
import threading
import time
from http.client import HTTPConnection

import httpx
import openai
import pytest

import spec_cli.text.chat
from spec_cli.server import ServerSettings
from tests.server_harness import N_CTX_SLOT, LiveServer, make_session

CHAT = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def settings():
    return ServerSettings(max_body=64 * 1024, allowed_hosts=["models.example"], slots=True)


@pytest.fixture(scope="module")
def srv(tiny_model_path, settings):
    with LiveServer(make_session(tiny_model_path, n_seq=2), settings) as s:
        yield s


@pytest.fixture(scope="module")
def http(srv):
    with httpx.Client(base_url=srv.url, timeout=30) as client:
        yield client


def assert_error(r: httpx.Response, status: int, *needles: str) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status and all(n in err["message"] for n in needles), err
    return err


# --- text that is not Unicode --------------------------------------------------------------------------------------

LONE_SURROGATES = [
    ("/completion", b'{"prompt": "\\ud800abc", "n_predict": 3}'),
    ("/completion", b'{"prompt": "abc", "n_predict": 3, "stop": ["\\udc00"]}'),
    ("/completion", b'{"prompt": "abc", "n_predict": 3, "stop": ["\\udc00"], "stream": true}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stop": ["\\udc00"]}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\uDBFF"}], "max_tokens": 3}'),
    ("/tokenize", b'{"content": "x\\ud800"}'),
    ("/completion", '{"prompt": "raw \ud800 bytes"}'.encode("utf-8", "surrogatepass")),  # invalid UTF-8
]


def test_lone_surrogates_are_a_400_on_a_connection_that_stays_open(srv):
    conn = HTTPConnection("127.0.0.1", srv.port, timeout=30)
    conn.connect()
    sock = conn.sock
    for path, body in LONE_SURROGATES:
        conn.request("POST", path, body, {"Content-Type": "application/json"})
        r = conn.getresponse()
        err = json.loads(r.read())["error"]
        assert r.status == 400 and err["type"] == "invalid_request_error" and "invalid JSON" in err["message"], err
    # a surrogate pair is one character: fine; the same keep-alive connection served all of it
    conn.request("POST", "/completion", b'{"prompt": "smile \\ud83d\\ude00", "n_predict": 2}',
                 {"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200 and json.loads(r.read())["prompt"] == "smile \U0001f600"
    assert conn.sock is sock
    conn.close()


# --- bodies and prompts too big ---------------------------------------------------------------------------------------

def test_body_over_the_limit_is_a_413_before_it_is_read(http, settings):
    big = json.dumps({"prompt": "x" * settings.max_body, "n_predict": 1}).encode()
    assert_error(http.post("/completion", content=big, headers={"content-type": "application/json"}), 413,
                 f"larger than {settings.max_body} bytes")

    def chunks():  # no Content-Length: counted as it arrives
        yield b'{"prompt": "'
        for _ in range(settings.max_body // 1024 + 1):
            yield b"y" * 1024
        yield b'"}'

    assert_error(http.post("/completion", content=chunks(), headers={"content-type": "application/json"}), 413)
    # just under the limit: read (/completion ignores unknown fields)
    r = http.post("/completion", json={"prompt": "hi", "n_predict": 1, "pad": "z" * (settings.max_body - 100)})
    assert r.status_code == 200, r.text


@pytest.fixture
def encoded(srv, monkeypatch):
    """Lengths of the texts the server tokenizes."""
    tok = srv.session.engine.tokenizer
    lengths: list[int] = []

    def spy(text, *args, **kwargs):
        lengths.append(len(text))
        return type(tok).encode(tok, text, *args, **kwargs)

    monkeypatch.setattr(tok, "encode", spy)
    return lengths


@pytest.fixture(scope="module")
def longest(srv) -> str:
    """The vocabulary's longest token: over and over, each copy is one token, so the length bound is exact."""
    tok = srv.session.engine.tokenizer
    return max((tok.token_text(i) for i in range(tok.n_vocab)), key=lambda t: len(t.encode()))


def test_a_prompt_that_cannot_fit_is_refused_before_it_is_tokenized(http, srv, encoded, longest):
    tok = srv.session.engine.tokenizer
    fits = longest * (N_CTX_SLOT - 1 - len(tok.encode("", add_special=True)))
    assert len(tok.encode(fits, add_special=True, parse_special=True)) == N_CTX_SLOT - 1
    assert http.post("/completion", json={"prompt": fits, "n_predict": 1}).status_code == 200
    encoded.clear()
    too_long = fits + longest * 2
    err = assert_error(http.post("/completion", json={"prompt": too_long, "n_predict": 1}), 400, "at least")
    assert err["type"] == "exceed_context_size_error"
    assert_error(http.post("/v1/completions", json={"prompt": [too_long]}), 400, "at least")
    assert_error(http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": too_long}]}),
                 400, "at least")
    assert encoded == []


def test_tokenize_refuses_a_text_no_slot_could_hold_before_tokenizing_it(http, encoded, longest):
    # tokenizing holds the interpreter lock the engine thread needs: a big text would stall every slot
    fits = http.post("/tokenize", json={"content": longest * (N_CTX_SLOT - 1)})
    assert fits.status_code == 200 and len(fits.json()["tokens"]) == N_CTX_SLOT - 1
    encoded.clear()
    err = assert_error(http.post("/tokenize", json={"content": longest * N_CTX_SLOT}), 400,
                       f"the content has at least {N_CTX_SLOT} tokens", f"holds {N_CTX_SLOT - 1}")
    assert err["type"] == "exceed_context_size_error" and encoded == []


# --- chat templates ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("template, needle", [
    ("{{ 1/0 }}", "ZeroDivisionError: division by zero"),
    ("{{ range(10**9)|list }}", "Range too big"),
    ("{% include 'other.jinja' %}", "cannot extend, include or import"),
    ("{{ 'a' * 10**8 }}", "would build a value longer than"),
    ("{% for m in messages %}{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
     "{% endfor %}", "rendering takes more than 0.2 s"),
])
def test_chat_template_failures_are_a_400(srv, settings, monkeypatch, template, needle):
    monkeypatch.setattr(spec_cli.text.chat, "MAX_RENDER_SECONDS", 0.2)
    monkeypatch.setattr(settings, "chat_template", template)
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=30)
    t0 = time.monotonic()
    with pytest.raises(openai.BadRequestError, match="chat template error") as e:
        client.chat.completions.create(model="m", messages=CHAT, max_tokens=2)
    assert needle in e.value.body["message"] and e.value.body["param"] == "messages"
    assert time.monotonic() - t0 < 5


# --- requests from web pages ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("host, allowed", [
    ("127.0.0.1:8080", True), ("[::1]:8080", True), ("10.1.2.3", True), ("localhost:8080", True),
    ("LOCALHOST.", True), ("app.localhost", True), ("models.example:443", True),
    ("evil.example:8080", False), ("localhost.evil.example", False), ("models.example.evil", False),
])
def test_host_header_names_an_ip_localhost_or_an_allowed_host(http, host, allowed):
    for r in (http.get("/slots", headers={"host": host}),
              http.post("/completion", json={"prompt": "hi", "n_predict": 1}, headers={"host": host})):
        if allowed:
            assert r.status_code == 200, (host, r.text)
        else:
            assert assert_error(r, 403, repr(host), "--allowed-hosts")["type"] == "permission_error"


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", None])
def test_a_post_body_must_be_json(http, content_type):
    headers = {"content-type": content_type} if content_type else {}
    r = http.post("/completion", content=b'{"prompt": "hi", "n_predict": 1}', headers=headers)
    assert_error(r, 415, "Content-Type: application/json")
    r = http.post("/completion", content=b'{"prompt": "hi", "n_predict": 1}',
                  headers={"content-type": "Application/JSON; charset=utf-8"})
    assert r.status_code == 200


# --- shutdown ---------------------------------------------------------------------------------------------------------

def sse_payloads(r: httpx.Response) -> list:
    return [line[6:] if line == "data: [DONE]" else json.loads(line[6:]) for line in r.iter_lines()
            if line.startswith("data: ")]


def wait_until(condition, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_shutdown_fails_requests_still_running_after_the_grace_period(tiny_model_path):
    long = {"prompt": "hi", "ignore_eos": True, "temperature": 0}
    with LiveServer(make_session(tiny_model_path, n_seq=3, n_ctx_slot=8192), grace=0.3) as srv:
        out: dict = {}

        def plain():
            out["plain"] = httpx.post(srv.url + "/completion", json={**long, "n_predict": 8000}, timeout=60)

        def stream(path, body, key):
            with httpx.stream("POST", srv.url + path, json={**long, **body, "stream": True}, timeout=60) as r:
                out[key] = sse_payloads(r)

        threads = [threading.Thread(target=plain),
                   threading.Thread(target=stream, args=("/v1/completions", {"max_tokens": 8000}, "openai")),
                   threading.Thread(target=stream, args=("/completion", {"n_predict": 8000}, "native"))]
        for t in threads:
            t.start()
        wait_until(lambda: srv.app.state.scheduler.n_processing == 3)
        srv.server.should_exit = True  # what SIGTERM and SIGINT do
        for t in threads:
            t.join(timeout=30)
    assert_error(out["plain"], 503, "shutting down")
    assert out["openai"][-2]["error"]["code"] == 503 and out["openai"][-1] == "[DONE]"
    assert all(chunk["choices"][0]["text"] is not None for chunk in out["openai"][:-2])  # it streamed until then
    assert out["native"][-1]["error"]["type"] == "unavailable_error"


def test_shutdown_lets_requests_finish_within_the_grace_period_and_refuses_new_ones(tiny_model_path):
    with LiveServer(make_session(tiny_model_path, n_seq=2, n_ctx_slot=2048), grace=60) as srv:
        out: dict = {}

        def request():
            out["r"] = httpx.post(srv.url + "/completion", timeout=60,
                                  json={"prompt": "hi", "n_predict": 600, "ignore_eos": True})

        thread = threading.Thread(target=request)
        thread.start()
        wait_until(lambda: srv.app.state.scheduler.n_processing == 1)
        t0 = time.monotonic()
        srv.server.should_exit = True
        late = {}
        wait_until(lambda: late.update(r=httpx.post(srv.url + "/completion", json={"prompt": "late", "n_predict": 1}))
                   or late["r"].status_code != 200)
        assert_error(late["r"], 503, "shutting down")
        thread.join(timeout=60)
    assert out["r"].status_code == 200 and out["r"].json()["tokens_predicted"] == 600
    assert time.monotonic() - t0 < 30  # the server stopped once idle, not at the end of the grace period
