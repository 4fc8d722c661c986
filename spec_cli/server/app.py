"""HTTP routes of `spec-cli server` (llama-server's routes in tools/server/server.cpp), on FastAPI.

`create_app(engine, settings)` builds the app around one Scheduler (the engine thread). Routes only parse,
tokenize, submit a Job and format what comes back: OpenAI-compatible `/v1/models`, `/v1/completions`,
`/v1/chat/completions` (SSE ending in `data: [DONE]`), llama.cpp-native `/completion`, `/tokenize`,
`/detokenize`, `/health`, `/slots` (unless --no-slots) and `/metrics` (with --metrics). A request passes
guard.py's checks first (Host, API key, JSON content type, body size). Every error, including malformed JSON and
failed validation, is a JSON body in OpenAI's shape. Tokenizing and chat-template rendering run in worker
threads, and a text prompt too long for a slot is refused from its length before it is tokenized. A client that
disconnects (streaming or not) cancels its task, which frees its slot before the next generation step.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from spec_cli.engine import Engine
from spec_cli.errors import SpecCliError, UsageError
from spec_cli.options import default
from spec_cli.sampling import SamplingParams
from spec_cli.server import protocol as P
from spec_cli.server.guard import RequestGuard
from spec_cli.server.scheduler import Scheduler
from spec_cli.server.task import Completion, Delta, Failure, Job, Task


@dataclass
class ServerSettings:
    alias: str | None = None  # model id in responses (default: the GGUF file name)
    api_key: str | None = None
    metrics: bool = False
    slots: bool = True
    n_predict: int = default("n_predict")  # when a request sets no limit
    sampling: SamplingParams = field(default_factory=SamplingParams)  # defaults for request sampling fields
    chat_template: str | None = None  # override of the GGUF's template (jinja source or a builtin name)
    allowed_hosts: list[str] = field(default_factory=list)  # Host names besides IP addresses and localhost
    max_body: int | None = None  # bytes a request body may have (None = no limit)

    def __post_init__(self):
        if self.api_key == "":
            raise UsageError("--api-key is empty: give a key, or leave the flag out to serve without one")
        if self.max_body is not None and self.max_body < 1:
            raise UsageError("--max-body-mib must be at least 1")


class ClientGone(Exception):
    pass


def create_app(engine: Engine, settings: ServerSettings | None = None) -> FastAPI:
    settings = settings or ServerSettings()
    scheduler = Scheduler(engine)
    tok = engine.tokenizer
    n_vocab = tok.n_vocab
    loaded = engine.chain.names if engine.chain else []
    model_id = settings.alias or engine.target.gguf.path.name

    @asynccontextmanager
    async def lifespan(_app):
        scheduler.start()
        yield
        scheduler.shutdown()

    app = FastAPI(title="spec-cli server", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.scheduler = scheduler
    app.add_middleware(RequestGuard, hosts=settings.allowed_hosts, api_key=settings.api_key,
                       max_body=settings.max_body if settings.max_body is not None else math.inf)
    _install_error_handlers(app)
    tok.min_tokens("")  # the vocabulary's bound is computed now, not in the first request

    # --- helpers shared by the completion routes ------------------------------------------------------------

    def encode(prompt: str | list[int]) -> list[int]:
        """A prompt's tokens (in a worker thread: tokenizing a long text takes seconds); a text too long to fit a
        slot is refused from its length alone, before it is tokenized."""
        if isinstance(prompt, str):
            check_fits(tok.min_tokens(prompt), at_least=True)
            prompt = tok.encode(prompt, add_special=True, parse_special=True)
        else:
            P.check_tokens(prompt, n_vocab, "prompt")
        if not prompt:
            raise P.ApiError(400, "the prompt is empty", param="prompt")
        check_fits(len(prompt))
        return prompt

    def check_fits(n_tokens: int, at_least: bool = False) -> None:
        n_ctx = scheduler.n_ctx_slot
        if n_tokens >= n_ctx:
            raise P.ApiError(400, f"the prompt has {'at least ' if at_least else ''}{n_tokens} tokens but a slot's "
                             f"context holds {n_ctx - 1} (-c {engine.ctx.n_ctx} split across {engine.ctx.n_seq} "
                             "slots): shorten the prompt, raise -c or lower -np", "exceed_context_size_error")

    def make_job(req: P.GenerationFields, tokens: list[int], n_predict: int | None) -> Job:
        if req.id_slot >= len(scheduler.slots):
            raise P.ApiError(400, f"id_slot {req.id_slot} does not exist ({len(scheduler.slots)} slots)",
                             param="id_slot")
        sampling = req.to_sampling(settings.sampling)
        spec = req.to_spec(engine.spec, loaded)
        n_predict = settings.n_predict if n_predict is None else n_predict
        return Job(prompt=tokens, sampling=sampling, n_predict=n_predict, spec=spec, stop=req.stops(),
                   cache_prompt=req.cache_prompt, id_slot=req.id_slot,
                   settings=P.generation_settings(req, sampling, n_predict, spec, engine.spec, loaded))

    async def submit(job: Job, request: Request) -> tuple[Task, Delta | Completion, asyncio.Future]:
        """Queue the job and wait for its first event (so errors still get a status code); returns the task,
        that event and the disconnect watcher."""
        try:
            task = scheduler.submit(job)
        except SpecCliError as e:
            raise P.ApiError(503, str(e), "unavailable_error") from None
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            first = await next_event(task, gone)
        except BaseException:
            gone.cancel()
            raise
        return task, first, gone

    async def next_event(task: Task, gone: asyncio.Future):
        get = asyncio.ensure_future(task.next_event())
        done, _ = await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
        if get not in done:
            get.cancel()
            scheduler.cancel(task)
            raise ClientGone
        event = get.result()
        if isinstance(event, Failure):
            raise P.ApiError(event.status, event.message, event.type)
        return event

    async def run_to_end(job: Job, request: Request) -> Completion:
        task, event, gone = await submit(job, request)
        try:
            while not isinstance(event, Completion):
                event = await next_event(task, gone)
            return event
        finally:
            gone.cancel()

    async def stream(job: Job, request: Request, render, prefix: tuple = ()) -> StreamingResponse:
        """SSE: the `prefix` payloads, then `render(event)`'s payloads for each event (None = `[DONE]`)."""
        task, first, gone = await submit(job, request)
        gone.cancel()  # from here Starlette watches the connection and cancels the generator below

        def sse(payload) -> str:
            return "data: " + (json.dumps(payload) if payload is not None else "[DONE]") + "\n\n"

        async def events():
            try:
                for payload in prefix:
                    yield sse(payload)
                event = first
                while True:
                    for payload in render(event):
                        yield sse(payload)
                    if isinstance(event, (Completion, Failure)):
                        return
                    event = await task.next_event()
            finally:
                scheduler.cancel(task)

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    # --- routes -----------------------------------------------------------------------------------------------

    @app.get("/health")
    @app.get("/v1/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    @app.get("/models")
    async def models():
        cfg = engine.target.config
        meta = {"n_vocab": n_vocab, "n_ctx_train": cfg.n_ctx_train, "n_ctx": engine.ctx.n_ctx,
                "n_ctx_slot": scheduler.n_ctx_slot, "n_slots": len(scheduler.slots), "speculative.types": loaded}
        return {"object": "list", "data": [{"id": model_id, "object": "model", "created": int(time.time()),
                                            "owned_by": "spec-cli", "meta": meta}]}

    @app.post("/completion")
    @app.post("/completions")
    async def completion(request: Request):
        req = P.parse_request(P.NativeCompletionRequest, await request.body())
        if req.n_probs:
            raise P.ApiError(400, "n_probs is not supported", param="n_probs")
        tokens = await asyncio.to_thread(encode, req.prompt)
        job = make_job(req, tokens, req.n_predict)
        prompt_text = req.prompt if isinstance(req.prompt, str) else tok.decode(tokens)
        if req.stream:
            def render(event):
                if isinstance(event, Delta):
                    return [P.native_chunk(event.text, event.tokens, req.return_tokens)]
                if isinstance(event, Failure):
                    return [P.error_body(event.status, event.message, event.type)]
                return [P.native_final(event, model_id, prompt_text, True, req.return_tokens)]
            return await stream(job, request, render)
        c = await run_to_end(job, request)
        return P.native_final(c, model_id, prompt_text, False, req.return_tokens)

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = P.parse_request(P.CompletionRequest, await request.body())
        if req.logprobs or req.echo:
            raise P.ApiError(400, "logprobs and echo are not supported", param="logprobs" if req.logprobs else "echo")
        tokens = await asyncio.to_thread(encode, req.single_prompt())
        return await openai_reply(req, make_job(req, tokens, req.max_tokens), request, chat=False)

    @app.post("/v1/chat/completions")
    @app.post("/chat/completions")
    async def chat_completions(request: Request):
        req = P.parse_request(P.ChatCompletionRequest, await request.body())
        if req.logprobs or req.top_logprobs:
            raise P.ApiError(400, "logprobs are not supported", param="logprobs")
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]

        def render_chat() -> list[int]:
            try:
                text = tok.apply_chat_template(messages, True, settings.chat_template)
            except SpecCliError as e:  # the template failed or ran past its bounds on these messages
                raise P.ApiError(400, str(e), param="messages") from None
            return encode(text)

        tokens = await asyncio.to_thread(render_chat)
        limit = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        return await openai_reply(req, make_job(req, tokens, limit), request, chat=True)

    async def openai_reply(req: P.OpenAIFields, job: Job, request: Request, chat: bool):
        cid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        if not req.stream:
            c = await run_to_end(job, request)
            choice = P.chat_choice(c.text, c.finish_reason) if chat else P.text_choice(c.text, c.finish_reason)
            return P.completion_body(cid, created, model_id, choice, final=c, chat=chat)
        usage_chunk = bool(req.stream_options and req.stream_options.include_usage)
        choice_of = (lambda text, reason: P.chat_delta({"content": text} if text else {}, reason)) if chat \
            else P.text_choice

        def body(choice, final=None):
            return P.completion_body(cid, created, model_id, choice, final=final, chunk=True, chat=chat,
                                     with_usage=not usage_chunk)

        def render(event):
            if isinstance(event, Delta):
                return [body(choice_of(event.text, None))] if event.text else []
            if isinstance(event, Failure):
                return [P.error_body(event.status, event.message, event.type), None]
            out = [body(choice_of("", event.finish_reason), final=event)]
            if usage_chunk:  # OpenAI: usage in one extra chunk with no choices
                out.append({**body(None), "choices": [], "usage": P.usage(event)})
            return out + [None]

        # OpenAI's first chat chunk announces the role
        prefix = (body(P.chat_delta({"role": "assistant", "content": ""}, None)),) if chat else ()
        return await stream(job, request, render, prefix)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        req = P.parse_request(P.TokenizeRequest, await request.body())
        tokens = await asyncio.to_thread(tok.encode, req.content, req.add_special, req.parse_special)
        if not req.with_pieces:
            return {"tokens": tokens}
        pieces = []
        for t in tokens:
            raw = tok.token_to_piece(t)
            try:
                piece = raw.decode("utf-8")
            except UnicodeDecodeError:
                piece = list(raw)  # llama.cpp: bytes that are not valid UTF-8 on their own
            pieces.append({"id": t, "piece": piece})
        return {"tokens": pieces}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        req = P.parse_request(P.DetokenizeRequest, await request.body())
        return {"content": tok.decode(P.check_tokens(req.tokens, n_vocab, "tokens"))}

    @app.get("/slots")
    async def slots():
        if not settings.slots:
            raise P.ApiError(501, "the /slots endpoint is disabled (--no-slots)", "not_supported_error")
        return scheduler.slots_info()

    @app.get("/metrics")
    async def metrics():
        if not settings.metrics:
            raise P.ApiError(501, "the /metrics endpoint is disabled; start the server with --metrics",
                             "not_supported_error")
        return PlainTextResponse(P.prometheus(_metric_values(scheduler)),
                                 media_type="text/plain; version=0.0.4")

    return app


