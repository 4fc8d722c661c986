"""The server against a hostile client, on a real server on a loopback port, over raw sockets where HTTP itself is
bent: integers longer than Python converts, sampling values past float32, requests that never finish arriving,
framing a proxy could read differently (request smuggling), Host headers that are not a host[:port], API keys with
whitespace around them, /health during a shutdown, the tokens of clients that left, and /slots, which shows what
every client asked. Invariants: a malformed request gets a 4xx JSON error in OpenAI's shape (never a 500, never
plain text) and the server answers /health after each; a client that misbehaves or leaves costs one log line and
no traceback."""

from __future__ import annotations

import json
import logging
import shutil
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from spec_cli.errors import UsageError
from spec_cli.options import SERVER_OPTIONS
from spec_cli.server import ServerSettings
from tests.server_harness import LiveServer, make_session, parse_metrics

READ_TIMEOUT = 1.0  # the module server's --read-timeout


@pytest.fixture(scope="module")
def srv(tiny_model_path):
    settings = ServerSettings(max_body=64 * 1024, read_timeout=READ_TIMEOUT, metrics=True, slots=True)
    with LiveServer(make_session(tiny_model_path, n_seq=2, n_ctx_slot=2048), settings) as s:
        yield s


@pytest.fixture
def server_log(srv):
    """What uvicorn's error logger (the server's log) writes during the test."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("uvicorn.error")
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


def no_traceback(records: list[logging.LogRecord]) -> bool:
    return not any(r.exc_info for r in records)


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes
    closed: bool | None  # the server closed the connection after the reply (None: not checked)

    def error(self) -> dict:
        assert self.headers.get("content-type") == "application/json", self.headers
        return json.loads(self.body)["error"]


def exchange(port: int, data: bytes, check_closed: bool = False, timeout: float = 30) -> Reply:
    """Sends raw bytes on a new connection and reads one response."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        return read_reply(s, check_closed)


def read_reply(s: socket.socket, check_closed: bool = False) -> Reply:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        assert chunk, f"the connection closed without a response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines)}
    while len(body) < int(headers["content-length"]):
        body += s.recv(65536)
    closed = None
    if check_closed:
        s.settimeout(5)
        try:
            closed = s.recv(1) == b""
        except ConnectionResetError:
            closed = True
        except socket.timeout:
            closed = False
    return Reply(int(status_line.split()[1]), headers, body, closed)


def http_request(method: str, path: str, body: bytes = b"", *headers: str, host: str | None = "localhost",
                 version: str = "1.1", length: bool = True) -> bytes:
    lines = [f"{method} {path} HTTP/{version}"] + ([f"Host: {host}"] if host is not None else [])
    if body or method == "POST":
        lines += ["Content-Type: application/json"] + ([f"Content-Length: {len(body)}"] if length else [])
    return ("\r\n".join([*lines, *headers]) + "\r\n\r\n").encode("latin-1") + body


def healthy(srv) -> bool:
    return httpx.get(srv.url + "/health", timeout=30).status_code == 200


# --- the malformed-input set ------------------------------------------------------------------------------------------

DIGITS = "9" * 5000  # past Python's 4300-digit limit on int()
BIG_INTEGERS = [
    ("/completion", '{"prompt": "hi", "n_predict": %s}'),
    ("/completion", '{"prompt": "hi", "seed": -%s}'),
    ("/completion", '{"prompt": [1, %s]}'),
    ("/completion", '{"prompt": "hi", "a_field_nobody_reads": %s}'),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": %s}'),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": %s}'),
    ("/tokenize", '{"content": "hi", "extra": [%s]}'),
    ("/detokenize", '{"tokens": [%s]}'),
]
OUT_OF_FLOAT32 = [("temperature", "1e39"), ("temperature", "1e308"), ("repeat_penalty", "1e39")]
BAD_HOSTS = ["localhost:80@evil.example", "localhost:8080/x", "evil.example#localhost", "local host", "[::1",
             "[127.0.0.1]", "localhost:123456", "user@localhost", ""]


def chunked(body: bytes) -> bytes:
    return b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)


CHUNKED_HI = chunked(b'{"prompt": "hi", "n_predict": 1}')


