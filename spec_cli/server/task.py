"""One request's life as the engine thread sees it: a Job comes in, Delta pieces and one Completion (or a
Failure) go out to the route's asyncio queue, and StopText turns tokens into text with stop strings applied.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from spec_cli.model.sampling import SamplingParams
from spec_cli.runtime.generate import SpecOverrides
from spec_cli.text.tokenizer import Tokenizer


@dataclass
class Job:
    """One prompt to complete, as a route hands it over."""

    prompt: list[int]
    sampling: SamplingParams
    n_predict: int = -1  # -1 = until end of generation or the slot's context end; 0 = prompt only
    spec: SpecOverrides | None = None  # None = the server's speculation settings
    stop: list[str] = field(default_factory=list)
    cache_prompt: bool = True
    id_slot: int = -1  # -1 = any slot
    settings: dict = field(default_factory=dict)  # generation settings echoed in responses and /slots


@dataclass
class Delta:
    """New text (after stop-string hold-back) and the tokens it came from."""

    text: str
    tokens: list[int]


@dataclass
class Failure:
    message: str
    status: int = 500
    type: str = "server_error"


@dataclass
class Completion:
    """The end of one request: everything the response bodies and timings need."""

    text: str
    tokens: list[int]
    finish_reason: str  # "stop" (end of generation or stop string) | "length" (n_predict or context end)
    stop_type: str  # llama.cpp: "eos" | "word" | "limit"
    stopping_word: str
    id_slot: int
    n_prompt: int  # prompt tokens, cached ones included
    n_cached: int  # prompt tokens reused from the slot's KV cache
    n_predicted: int
    n_drafted: int
    n_accepted: int
    t_prompt_ms: float
    t_gen_ms: float
    settings: dict

    def timings(self) -> dict:
        """llama-server's `timings` object; the draft fields only when something was drafted."""
        n_eval = self.n_prompt - self.n_cached
        out = {
            "cache_n": self.n_cached,
            "prompt_n": n_eval,
            "prompt_ms": self.t_prompt_ms,
            "prompt_per_token_ms": _per_token(self.t_prompt_ms, n_eval),
            "prompt_per_second": _per_second(n_eval, self.t_prompt_ms),
            "predicted_n": self.n_predicted,
            "predicted_ms": self.t_gen_ms,
            "predicted_per_token_ms": _per_token(self.t_gen_ms, self.n_predicted),
            "predicted_per_second": _per_second(self.n_predicted, self.t_gen_ms),
        }
        if self.n_drafted > 0:
            out.update(draft_n=self.n_drafted, draft_n_accepted=self.n_accepted)
        return out


def _per_token(ms: float, n: int) -> float:
    return ms / n if n > 0 else 0.0


def _per_second(n: int, ms: float) -> float:
    return 1e3 * n / ms if ms > 0 else 0.0


class StopText:
    """A request's detokenized output with stop strings applied (llama.cpp server `find_stopping_strings`):
    the text ends before the first stop string found, and a tail that could still grow into one is held back."""

    def __init__(self, tokenizer: Tokenizer, stops: list[str]):
        self.decoder = tokenizer.stream(special=False)
        self.stops = [s for s in stops if s]
        self.text = ""
        self.sent = 0  # characters already handed to the client
        self.stopping_word = ""

    def push(self, token: int) -> bool:
        """Append one token's text; True when it completed a stop string (the text is cut there)."""
        return self._append(self.decoder.push(token))

    def flush(self) -> bool:
        return self._append(self.decoder.flush())

    def take(self, final: bool) -> str:
        """The text that is safe to send now: everything at the end, else all but a possible stop prefix."""
        end = len(self.text) if final or self.stopping_word else len(self.text) - self._partial()
        out = self.text[self.sent : end]
        self.sent = max(self.sent, end)
        return out

    def _append(self, piece: str) -> bool:
        if not piece:
            return False
        start = len(self.text)
        self.text += piece
        hit = -1
        for stop in self.stops:
            i = self.text.find(stop, max(0, start - len(stop) + 1))
            if i >= 0 and (hit < 0 or i < hit):
                hit, self.stopping_word = i, stop
        if hit >= 0:
            self.text = self.text[:hit]
            return True
        return False

    def _partial(self) -> int:
        """Length of the longest text suffix that is a proper prefix of some stop string."""
        best = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(self.text)), best, -1):
                if self.text.endswith(stop[:k]):
                    best = k
                    break
        return best


class Task:
    """One submitted job: the route's side (event queue, cancel flag) and the engine thread's progress."""

    def __init__(self, task_id: int, job: Job, loop: asyncio.AbstractEventLoop, tokenizer: Tokenizer):
        self.id = task_id
        self.job = job
        self.loop = loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = False
        self.out = StopText(tokenizer, job.stop)
        self.tokens: list[int] = []  # tokens handed to the client
        self.n_cached = 0
        self.t_admit: tuple[float, float] | None = None  # compiled.clock() when its prompt was admitted
        self.t_start: tuple[float, float] | None = None  # compiled.clock() when its generation began
        self.t_prompt_ms = 0.0

    def post(self, event) -> None:
        """Called from the engine thread: queue an event for the route's coroutine."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is gone (server shutting down)
            pass

    async def next_event(self):
        return await self.events.get()


def settle(future: asyncio.Future, fn) -> None:
    """Run fn() here (the engine thread) and settle an event loop's future with its result or exception."""
    try:
        result, error = fn(), None
    except Exception as e:  # noqa: BLE001 - whatever it raised is the caller's answer
        result, error = None, e

    def set_it() -> None:
        if future.done():  # the caller went away
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    try:
        future.get_loop().call_soon_threadsafe(set_it)
    except RuntimeError:  # the event loop is gone (server shutting down)
        pass