def _metric_values(s: Scheduler) -> list[tuple[str, str, str, object]]:
    """llama-server's /metrics names and meanings (cumulative since start; take differences between scrapes)."""
    c, spec = s.counters, s.spec_totals()
    per_pos = [({"position": str(i)}, n) for i, n in enumerate(spec["accepted_per_pos"])]
    return [
        ("prompt_tokens_total", "counter", "Number of prompt tokens processed.", c.prompt_tokens),
        ("prompt_tokens_cached_total", "counter", "Number of prompt tokens reused from a slot's cache.",
         c.prompt_tokens_cached),
        ("prompt_seconds_total", "counter", "Prompt process time.", c.prompt_ms / 1e3),
        ("tokens_predicted_total", "counter", "Number of generation tokens processed.", c.predicted_tokens),
        ("tokens_predicted_seconds_total", "counter", "Predict process time.", c.predicted_ms / 1e3),
        ("n_decode_total", "counter", "Total number of target decode calls.", s.engine.ctx.n_decode),
        ("n_tokens_max", "counter", "Largest observed n_tokens.", c.n_tokens_max),
        ("spec_decode_num_drafts_total", "counter", "Number of drafts proposed.", spec["drafts"]),
        ("spec_decode_num_draft_tokens_total", "counter", "Number of draft tokens proposed.", spec["draft_tokens"]),
        ("spec_decode_num_accepted_tokens_total", "counter", "Number of draft tokens accepted.",
         spec["accepted_tokens"]),
        ("spec_decode_num_accepted_tokens_per_pos_total", "counter", "Accepted draft tokens per draft position.",
         per_pos),
        ("prompt_tokens_seconds", "gauge", "Average prompt throughput in tokens/s.",
         1e3 * c.prompt_tokens / c.prompt_ms if c.prompt_ms > 0 else 0.0),
        ("predicted_tokens_seconds", "gauge", "Average generation throughput in tokens/s (per request).",
         1e3 * c.predicted_tokens / c.predicted_ms if c.predicted_ms > 0 else 0.0),
        ("requests_processing", "gauge", "Number of requests processing.", s.n_processing),
        ("requests_deferred", "gauge", "Number of requests deferred.", s.n_deferred),
        ("n_busy_slots_per_decode", "gauge", "Average number of busy slots per generation decode.",
         c.busy_slot_steps / c.n_steps if c.n_steps else 0.0),
    ]


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body was already read, so receive() waits for it)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(P.ApiError)
    async def api_error(_request, e: P.ApiError):
        return JSONResponse(e.body(), e.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request, e: StarletteHTTPException):
        kind = {401: "authentication_error", 404: "not_found_error"}.get(e.status_code, "invalid_request_error")
        return JSONResponse(P.error_body(e.status_code, str(e.detail), kind), e.status_code,
                            headers=getattr(e, "headers", None))

    @app.exception_handler(ClientGone)
    async def gone(_request, _e):
        return Response(status_code=499)  # nobody reads it: the connection is closed

    @app.exception_handler(Exception)
    async def crash(_request, e: Exception):
        return JSONResponse(P.error_body(500, f"internal error: {type(e).__name__}: {e}", "server_error"), 500)
