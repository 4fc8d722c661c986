"""The engine thread behind the HTTP routes (llama-server's `server_context::update_slots` + its task queue).

One thread owns the Session (the engine with its drafter chain) and its Generator. Routes `submit` a Job and read the task's asyncio queue; nothing
else touches the model. Each of the `-np` slots is one sequence id of the one target Context (n_ctx split
across them). The loop, between generation steps:

  1. admits queued jobs into free slots, oldest first (a job pinned to a busy slot with `id_slot` waits
     without holding back the others); an unpinned job takes the free slot whose cached tokens share the
     longest prefix with its prompt, else the least recently used one (llama.cpp's slot selection);
  2. hands each admitted prompt to the generator (`gen.admit`), reusing that common prefix of the KV cache
     (`cache_prompt`);
  3. runs ONE `gen.step()` for every active slot: one batched draft call and one target decode for all of them,
     the oldest admitted prompt's next rows in the same decode (as many as the ubatch, -ub, has room for beside
     the verify rows: llama.cpp's continuous batching), so a long prompt does not stop the other slots; a
     prompt's first token comes from the step that decodes its last row;
  4. detokenizes each slot's new tokens, applies stop strings, and hands the text to the request's event loop
     with `call_soon_threadsafe`. A disconnected client's task is dropped before the next step.
Work on the engine that is not a generation (a slot file saved or restored, a slot erased: slot_actions.py) is
`call`ed: it runs on this thread before the admissions of a round, between two steps.
Per-slot drafter state is reset by `chain.begin` when a prompt is in; the ngram-mod pool stays shared.
"""

from __future__ import annotations

import asyncio
import itertools
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from spec_cli.errors import SpecCliError
from spec_cli.model.compiled import clock, run_seconds
from spec_cli.runtime.generate import Emitted, Sequence
from spec_cli.runtime.session import Session
from spec_cli.server.task import Completion, Delta, Failure, Job, Task, settle


def _shutting_down() -> None:
    raise SpecCliError("server is shutting down")


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@dataclass
class Slot:
    id: int
    task: Task | None = None
    cached: list[int] = field(default_factory=list)  # tokens in this sequence's KV cache when idle
    t_last: float = 0.0  # when it last finished a task (least recently used goes first)
    last: Task | None = None  # the latest task, shown by /slots
    n_drafted: int = 0  # draft tokens verified for this slot's requests (/props)
    n_accepted: int = 0


@dataclass
class Counters:
    """Cumulative server counters behind /metrics (llama.cpp `server_metrics`)."""

    prompt_tokens: int = 0
    prompt_tokens_cached: int = 0
    prompt_ms: float = 0.0
    predicted_tokens: int = 0
    predicted_ms: float = 0.0
    n_tokens_max: int = 0  # the longest sequence seen (prompt + generated)
    n_steps: int = 0  # generation steps (one target decode each)
    busy_slot_steps: int = 0  # sum over steps of the slots that step served


