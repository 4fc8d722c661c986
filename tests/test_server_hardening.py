"""The server against hostile or careless clients, on a real server on a loopback port: text that is not
Unicode. Invariants: every refusal is a JSON error in OpenAI's shape with the right status, and the connection
stays usable."""

from __future__ import annotations

import json
from http.client import HTTPConnection

import httpx
import pytest

from spec_cli.server import ServerSettings
from tests.server_harness import LiveServer, make_engine


@pytest.fixture(scope="module")
def settings():
    return ServerSettings()


@pytest.fixture(scope="module")
def srv(tiny_model_path, settings):
    with LiveServer(make_engine(tiny_model_path, n_seq=2), settings) as s:
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
