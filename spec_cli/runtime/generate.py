"""The step loop every command shares (llama.cpp speculative-simple / server loop, ARCHITECTURE.md §3).

Per step, for all active sequences at once: draft budget -> one chain.draft call -> ONE target decode holding
[id_last] + draft of every sequence -> verify per sequence -> roll back the rejected tail (seq_rm on the
target; drafters trim their own contexts) -> chain.accept -> emit tokens, stop conditions checked per token.
`id_last` is the last token sampled by the target and is never in the KV cache until the next decode.
With an adaptive planner (--draft-max auto, speculative/adaptive.py) the planner caps what each drafter may draft,
each draft is cut to its planned length before the verify batch, and acceptance and timings flow back to it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from spec_cli.errors import SpecCliError
from spec_cli.model.batch import Batch
from spec_cli.model.compiled import clock, run_seconds
from spec_cli.model.context import Context
from spec_cli.model.sampling import Sampler, SamplingParams
from spec_cli.options import DRAFT_MAX, default
from spec_cli.speculative.adaptive import Planner
from spec_cli.speculative.base import DraftParams
from spec_cli.speculative.chain import Chain
from spec_cli.speculative.verify import choose_mode, verify_match, verify_rejection


@dataclass
class SpecOverrides:
    """Per-sequence speculation settings (server per-request control); None fields use the engine's."""

    enabled: bool = True
    n_max: int | None = None
    n_min: int | None = None
    p_min: float | None = None
    types: set[str] | None = None


@dataclass
class Sequence:
    """One sequence being generated."""

    seq: int
    tokens: list[int]  # committed tokens (prompt + accepted), excluding id_last; tokens[i] is at position i
    sampler: Sampler
    n_predict: int  # -1 = until EOG or context end
    spec: SpecOverrides = field(default_factory=SpecOverrides)
    id_last: int = -1
    n_generated: int = 0
    n_prompt: int = 0
    finish_reason: str | None = None  # "stop" (EOG), "length" (n_predict or context end), or set by the caller
    # counters of this sequence (the server's per-request timings)
    n_drafted: int = 0
    n_accepted: int = 0
    n_steps: int = 0

    @property
    def n_past(self) -> int:
        return len(self.tokens)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


@dataclass
class Prompt:
    """A prompt admitted into the steps (`Generator.admit`), decoded a chunk per step."""

    seq: int
    prompt: list[int]
    sampling: SamplingParams
    n_predict: int
    spec: SpecOverrides
    n_done: int  # its tokens in the KV cache


@dataclass
class Emitted:
    seq: int
    tokens: list[int]  # new tokens for the caller (EOG excluded)
    from_draft: list[bool]  # per token: it was an accepted draft token
    done: bool


@dataclass
class Timings:
    t_prompt_ms: float = 0.0  # prompts prefilled by `start` (an admitted prompt's rows are timed with the steps)
    n_prompt: int = 0
    t_gen_ms: float = 0.0
    n_gen: int = 0
    t_draft_ms: float = 0.0
    t_verify_ms: float = 0.0  # target decode of the verify batches
    t_accept_ms: float = 0.0  # verification + rollback + drafter accept
    n_steps: int = 0  # target decodes after the prompt
    t_calibrate_ms: float = 0.0  # --draft-max auto's one-time verify-cost calibration (not generation)
    t_compile_ms: float = 0.0  # torch.compile's compiles inside the prompt and the steps, left out of their times


def _ms(start: tuple[float, float], end: tuple[float, float]) -> float:
    """A span's run time in ms (compiled.run_seconds: less the compiling inside it)."""
    return run_seconds(start, end) * 1000


def _compile_ms(start: tuple[float, float], end: tuple[float, float]) -> float:
    return (end[1] - start[1]) * 1000