def malformed_requests() -> list[tuple[str, bytes, int, str]]:
    """(what, raw request, status, a phrase of the error message)."""
    cases = [(f"{DIGITS[:3]}... in {path}", http_request("POST", path, (body % DIGITS).encode()), 400,
              "more than 4300 digits") for path, body in BIG_INTEGERS]
    cases += [(f"{field} {value}", http_request("POST", "/completion", (
        f'{{"prompt": "hi", "n_predict": 2, "{field}": {value}}}').encode()), 400, f"{field}: ")
              for field, value in OUT_OF_FLOAT32]
    cases += [(f"Host {host!r}", http_request("GET", "/slots", host=host), 400, "not a host name")
              for host in BAD_HOSTS]
    cases += [
        ("HTTP/1.0 without Host", http_request("GET", "/slots", host=None, version="1.0"), 400,
         "Host header is missing"),
        ("Content-Length and chunked", http_request("POST", "/completion", CHUNKED_HI, "Transfer-Encoding: chunked"),
         400, "not both"),
        # what h11 refuses itself (uvicorn's own answer is plain text)
        ("HTTP/1.1 without Host", http_request("GET", "/health", host=None), 400, "invalid HTTP request"),
        ("two Content-Lengths", http_request("POST", "/completion", b"{}", "Content-Length: 3"), 400,
         "invalid HTTP request"),
        ("Transfer-Encoding gzip", http_request("POST", "/completion", CHUNKED_HI, "Transfer-Encoding: gzip, chunked",
                                                length=False), 400, "invalid HTTP request"),
        ("a header without a colon", http_request("GET", "/health", b"", "no colon here"), 400,
         "invalid HTTP request"),
        ("no request line", b"\x16\x03\x01 tls hello?\r\n\r\n", 400, "invalid HTTP request"),
    ]
    return cases


MALFORMED = malformed_requests()


@pytest.mark.parametrize("what, data, status, needle", MALFORMED, ids=[c[0] for c in MALFORMED])
def test_malformed_requests_get_a_json_4xx_and_the_server_stays_healthy(srv, server_log, what, data, status, needle):
    reply = exchange(srv.port, data)
    err = reply.error()
    assert reply.status == status and err["code"] == status and needle in err["message"], (what, err)
    assert healthy(srv) and no_traceback(server_log)


def test_a_field_past_float32_is_named(srv):
    err = httpx.post(srv.url + "/completion", json={"prompt": "hi", "temperature": 1e39}).json()["error"]
    assert err["param"] == "temperature" and "largest float32" in err["message"]
    # the largest float32 itself still samples (uniformly): a 200
    r = httpx.post(srv.url + "/completion", json={"prompt": "hi", "n_predict": 2, "temperature": 3.4e38})
    assert r.status_code == 200


def test_conflicting_framing_closes_the_connection_so_nothing_can_be_smuggled(srv):
    # a proxy reading by Content-Length forwards one request; read by its chunks, the body ends at "0" and a second
    # request (to /slots, which the proxy may not allow) follows on the connection
    smuggled = http_request("GET", "/slots")
    data = http_request("POST", "/completion", b"0\r\n\r\n" + smuggled, "Transfer-Encoding: chunked")
    answers, closed = b"", False
    with socket.create_connection(("127.0.0.1", srv.port), timeout=2) as s:
        s.sendall(data)
        try:
            while chunk := s.recv(65536):
                answers += chunk
        except socket.timeout:
            pass  # the connection stayed open
        else:
            closed = True
    assert answers.startswith(b"HTTP/1.1 400 ") and answers.count(b"HTTP/1.1 ") == 1 and closed, answers


def test_http_1_0_with_a_host_is_served(srv):
    assert exchange(srv.port, http_request("GET", "/health", version="1.0")).status == 200


# --- requests that do not arrive ------------------------------------------------------------------------------------

HALF_A_BODY = http_request("POST", "/completion", b'{"prompt": "hi", "n_predict": 1}')[:-10]


@pytest.mark.parametrize("part", [HALF_A_BODY, b"GET /health HTTP/1.1\r\nHost: loc"],
                         ids=["half a body", "half a head"])
def test_a_request_that_does_not_arrive_in_time_is_a_408_and_its_connection_closed(srv, server_log, part):
    t0 = time.monotonic()
    sockets = [socket.create_connection(("127.0.0.1", srv.port), timeout=30) for _ in range(8)]  # a slowloris
    try:
        for s in sockets:
            s.sendall(part)
        replies = [read_reply(s, check_closed=True) for s in sockets]
        waited = time.monotonic() - t0
    finally:
        for s in sockets:
            s.close()
    assert all(r.status == 408 and r.closed and "within 1 s" in r.error()["message"] for r in replies)
    assert READ_TIMEOUT <= waited < READ_TIMEOUT + 10
    lines = [r.getMessage() for r in server_log]
    assert len(lines) == 8 and all("--read-timeout" in line for line in lines), lines
    assert no_traceback(server_log) and healthy(srv)


def test_a_connection_that_sends_nothing_is_closed(srv, server_log):
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", srv.port), timeout=READ_TIMEOUT + 10) as s:
        assert s.recv(1) == b"" and time.monotonic() - t0 >= READ_TIMEOUT
    assert no_traceback(server_log) and healthy(srv)


