"""The HTTP handlers of `spec-cli server` (llama-server's routes in tools/server/server.cpp) as methods of `Routes`,
which holds what they share: the Scheduler (the engine thread), its session's engine and spec settings, and the
ServerSettings.

A handler only parses, tokenizes, submits a Job and formats what comes back. Tokenizing and chat-template rendering
run in worker threads, and a text too long for a slot (a prompt, /tokenize's content) is refused from its length
before it is tokenized. A client that disconnects (streaming or not) cancels its task, which frees its slot before
the next generation step. app.py mounts the handlers (ROUTES) and turns ApiError / ClientGone into responses.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

from fastapi import Request
from fastapi.responses import PlainTextResponse, StreamingResponse

from spec_cli.errors import SpecCliError
from spec_cli.runtime.memory import measured
from spec_cli.server import protocol as P
from spec_cli.server.props import props
from spec_cli.server.scheduler import Scheduler
from spec_cli.server.settings import ServerSettings
from spec_cli.server.slot_actions import slot_action
from spec_cli.server.task import Completion, Delta, Failure, Job, Task

# (HTTP method, paths, Routes method)
ROUTES = (
    ("GET", ("/health", "/v1/health"), "health"),
    ("GET", ("/v1/models", "/models"), "models"),
    ("POST", ("/completion", "/completions"), "completion"),
    ("POST", ("/v1/completions",), "completions"),
    ("POST", ("/v1/chat/completions", "/chat/completions"), "chat_completions"),
    ("POST", ("/tokenize",), "tokenize"),
    ("POST", ("/detokenize",), "detokenize"),
    ("GET", ("/slots",), "slots"),
    ("POST", ("/slots/{id_slot}",), "slot_action"),
    ("GET", ("/props",), "props"),
    ("GET", ("/metrics",), "metrics"),
)


class ClientGone(Exception):
    """The client closed the connection before its response was ready."""


class Routes:
    def __init__(self, scheduler: Scheduler, settings: ServerSettings):
        self.scheduler, self.settings = scheduler, settings
        session = scheduler.session  # a renewed session keeps the engine and the spec settings
        self.engine, self.spec = session.engine, session.spec
        self.tok = self.engine.tokenizer
        self.loaded = session.types  # the spec types a request may choose among
        self.model_id = settings.alias or self.engine.target.gguf.path.name
        self.tok.min_tokens("")  # the vocabulary's bound is computed now, not in the first request
        self.memory = measured(self.engine, session.drafters)

    # --- routes -----------------------------------------------------------------------------------------------

    async def health(self):
        if self.scheduler.closed:  # as llama-server while it cannot serve: a load balancer sends traffic elsewhere
            raise P.ApiError(503, "server is shutting down", "unavailable_error")
        return {"status": "ok"}

    async def models(self):
        cfg, s = self.engine.target.config, self.scheduler
        meta = {"n_vocab": self.tok.n_vocab, "n_ctx_train": cfg.n_ctx_train, "n_ctx": self.engine.ctx.n_ctx,
                "n_ctx_slot": s.n_ctx_slot, "n_slots": len(s.slots), "speculative.types": self.loaded}
        return {"object": "list", "data": [{"id": self.model_id, "object": "model", "created": int(time.time()),
                                            "owned_by": "spec-cli", "meta": meta}]}

    async def completion(self, request: Request):
        """llama.cpp's native /completion."""
        req = P.parse_request(P.NativeCompletionRequest, await request.body())
        if req.n_probs:
            raise P.ApiError(400, "n_probs is not supported", param="n_probs")
        tokens = await asyncio.to_thread(self.encode, req.prompt)
        job = self.make_job(req, tokens, req.n_predict)
        prompt_text = req.prompt if isinstance(req.prompt, str) else self.tok.decode(tokens)
        if not req.stream:
            c = await self.run_to_end(job, request)
            return P.native_final(c, self.model_id, prompt_text, False, req.return_tokens)

        def render(event):
            if isinstance(event, Delta):
                return [P.native_chunk(event.text, event.tokens, req.return_tokens)]
            if isinstance(event, Failure):
                return [P.error_body(event.status, event.message, event.type)]
            return [P.native_final(event, self.model_id, prompt_text, True, req.return_tokens)]

        return await self.stream(job, request, render)

    async def completions(self, request: Request):
        req = P.parse_request(P.CompletionRequest, await request.body())
        if req.logprobs or req.echo:
            raise P.ApiError(400, "logprobs and echo are not supported", param="logprobs" if req.logprobs else "echo")
        tokens = await asyncio.to_thread(self.encode, req.single_prompt())
        return await self.openai_reply(req, self.make_job(req, tokens, req.max_tokens), request, chat=False)

    async def chat_completions(self, request: Request):
        req = P.parse_request(P.ChatCompletionRequest, await request.body())
        if req.logprobs or req.top_logprobs:
            raise P.ApiError(400, "logprobs are not supported", param="logprobs")
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        tokens = await asyncio.to_thread(self.encode_chat, messages)
        limit = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        return await self.openai_reply(req, self.make_job(req, tokens, limit), request, chat=True)

    async def tokenize(self, request: Request):
        """The content's tokens. Tokenizing is pure Python: it holds the interpreter lock the engine thread needs
        between its kernels and slows every slot's generation while it runs. So a text is held to what a prompt may
        be (refused from its length where it could not fit a slot): no longer than a prompt's tokenizing would."""
        req = P.parse_request(P.TokenizeRequest, await request.body())
        self.check_fits(self.tok.min_tokens(req.content), at_least=True, what="content")
        tokens = await asyncio.to_thread(self.tok.encode, req.content, req.add_special, req.parse_special)
        if not req.with_pieces:
            return {"tokens": tokens}
        pieces = []
        for t in tokens:
            raw = self.tok.token_to_piece(t)
            try:
                piece = raw.decode("utf-8")
            except UnicodeDecodeError:
                piece = list(raw)  # llama.cpp: bytes that are not valid UTF-8 on their own
            pieces.append({"id": t, "piece": piece})
        return {"tokens": pieces}

    async def detokenize(self, request: Request):
        req = P.parse_request(P.DetokenizeRequest, await request.body())
        return {"content": self.tok.decode(P.check_tokens(req.tokens, self.tok.n_vocab, "tokens"))}

    async def slots(self):
        if not self.settings.slots:
            raise P.ApiError(501, "the /slots endpoint is disabled: start the server with --slots",
                             "not_supported_error")
        return self.scheduler.slots_info()

    async def slot_action(self, id_slot: str, request: Request):
        """llama-server's /slots/{id}?action=save|restore|erase (slot_actions.py)."""
        return await slot_action(self.scheduler, self.settings.slot_save_path, id_slot,
                                 request.query_params.get("action"), await request.body())

    async def props(self):
        return props(self.scheduler, self.settings, self.model_id, self.memory)

    async def metrics(self):
        if not self.settings.metrics:
            raise P.ApiError(501, "the /metrics endpoint is disabled; start the server with --metrics",
                             "not_supported_error")
        return PlainTextResponse(P.prometheus(metric_values(self.scheduler)), media_type="text/plain; version=0.0.4")

    # --- prompt -> job (called in worker threads) ---------------------------------------------------------------

    def encode(self, prompt: str | list[int]) -> list[int]:
        """A prompt's tokens (tokenizing a long text takes seconds); a text too long to fit a slot is refused from
        its length alone, before it is tokenized."""
        if isinstance(prompt, str):
            self.check_fits(self.tok.min_tokens(prompt), at_least=True)
            prompt = self.tok.encode(prompt, add_special=True, parse_special=True)
        else:
            P.check_tokens(prompt, self.tok.n_vocab, "prompt")
        if not prompt:
            raise P.ApiError(400, "the prompt is empty", param="prompt")
        self.check_fits(len(prompt))
        return prompt

    def encode_chat(self, messages: list[dict]) -> list[int]:
        try:
            text = self.tok.apply_chat_template(messages, True, self.settings.chat_template)
        except SpecCliError as e:  # the template failed or ran past its bounds on these messages
            raise P.ApiError(400, str(e), param="messages") from None
        return self.encode(text)

    def check_fits(self, n_tokens: int, at_least: bool = False, what: str = "prompt") -> None:
        n_ctx, ctx = self.scheduler.n_ctx_slot, self.engine.ctx
        if n_tokens >= n_ctx:
            raise P.ApiError(400, f"the {what} has {'at least ' if at_least else ''}{n_tokens} tokens but a slot's "
                             f"context holds {n_ctx - 1} (-c {ctx.n_ctx} split across {ctx.n_seq} "
                             f"slots): shorten the {what}, raise -c or lower -np", "exceed_context_size_error")

    def make_job(self, req: P.GenerationFields, tokens: list[int], n_predict: int | None) -> Job:
        n_slots = len(self.scheduler.slots)
        if req.id_slot >= n_slots:
            raise P.ApiError(400, f"id_slot {req.id_slot} does not exist ({n_slots} slots)", param="id_slot")
        sampling = req.to_sampling(self.settings.sampling)
        spec = req.to_spec(self.spec, self.loaded)
        n_predict = self.settings.n_predict if n_predict is None else n_predict
        return Job(prompt=tokens, sampling=sampling, n_predict=n_predict, spec=spec, stop=req.stops(),
                   cache_prompt=req.cache_prompt, id_slot=req.id_slot,
                   settings=P.generation_settings(req, sampling, n_predict, spec, self.spec, self.loaded))

    # --- job -> events ----------------------------------------------------------------------------------------

    async def submit(self, job: Job, request: Request) -> tuple[Task, Delta | Completion, asyncio.Future]:
        """Queue the job and wait for its first event (so errors still get a status code); returns the task,
        that event and the disconnect watcher."""
        try:
            task = self.scheduler.submit(job)
        except SpecCliError as e:
            raise P.ApiError(503, str(e), "unavailable_error") from None
        gone = asyncio.ensure_future(disconnected(request))
        try:
            first = await self.next_event(task, gone)
        except BaseException:
            gone.cancel()
            raise
        return task, first, gone

    async def next_event(self, task: Task, gone: asyncio.Future):
        get = asyncio.ensure_future(task.next_event())
        done, _ = await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
        if get not in done:
            get.cancel()
            self.scheduler.cancel(task)
            raise ClientGone
        event = get.result()
        if isinstance(event, Failure):
            raise P.ApiError(event.status, event.message, event.type)
        return event

    async def run_to_end(self, job: Job, request: Request) -> Completion:
        task, event, gone = await self.submit(job, request)
        try:
            while not isinstance(event, Completion):
                event = await self.next_event(task, gone)
            return event
        finally:
            gone.cancel()

    async def stream(self, job: Job, request: Request, render, prefix: tuple = ()) -> StreamingResponse:
        """SSE: the `prefix` payloads, then `render(event)`'s payloads for each event (None = `[DONE]`)."""
        task, first, gone = await self.submit(job, request)
        gone.cancel()  # from here Starlette watches the connection and cancels the generator below

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
                self.scheduler.cancel(task)

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def openai_reply(self, req: P.OpenAIFields, job: Job, request: Request, chat: bool):
        """/v1/completions' or /v1/chat/completions' answer: one body, or OpenAI's chunks."""
        cid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        if not req.stream:
            c = await self.run_to_end(job, request)
            choice = P.chat_choice(c.text, c.finish_reason) if chat else P.text_choice(c.text, c.finish_reason)
            return P.completion_body(cid, created, self.model_id, choice, final=c, chat=chat)
        usage_chunk = bool(req.stream_options and req.stream_options.include_usage)
        choice_of = (lambda text, reason: P.chat_delta({"content": text} if text else {}, reason)) if chat \
            else P.text_choice

        def body(choice, final=None):
            return P.completion_body(cid, created, self.model_id, choice, final=final, chunk=True, chat=chat,
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
        return await self.stream(job, request, render, prefix)


def sse(payload) -> str:
    """One server-sent event: the payload as JSON, or `[DONE]` for None."""
    return "data: " + (json.dumps(payload) if payload is not None else "[DONE]") + "\n\n"


async def disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body was already read, so receive() waits for it)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def metric_values(s: Scheduler) -> list[tuple[str, str, str, object]]:
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