class Generator:
    """Bookkeeping over the target context, the tokenizer's end-of-generation ids and the drafter chain."""

    def __init__(self, target: Context, eog_ids: set[int], chain: Chain | None = None,
                 draft_max: int = DRAFT_MAX, verify: str = default("spec_verify"), planner: Planner | None = None):
        self.target = target
        self.eog_ids = eog_ids
        self.chain = chain
        self.draft_max = draft_max
        self.verify = verify
        self.planner = planner if chain is not None else None
        # seq -> (winner, first token cut off, had probs, the confidences of the draft up to it)
        self.cut_heads: dict[int, tuple[str, int, bool, list[float]]] = {}
        self.active: dict[int, Sequence] = {}
        self.prompts: dict[int, Prompt] = {}  # admitted prompts on their way into the KV cache, oldest first
        self.timings = Timings()

    # --- prompt ------------------------------------------------------------------------------------------

    def admit(self, seq: int, prompt: list[int], sampling: SamplingParams, n_predict: int = -1,
              spec: SpecOverrides | None = None, n_cached: int = 0) -> None:
        """Take `prompt` for sequence `seq` (its first `n_cached` tokens already in the KV cache) into the steps:
        from the next `step` on its rows ride after the other sequences' verify rows, as many per step as the
        ubatch has room for, and the step that decodes its last row emits its first token (llama-server's
        continuous batching: a long prompt no longer stops the other slots)."""
        ctx = self.target
        if not prompt:
            raise SpecCliError("empty prompt")
        if len(prompt) >= ctx.n_ctx_seq:
            raise SpecCliError(f"prompt is too long ({len(prompt)} tokens, the context holds {ctx.n_ctx_seq - 1})")
        n_cached = min(n_cached, len(prompt) - 1)
        ctx.seq_rm(seq, n_cached)
        self.prompts[seq] = Prompt(seq, list(prompt), sampling, n_predict, spec or SpecOverrides(), n_cached)

    def start(self, seq: int, prompt: list[int], sampling: SamplingParams, n_predict: int = -1,
              spec: SpecOverrides | None = None, n_cached: int = 0) -> Emitted:
        """Prefill `prompt` on sequence `seq` now, in chunks of n_batch rows (its first `n_cached` tokens already
        in the KV cache), and sample the first token. No other prompt may be admitted meanwhile."""
        if self.prompts:
            raise SpecCliError(f"sequences {list(self.prompts)} have prompts admitted into the steps")
        t0 = clock()
        self.admit(seq, prompt, sampling, n_predict, spec, n_cached)
        n_prompt = len(prompt) - self.prompts[seq].n_done
        first: list[Emitted] = []
        while not first:
            batch = Batch()
            taken = self._add_prompt_rows(batch, self.target.n_batch)
            out = self.target.decode(batch)
            if self.chain:
                self.chain.process(batch)
            first = self._advance_prompt(taken, out.logits)
        t1 = clock()
        self.timings.t_prompt_ms += _ms(t0, t1)
        self.timings.t_compile_ms += _compile_ms(t0, t1)
        self.timings.n_prompt += n_prompt
        return first[0]

    def holds(self, seq: int) -> bool:
        """Whether sequence `seq` is generating or has a prompt admitted."""
        return seq in self.active or seq in self.prompts

    def drop_prompt(self, seq: int) -> list[int]:
        """Forget an admitted prompt before its first token (its client went away): -> the tokens its KV cache
        holds by now."""
        p = self.prompts.pop(seq)
        return p.prompt[: p.n_done]

    # --- one step for every active sequence ---------------------------------------------------------------

    def step(self) -> list[Emitted]:
        """One draft-verify step of every active sequence, with the next rows of the admitted prompts (`admit`):
        their first tokens come among the emitted ones."""
        seqs = [s for s in self.active.values() if not s.done]
        if not seqs and not self.prompts:
            return []
        if seqs and self.planner is not None and not self.planner.costs.calibrated:
            t = time.perf_counter()
            self.planner.costs.calibrate(self.target, seqs[0].seq)  # once per engine, at a real depth
            self.timings.t_calibrate_ms += (time.perf_counter() - t) * 1000
        t0 = clock()
        params = self._draft(seqs)
        t1 = clock()
        batch = Batch()
        rows: dict[int, int] = {}
        for s in seqs:
            rows[s.seq] = len(batch)
            draft = params[s.seq].result if s.seq in params else []
            for i, tok in enumerate([s.id_last] + draft):
                batch.add(tok, s.n_past + i, s.seq, True)
        taken = self._add_prompt_rows(batch, self._prompt_room(len(batch))) if self.prompts else None
        out = self.target.decode(batch)
        if self.chain:
            self.chain.process(batch)
        t2 = clock()
        emitted = []
        for s in seqs:
            p = params.get(s.seq)
            draft = p.result if p else []
            logits = out.logits[rows[s.seq] : rows[s.seq] + 1 + len(draft)]
            ids = self._verify(s, logits, draft, p.probs if p else None)
            n_acc = len(ids) - 1
            self.target.seq_rm(s.seq, s.n_past + len(ids))  # keep id_last + accepted drafts
            if self.chain and p is not None:
                if self.planner is not None:
                    self._observe_acceptance(s, len(draft), ids, p.confidence)
                self.chain.accept(s.seq, len(draft), n_acc)
            s.n_steps += 1
            s.n_drafted += len(draft)
            s.n_accepted += n_acc
            s.tokens.append(s.id_last)
            s.tokens.extend(ids[:-1])
            emitted.append(self._emit(s, ids, n_acc))
        emitted += self._advance_prompt(taken, out.logits)
        t3 = clock()
        if self.planner is not None and taken is None:  # prompt rows would teach the verify-cost curve a prefill's
            self.planner.observe_step(self.target.step_rows(batch), run_seconds(t1, t3))
        tm = self.timings
        tm.t_draft_ms += _ms(t0, t1)
        tm.t_verify_ms += _ms(t1, t2)
        tm.t_accept_ms += _ms(t2, t3)
        tm.t_gen_ms += _ms(t0, t3)
        tm.t_compile_ms += _compile_ms(t0, t3)
        tm.n_steps += 1
        return emitted

    def _prompt_room(self, n_verify: int) -> int:
        """Prompt rows a step of `n_verify` verify rows takes: what the ubatch leaves, at least one (a prompt moves
        on beside any drafts), within n_batch."""
        return min(max(self.target.n_ubatch - n_verify, 1), self.target.n_batch - n_verify)

    def _add_prompt_rows(self, batch: Batch, room: int) -> tuple[Prompt, int] | None:
        """Append the next rows of the oldest admitted prompt, `room` at most (its last row flagged for logits):
        -> (the prompt, its rows in the batch), None without one. One prompt a step: a second one's rows in the
        same forward would hold back the first one's first token by their time (a 250-token prompt: 1.5 s on
        qwen2.5-coder-1.5b, 2 threads) to save the second one a step's fixed cost (a few 10 ms)."""
        p = next(iter(self.prompts.values()), None)
        n = min(room, len(p.prompt) - p.n_done) if p is not None else 0
        if n <= 0:
            return None
        for pos in range(p.n_done, p.n_done + n):
            batch.add(p.prompt[pos], pos, p.seq, pos == len(p.prompt) - 1)
        return p, n

    def _advance_prompt(self, taken: tuple[Prompt, int] | None, logits: torch.Tensor) -> list[Emitted]:
        """After the decode of a batch that ended with the `taken` prompt rows (`logits`: its flagged rows): the
        prompt moves on, and where its last row was in it, it becomes an active sequence with its first token."""
        if taken is None:
            return []
        p, n = taken
        p.n_done += n
        if p.n_done < len(p.prompt):
            return []
        return [self._first_token(self.prompts.pop(p.seq), logits[-1])]

    def _first_token(self, p: Prompt, logits: torch.Tensor) -> Emitted:
        sampler = Sampler(p.sampling, self.target.config.n_vocab, logits.device, eog_ids=sorted(self.eog_ids))
        for tok in p.prompt:
            sampler.accept(tok)
        s = Sequence(p.seq, p.prompt, sampler, p.n_predict, p.spec, n_prompt=len(p.prompt))
        first = sampler.sample(logits)
        sampler.accept(first)
        self.active[p.seq] = s
        if self.chain:
            self.chain.begin(p.seq, s.tokens)
        return self._emit(s, [first], 0)

    def finish(self, seq: int, reason: str = "stop") -> None:
        """Drop a sequence (finished, cancelled, client gone); its KV cells are reused by the next request."""
        s = self.active.pop(seq, None)
        if s is None:
            return
        if s.finish_reason is None:
            s.finish_reason = reason
        if self.chain:
            self.chain.end(seq, s.tokens[s.n_prompt:] + [s.id_last])

    # --- internals ---------------------------------------------------------------------------------------

    def _draft(self, seqs: list[Sequence]) -> dict[int, DraftParams]:
        if not self.chain:
            return {}
        params: dict[int, DraftParams] = {}
        for s in seqs:
            if not s.spec.enabled:
                continue
            n_max = s.spec.n_max if s.spec.n_max is not None else self.draft_max
            n_max = min(n_max, self.target.n_ctx_seq - s.n_past - 2)
            if s.n_predict >= 0:
                n_max = min(n_max, s.n_predict - s.n_generated - 1)
            if n_max > 0:
                sample = self.verify != "match" and not s.sampler.params.greedy
                params[s.seq] = DraftParams(s.seq, n_max, s.n_past, s.id_last, s.tokens, n_min=s.spec.n_min,
                                            p_min=s.spec.p_min, sampling=s.sampler.params if sample else None)
        if params:
            enabled = None
            if any(s.spec.types is not None for s in seqs):
                every = set(self.chain.names)
                enabled = {s.seq: every if s.spec.types is None else s.spec.types for s in seqs}
            caps = (self.planner.drafting_caps(self.chain.names, len(seqs), self.chain.free_names)
                    if self.planner is not None else None)
            spent = self.chain.draft(list(params.values()), enabled, caps,
                                     frozenset(self.planner.shadowing) if self.planner is not None else frozenset())
            if self.planner is not None:
                self._cut_to_plan(seqs, params, spent)
        return params

    def _cut_to_plan(self, seqs: list[Sequence], params: dict[int, DraftParams], spent: dict[str, float]) -> None:
        """Adaptive draft length: cut every draft to its planned length (the chain told the planner what drafting
        cost)."""
        winners = [self.chain.winner(s.seq) for s in seqs]
        lengths = [len(params[s.seq].result) if s.seq in params else 0 for s in seqs]
        confidences = [params[s.seq].confidence if s.seq in params else [] for s in seqs]
        plan = self.planner.plan(list(zip(winners, lengths)), sum(spent.values()), confidences)
        for s, w, n, k in zip(seqs, winners, lengths, plan):
            if k < n:
                p = params[s.seq]
                draft, confidence, had_probs = list(p.result), list(p.confidence), p.probs is not None
                self.chain.cut(p, k)  # to k tokens, or to none below the drafter's minimum
                self.cut_heads[s.seq] = (w, draft[len(p.result)], had_probs, confidence[: len(p.result) + 1])

    def _observe_acceptance(self, s: Sequence, n_verified: int, ids: list[int], confidence: list[float]) -> None:
        """Tell the planner how this step's drafts for `s` fared. Where verification is by match, a draft token
        is accepted exactly when it equals the token the target commits at its position, so drafts are also
        scored against the committed tokens `ids` where they were not verified: the first token the plan cut
        off a draft whose verified tokens were all accepted (against the target's own next token), and the
        drafts of shadowed drafters (`Planner.shadowing`). Without the first, a position beyond the plan's
        length is never tried again: one rejection there, or a pessimistic prior, keeps the plan short for good
        (ngram-cache on code edits: 1-token drafts, 99 % accepted, for dozens of steps)."""
        n_acc = len(ids) - 1
        head = self.cut_heads.pop(s.seq, None)
        winner = self.chain.winner(s.seq)
        if head is not None and n_acc == n_verified and self._matched(s, head[2]):
            name, token, _, head_confidence = head
            self.planner.observe_accept(name, n_verified + 1, n_acc + (token == ids[-1]), head_confidence)
        elif winner is not None:
            self.planner.observe_accept(winner, n_verified, n_acc, confidence)
        if self._matched(s, False):
            for name, draft in self.chain.shadows.get(s.seq, ()):
                n = min(len(draft), len(ids))
                self.planner.observe_shadow(name, n, next((i for i in range(n) if draft[i] != ids[i]), n))

    def _matched(self, s: Sequence, has_probs: bool) -> bool:
        """Whether a draft (with draft probabilities or not) of `s` is verified by match."""
        return choose_mode(self.verify, has_probs, s.sampler.params.greedy) == "match"

    def _verify(self, s: Sequence, logits, draft: list[int], draft_probs) -> list[int]:
        mode = choose_mode(self.verify, draft_probs is not None, s.sampler.params.greedy)
        if mode == "rejection" and draft:
            n_vocab = logits.shape[-1]
            if draft_probs is not None and draft_probs.shape[-1] != n_vocab:  # draft vocab may differ by <= 128 rows
                draft_probs = torch.nn.functional.pad(draft_probs[:, :n_vocab], (0, max(0, n_vocab - draft_probs.shape[-1])))
            return verify_rejection(s.sampler, logits, draft, draft_probs)
        return verify_match(s.sampler, logits, draft)

    def _emit(self, s: Sequence, ids: list[int], n_acc: int) -> Emitted:
        """Commit-side bookkeeping: id_last, stop conditions per token (a stop inside an accepted run truncates it)."""
        out, flags = [], []
        s.id_last = ids[-1]
        for i, tok in enumerate(ids):
            if tok in self.eog_ids and not s.sampler.params.ignore_eos:
                s.finish_reason = "stop"
                break
            out.append(tok)
            flags.append(i < n_acc)
            s.n_generated += 1
            if s.n_predict >= 0 and s.n_generated >= s.n_predict:
                s.finish_reason = "length"
                break
        if s.finish_reason is None and s.n_past >= self.target.n_ctx_seq:
            s.finish_reason = "length"  # id_last would not fit in the context
        self.timings.n_gen += len(out)
        return Emitted(s.seq, out, flags, s.done)


def generate(gen: Generator, prompt: list[int], sampling: SamplingParams, n_predict: int = -1, seq: int = 0,
             on_emit=None, spec: SpecOverrides | None = None, n_cached: int = 0) -> Sequence:
    """Generate one sequence to the end; `on_emit(Emitted)` streams tokens as they are committed."""
    first = gen.start(seq, prompt, sampling, n_predict, spec, n_cached)
    s = gen.active[seq]
    if on_emit:
        on_emit(first)
    while not s.done:
        for e in gen.step():
            if on_emit:
                on_emit(e)
    gen.finish(seq)
    return s