def test_a_request_sent_slowly_but_within_the_deadline_is_served(srv):
    data = http_request("POST", "/completion", b'{"prompt": "hi", "n_predict": 1}')
    with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as s:
        for i in range(0, len(data), len(data) // 4 + 1):
            s.sendall(data[i : i + len(data) // 4 + 1])
            time.sleep(READ_TIMEOUT / 8)
        assert read_reply(s).status == 200


def test_a_client_that_leaves_mid_body_is_one_log_line(srv, server_log):
    with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as s:
        s.sendall(HALF_A_BODY)
        time.sleep(0.2)  # the route is waiting for the rest of the body
    deadline = time.monotonic() + 10
    while not server_log:
        assert time.monotonic() < deadline, "nothing logged"
        time.sleep(0.02)
    time.sleep(0.2)  # anything else it would log
    lines = [r.getMessage() for r in server_log]
    assert len(lines) == 1 and lines[0].endswith("closed the connection before its whole request had arrived"), lines
    assert no_traceback(server_log) and healthy(srv)


# --- API keys -------------------------------------------------------------------------------------------------------

KEY = "sp ace"  # a space inside a key is fine; around it, not


@pytest.fixture(scope="module")
def locked(tiny_model_path):
    with LiveServer(make_session(tiny_model_path), ServerSettings(api_key=KEY)) as s:
        yield s


@pytest.mark.parametrize("header, ok", [
    ("Authorization: Bearer sp ace", True),
    ("Authorization: bearer sp ace", True),
    ("X-Api-Key: sp ace", True),
    ("Authorization: Bearer  sp ace", False),
    ("Authorization: Bearer \tsp ace", False),
    ("Authorization: Bearer sp ace\xa0", False),
    ("X-Api-Key: sp ace\xa0", False),
    ("X-Api-Key: \xa0sp ace", False),
    ("Authorization: Bearer sp  ace", False),
    ("Authorization: Bearer SP ACE", False),
    ("X-Api-Key: sp ac", False),
])
def test_the_api_key_must_match_exactly(locked, header, ok):
    reply = exchange(locked.port, http_request("GET", "/v1/models", b"", header))
    assert reply.status == (200 if ok else 401), header


@pytest.mark.parametrize("key", [" sp ace ", "key ", "\tkey", "key\xa0", "   ", "", "ke\ny"])
def test_a_key_no_client_could_send_is_refused_at_start_up(key):
    with pytest.raises(UsageError, match="--api-key"):
        SERVER_OPTIONS["api_key"].value(key)


@pytest.mark.parametrize("flags, needle", [
    (["--api-key", " sp ace "], "--api-key must be a key of printable characters without whitespace at either end"),
    (["--read-timeout", "0"], "--read-timeout must be > 0"),
])
def test_cli_refuses_bad_server_settings_with_exit_2(tiny_model_path, flags, needle):
    spec_cli = shutil.which("spec-cli", path=str(Path(sys.executable).parent))
    r = subprocess.run([spec_cli, "server", "-m", str(tiny_model_path), *flags], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and needle in r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


# --- shutdown, metrics, /slots ---------------------------------------------------------------------------------------

def test_health_answers_503_once_a_shutdown_began(tiny_model_path):
    with LiveServer(make_session(tiny_model_path, n_ctx_slot=2048), grace=60) as srv:
        out = {}
        long = threading.Thread(target=lambda: out.update(r=httpx.post(
            srv.url + "/completion", json={"prompt": "hi", "n_predict": 1500, "ignore_eos": True}, timeout=60)))
        long.start()
        deadline = time.monotonic() + 30
        while srv.app.state.scheduler.n_processing == 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        srv.server.should_exit = True  # what SIGTERM does; the request in flight has 60 s to finish
        deadline = time.monotonic() + 30
        while (health := httpx.get(srv.url + "/health", timeout=30)).status_code == 200:
            assert time.monotonic() < deadline, "/health never said the server is going away"
            time.sleep(0.01)
        long.join(timeout=60)
    assert health.status_code == 503 and health.json()["error"]["type"] == "unavailable_error"
    assert out["r"].json()["tokens_predicted"] == 1500  # the request in flight still finished


def test_tokens_of_clients_that_left_are_counted(srv):
    def predicted() -> float:
        return parse_metrics(httpx.get(srv.url + "/metrics").text)["llamacpp:tokens_predicted_total"]

    before = predicted()
    received = []
    request = {"prompt": "hi", "n_predict": 1500, "ignore_eos": True, "stream": True, "return_tokens": True}
    for _ in range(2):
        with httpx.stream("POST", srv.url + "/completion", json=request, timeout=30) as r:
            lines = (line for line in r.iter_lines() if line.startswith("data: "))
            received.append(sum(len(json.loads(next(lines)[6:])["tokens"]) for _ in range(3)))
    deadline = time.monotonic() + 10
    while not srv.app.state.scheduler.idle:
        assert time.monotonic() < deadline, "the streams were not cancelled"
        time.sleep(0.01)
    counted = predicted() - before
    assert sum(received) <= counted < 2 * 1500, (received, counted)


def test_slots_is_off_unless_switched_on(tiny_model_path):
    with LiveServer(make_session(tiny_model_path), ServerSettings()) as srv:
        r = httpx.get(srv.url + "/slots")
        assert r.status_code == 501 and r.json()["error"]["type"] == "not_supported_error"
        assert "--slots" in r.json()["error"]["message"]
