"""The server's route handlers called directly, without uvicorn or HTTP: prompt checks, job building, the switches
of /slots and /metrics, tokenize/detokenize, SSE framing. tests/test_server*.py test the same routes over a socket."""

from __future__ import annotations

import asyncio
import json

import pytest
from starlette.requests import Request

from spec_cli.server import ServerSettings
from spec_cli.server import protocol as P
from spec_cli.server.routes import Routes, sse
from spec_cli.server.scheduler import Scheduler
from tests.server_harness import N_CTX_SLOT, make_session


@pytest.fixture(scope="module")
def session(tiny_model_path):
    return make_session(tiny_model_path, n_seq=2)


def routes(session, **settings) -> Routes:
    return Routes(Scheduler(session), ServerSettings(**settings))  # the scheduler's thread is never started


def post(body: dict) -> Request:
    data = json.dumps(body).encode()

    async def receive():
        return {"type": "http.request", "body": data, "more_body": False}

    return Request({"type": "http", "method": "POST", "path": "/", "headers": []}, receive)


def api_error(call) -> P.ApiError:
    with pytest.raises(P.ApiError) as e:
        asyncio.run(call) if asyncio.iscoroutine(call) else call()
    return e.value


def test_encode_refuses_empty_foreign_and_oversized_prompts(session):
    r = routes(session)
    assert r.encode("hello") == session.engine.tokenizer.encode("hello", add_special=True, parse_special=True)
    assert r.encode([1, 2, 3]) == [1, 2, 3]
    assert api_error(lambda: r.encode([])).param == "prompt"
    assert api_error(lambda: r.encode([session.engine.tokenizer.n_vocab])).status == 400
    too_long = api_error(lambda: r.encode([1] * N_CTX_SLOT))
    assert too_long.type == "exceed_context_size_error" and f"holds {N_CTX_SLOT - 1}" in too_long.message


def test_make_job_fills_the_server_defaults_and_checks_the_slot(session):
    r = routes(session, n_predict=7)
    req = P.parse_request(P.NativeCompletionRequest, b'{"prompt": "hi"}')
    job = r.make_job(req, [1, 2], None)
    assert job.prompt == [1, 2] and job.n_predict == 7 and job.id_slot == req.id_slot
    assert r.make_job(req, [1, 2], 3).n_predict == 3
    bad_slot = P.parse_request(P.NativeCompletionRequest, b'{"prompt": "hi", "id_slot": 2}')
    assert api_error(lambda: r.make_job(bad_slot, [1], None)).param == "id_slot"


def test_slots_and_metrics_are_off_unless_switched_on(session):
    off = routes(session)
    assert api_error(off.slots()).status == 501
    assert api_error(off.metrics()).status == 501
    on = routes(session, slots=True, metrics=True)
    assert len(asyncio.run(on.slots())) == 2
    assert b"llamacpp:prompt_tokens_total" in asyncio.run(on.metrics()).body


def test_models_names_the_alias_and_the_slot_context(session):
    body = asyncio.run(routes(session, alias="tiny").models())
    (model,) = body["data"]
    assert model["id"] == "tiny" and model["meta"]["n_ctx_slot"] == N_CTX_SLOT and model["meta"]["n_slots"] == 2


def test_tokenize_then_detokenize_round_trips(session):
    r = routes(session)
    tokens = asyncio.run(r.tokenize(post({"content": "the cat"})))["tokens"]
    assert asyncio.run(r.detokenize(post({"tokens": tokens}))) == {"content": "the cat"}
    pieces = asyncio.run(r.tokenize(post({"content": "the cat", "with_pieces": True})))["tokens"]
    assert [p["id"] for p in pieces] == tokens
    assert "".join(p["piece"] for p in pieces) == "the cat"


def test_sse_frames_json_and_done():
    assert sse({"a": 1}) == 'data: {"a": 1}\n\n'
    assert sse(None) == "data: [DONE]\n\n"