class Scheduler:
    def __init__(self, session: Session):
        self.session = session  # renewed after an engine error; the engine and the spec settings stay
        self.engine = session.engine
        self.tokenizer = session.engine.tokenizer
        self.gen = session.generator()
        self.slots = [Slot(i) for i in range(self.engine.ctx.n_seq)]
        self.counters = Counters()
        self._pending: deque[Task] = deque()
        self._calls: deque[tuple[Callable[[], Any], asyncio.Future]] = deque()
        self._cond = threading.Condition()
        self._closed = False  # no new jobs (shutting down)
        self._stopping = False
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._run, name="spec-cli-engine", daemon=True)

    @property
    def n_ctx_slot(self) -> int:
        return self.engine.ctx.n_ctx_seq

    @property
    def n_deferred(self) -> int:
        return len(self._pending)

    @property
    def n_processing(self) -> int:
        return sum(s.task is not None for s in self.slots)

    @property
    def closed(self) -> bool:
        """Shutting down: new jobs are refused."""
        return self._closed

    @property
    def idle(self) -> bool:
        with self._cond:  # a job moves from the queue to a slot under the lock
            return not self._pending and not self.n_processing

    # --- route side (event loop thread) ------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Refuse new jobs; the queued and running ones go on."""
        with self._cond:
            self._closed = True

    def shutdown(self) -> None:
        """Stop the engine thread; the jobs it still had fail with a 503."""
        with self._cond:
            self._closed = self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    def submit(self, job: Job) -> Task:
        task = Task(next(self._ids), job, asyncio.get_running_loop(), self.tokenizer)
        with self._cond:
            if self._closed:
                raise SpecCliError("server is shutting down")
            self._pending.append(task)
            self._cond.notify()
        return task

    def call(self, fn: Callable[[], Any]) -> asyncio.Future:
        """Run fn() on the engine thread between two steps; the future (of the calling event loop) gets what it
        returns or raises."""
        future = asyncio.get_running_loop().create_future()
        with self._cond:
            if self._closed:
                raise SpecCliError("server is shutting down")
            self._calls.append((fn, future))
            self._cond.notify()
        return future

    def cancel(self, task: Task) -> None:
        """The client is gone: drop a queued task now, an active one before the next step. Idempotent."""
        with self._cond:
            task.cancelled = True
            if task in self._pending:
                self._pending.remove(task)
            self._cond.notify()

    # --- engine thread -------------------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and not self._pending and not self.n_processing and not self._calls:
                    self._cond.wait()
                if self._stopping:
                    break
                calls, self._calls = self._calls, deque()
            for fn, future in calls:
                settle(future, fn)
            with self._cond:
                admitted = self._admit()
            self._drop_cancelled()
            for task in admitted:
                self._guarded(self._start, task)
            if self.gen.active or self.gen.prompts:
                self._guarded(self._step)
        self._fail_all(Failure("server is shutting down", 503, "unavailable_error"))
        for _, future in self._calls:
            settle(future, _shutting_down)

    def _admit(self) -> list[Task]:
        """Move queued tasks into free slots, oldest first (call with the lock held)."""
        free = [s for s in self.slots if s.task is None]
        admitted = []
        for task in list(self._pending):
            if not free:
                break
            slot = self._pick_slot(task.job, free)
            if slot is None:
                continue  # pinned to a busy slot: it waits, the jobs behind it may go
            self._pending.remove(task)
            free.remove(slot)
            slot.task = slot.last = task
            admitted.append(task)
        return admitted

    @staticmethod
    def _pick_slot(job: Job, free: list[Slot]) -> Slot | None:
        if job.id_slot >= 0:
            return next((s for s in free if s.id == job.id_slot), None)
        lru = min(free, key=lambda s: s.t_last)
        if not job.cache_prompt:
            return lru
        best = max(free, key=lambda s: (common_prefix(s.cached, job.prompt), -s.t_last))
        return best if common_prefix(best.cached, job.prompt) > 0 else lru

    def _start(self, task: Task) -> None:
        slot, job = self._slot_of(task), task.job
        if task.cancelled:
            self._release(slot)
            return
        n_cached = common_prefix(slot.cached, job.prompt) if job.cache_prompt else 0
        task.n_cached = min(n_cached, len(job.prompt) - 1)
        slot.cached = []  # the KV cache of this sequence is about to change
        task.t_admit = clock()
        # n_predict 0 = evaluate the prompt only: sample one token and drop it
        n_predict = 1 if job.n_predict == 0 else job.n_predict
        try:
            self.gen.admit(slot.id, job.prompt, job.sampling, n_predict, job.spec, task.n_cached)
        except SpecCliError as e:
            self._release(slot)
            task.post(Failure(str(e), 400, "invalid_request_error"))

    def _step(self) -> None:
        emitted = self.gen.step()
        self.counters.n_steps += 1
        self.counters.busy_slot_steps += len(emitted)
        for e in emitted:
            task = self.slots[e.seq].task
            if task is None:
                continue
            if task.t_start is None:  # its prompt's first token
                self._prompt_done(task)
            self._deliver(task, e)

    def _prompt_done(self, task: Task) -> None:
        task.t_start = clock()
        task.t_prompt_ms = run_seconds(task.t_admit, task.t_start) * 1e3  # compiling a step shape is not its time
        c = self.counters
        c.prompt_tokens += len(task.job.prompt) - task.n_cached
        c.prompt_tokens_cached += task.n_cached
        c.prompt_ms += task.t_prompt_ms

    def _deliver(self, task: Task, e: Emitted) -> None:
        seq = self.gen.active[e.seq]
        new: list[int] = []
        stopped = False
        if task.job.n_predict != 0:
            for tok in e.tokens:
                new.append(tok)
                if task.out.push(tok):
                    stopped = True
                    break
        done = e.done or stopped
        if done and not stopped:
            stopped = task.out.flush()
        task.tokens.extend(new)
        text = task.out.take(final=done)
        if text or new:
            task.post(Delta(text, new))
        if done:
            self._finish(task, seq, "stop" if stopped else seq.finish_reason)

    def _finish(self, task: Task, seq: Sequence, reason: str) -> None:
        slot = self._slot_of(task)
        self.gen.finish(slot.id, reason)
        n_predicted, t_gen_ms = self._count_generation(task, seq)
        word = task.out.stopping_word
        result = Completion(
            text=task.out.text, tokens=task.tokens, finish_reason=reason,
            stop_type="word" if word else ("eos" if reason == "stop" else "limit"), stopping_word=word,
            id_slot=slot.id, n_prompt=len(task.job.prompt), n_cached=task.n_cached, n_predicted=n_predicted,
            n_drafted=seq.n_drafted, n_accepted=seq.n_accepted, t_prompt_ms=task.t_prompt_ms, t_gen_ms=t_gen_ms,
            settings=task.job.settings,
        )
        self._release(slot, seq.tokens)
        task.post(result)

    def _end_early(self, slot: Slot, reason: str) -> list[int]:
        """Ends a slot's generation, or its prompt's processing, before its end (the client went away, an error);
        returns the tokens its KV cache holds."""
        if slot.id in self.gen.prompts:
            return self.gen.drop_prompt(slot.id)
        seq = self.gen.active[slot.id]
        self._count_generation(slot.task, seq)
        self.gen.finish(slot.id, reason)
        return seq.tokens

    def _count_generation(self, task: Task, seq: Sequence) -> tuple[int, float]:
        """Adds a task's generation to the /metrics counters, whether it finished, was cancelled or failed; returns
        (tokens generated, generation ms)."""
        n_predicted = 0 if task.job.n_predict == 0 else seq.n_generated  # n_predict 0: the one token is dropped
        t_gen_ms = run_seconds(task.t_start, clock()) * 1e3 if task.t_start else 0.0  # 0: failed in its prefill
        c = self.counters
        c.predicted_tokens += n_predicted
        c.predicted_ms += t_gen_ms
        c.n_tokens_max = max(c.n_tokens_max, seq.n_past + 1)
        slot = self._slot_of(task)
        slot.n_drafted += seq.n_drafted
        slot.n_accepted += seq.n_accepted
        return n_predicted, t_gen_ms

    def _drop_cancelled(self) -> None:
        for slot in self.slots:
            task = slot.task
            if task is None or not task.cancelled or not self.gen.holds(slot.id):
                continue
            self._release(slot, self._end_early(slot, "cancelled"))

    def _release(self, slot: Slot, cached: list[int] | None = None) -> None:
        slot.cached = list(cached) if cached is not None else []
        slot.t_last = time.monotonic()
        with self._cond:
            slot.task = None

    def _slot_of(self, task: Task) -> Slot:
        return next(s for s in self.slots if s.task is task)

    def _guarded(self, fn, *args) -> None:
        """An unexpected engine error fails the requests in flight (500) instead of killing the thread."""
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 - the thread must survive any bug to keep serving
            traceback.print_exc(file=sys.stderr)
            self._fail_all(Failure(f"internal error: {type(e).__name__}: {e}"), pending=False)
            self._start_cold()

    def _start_cold(self) -> None:
        """After an unexpected error no cache can be trusted: every slot starts cold (queued jobs still run).
        The drafter counters carry over, so /metrics totals never go back."""
        self.session = self.session.renew(keep_stats=True)
        self.gen = self.session.generator()
        for slot in self.slots:
            slot.cached = []

    def _fail_all(self, failure: Failure, pending: bool = True) -> None:
        for slot in self.slots:
            task = slot.task
            if task is None:
                continue
            if self.gen.holds(slot.id):
                self._end_early(slot, "error")
            self._release(slot)
            task.post(failure)
        if pending:
            with self._cond:
                while self._pending:
                    self._pending.popleft().post(failure)

    # --- views for /slots and /metrics (read from the event loop thread; plain reads of engine-thread state) ----

    def slots_info(self) -> list[dict]:
        types = self.session.types
        out = []
        for slot in self.slots:
            task = slot.task or slot.last
            job = task.job if task else None
            processing = slot.task is not None
            seq = self.gen.active.get(slot.id) if processing else None
            n_decoded = len(task.tokens) if task else 0
            spec = job.spec if job else None
            out.append({
                "id": slot.id,
                "id_task": task.id if task else -1,
                "n_ctx": self.n_ctx_slot,
                "speculative": bool(types) and (spec is None or spec.enabled),
                "is_processing": processing,
                "n_prompt_tokens": len(job.prompt) if job else 0,
                "n_prompt_tokens_processed": len(job.prompt) - task.n_cached if job else 0,
                "n_prompt_tokens_cache": task.n_cached if task else 0,
                "n_cached_tokens": len(slot.cached),
                "params": job.settings if job else {"speculative.types": types},
                "next_token": [{
                    "has_next_token": processing,
                    "has_new_line": "\n" in task.out.text if task else False,
                    "n_remain": (job.n_predict - n_decoded) if job and job.n_predict >= 0 else -1,
                    "n_decoded": n_decoded,
                    "stopping_word": task.out.stopping_word if task else "",
                }],
                "prompt": self.tokenizer.decode(job.prompt, special=True) if job else "",
                "generated": task.out.text if task else "",
                "n_past": seq.n_past if seq else len(slot.cached),
            })
        return out

    def spec_totals(self) -> dict:
        """Pooled speculation counters of every drafter (chain statistics)."""
        st = self.session.pooled_stats()
        return {"draft_tokens": st.n_gen_tokens, "accepted_tokens": st.n_acc_tokens, "drafts": st.n_gen_drafts,
                "accepted_per_pos": st.n_acc_tokens_per_pos}
