"""The drafter interface (llama.cpp `common_speculative_impl`) and the parameters every drafter reads.

Lifecycle per sequence, as in llama.cpp's common/speculative.h:
  begin(seq, prompt)        once per request, after the prompt was prefilled
  process(batch)            after EVERY target decode (prompt chunks and verify batches)
  draft(params)             drafts for all sequences whose `drafting` flag is set, in one call
  accept(seq, n, is_other)  how many draft tokens the target accepted (bonus token not counted);
                            is_other=True when another drafter of the chain produced this step's draft
  end(seq, output)          optional: the request on seq is over; output = every token it generated (the last
                            sampled one included), for a drafter that learns across requests
  shorten(seq, n)           optional: the chain verifies only the first n tokens of this drafter's draft
                            (--draft-max auto); for drafters whose accept bookkeeping depends on the draft length
  catch_up(params)          optional: called just before draft(params) and timed apart from it, for a drafter that
                            brings a lagging cache up to date (the adaptive planner prices drafted tokens by draft())
  min_length(p)             optional: the shortest draft worth verifying; a draft the chain cuts shorter is dropped
  target_layers()           optional: the target layers whose inputs `process` reads (Context.features_of)
Slot files (the server's /slots/{id}?action=save|restore|erase, runtime/slot_file.py):
  save_state(seq)           what the drafter holds for sequence seq (and the shared state drafting it depends on) as
                            named numpy arrays, so that restore_state in a fresh process continues exactly as this one
  restore_state(seq, state, n_vocab)  puts it back (StateError for a state that does not fit: token ids must lie
                            within the target's n_vocab); after a StateError the caller forgets the sequence, so
                            a state found wrong half way is never used
  forget(seq)               drops what it holds for seq (the slot was erased: its target cache is empty)
  slot_info(seq)            a few counts for /props' per-slot state
`Drafter` declares every hook, the optional ones as no-ops; save_state / restore_state refuse (StateUnsupported) in a
drafter that does not implement them: a slot file without its state would continue differently, and silently (a
stateless drafter returns {} and ignores what it is given). A drafter type is made known to `--spec-type` by
`speculative.registry.register_drafter`. Drafters keep no statistics: the chain wraps every call with counters and
timers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from spec_cli.errors import SpecCliError
from spec_cli.model.batch import Batch
from spec_cli.model.state_arrays import State, ints, scalar, token_ids
from spec_cli.options import DRAFT_MAX, default, p_min_floor
from spec_cli.speculative.confidence import DraftGate, calibrated_gains


class StateUnsupported(SpecCliError):
    """A drafter that cannot save or restore its per-sequence state (a plugin's, without save_state)."""

    def __init__(self, name: str):
        super().__init__(f"drafter '{name}' does not implement save_state / restore_state (speculative/base.py "
                         "Drafter), so a slot restored from a file could not continue as it would have; a stateless "
                         "drafter returns {} from save_state and ignores what restore_state is given")


@dataclass
class SpecParams:
    """Speculation settings (llama.cpp's `common_params_speculative`, flag defaults per ARCHITECTURE.md)."""

    types: list[str] = field(default_factory=list)  # canonical names, e.g. ["ngram-mod", "draft-simple"]
    draft_max: int = DRAFT_MAX  # with `adaptive`, the upper bound of a draft (options.draft_bound)
    adaptive: bool = False  # --draft-max auto: each step's draft length is planned (speculative/adaptive.py)
    draft_min: int = default("draft_min")
    draft_p_min: float | str = default("draft_p_min")  # or auto (options.p_min_floor)
    draft_vocab: int = default("draft_vocab")  # draft-simple's output rows (speculative/draft_vocab.py); 0 = all
    verify: str = default("spec_verify")  # auto | match | rejection
    select: str = default("spec_select")  # priority | gain: how the chain picks a draft (speculative/chain.py)
    mtp_rollback: str = default("spec_mtp_rollback")  # partial | reeval (speculative/mtp.py)
    ngram_simple_size_n: int = default("ngram_simple_size_n")
    ngram_simple_size_m: int = default("ngram_simple_size_m")
    ngram_simple_min_hits: int = default("ngram_simple_min_hits")
    ngram_map_k_size_n: int = default("ngram_map_k_size_n")
    ngram_map_k_size_m: int = default("ngram_map_k_size_m")
    ngram_map_k_min_hits: int = default("ngram_map_k_min_hits")
    ngram_map_k4v_size_n: int = default("ngram_map_k4v_size_n")
    ngram_map_k4v_size_m: int = default("ngram_map_k4v_size_m")
    ngram_map_k4v_min_hits: int = default("ngram_map_k4v_min_hits")
    ngram_mod_n_match: int = default("ngram_mod_n_match")
    ngram_mod_n_min: int = default("ngram_mod_n_min")
    ngram_mod_n_max: int = default("ngram_mod_n_max")
    suffix_max_depth: int = default("suffix_max_depth")
    suffix_max_spec_factor: float = default("suffix_max_spec_factor")
    suffix_min_token_prob: float = default("suffix_min_token_prob")
    suffix_cache_tokens: int = default("suffix_cache_tokens")
    lookup_cache_static: str | None = None
    lookup_cache_dynamic: str | None = None


@dataclass
class DraftParams:
    """One sequence's draft request for one step (llama.cpp `common_speculative_draft_params`)."""

    seq: int
    n_max: int  # per-call cap (context space, remaining budget); the chain truncates to it
    pos0: int  # position of id_last = where the first verify row goes
    id_last: int  # last token sampled by the target; NOT yet in the KV cache
    prompt: list[int]  # every committed token of the sequence, excluding id_last (read-only)
    drafting: bool = True  # the chain clears it once a drafter produced a draft
    result: list[int] = field(default_factory=list)
    probs: torch.Tensor | None = None  # [len(result), n_vocab] draft distributions, model drafters only
    n_min: int | None = None  # per-request overrides of SpecParams.draft_min / draft_p_min (model drafters)
    p_min: float | None = None
    sampling: Any = None  # the target's SamplingParams when verification is by rejection: model drafters then
    #                       sample from their own filtered distribution and return it in `probs` (else greedy)
    crossed: tuple[int, int] | None = None  # a draft model with another vocabulary: (its draft tokens that had a
    #                                         counterpart in the target's, those that did not and ended the draft)
    confidence: list[float] = field(default_factory=list)  # a token-by-token model drafter's: per token of result,
    #                                                        its top-1 probability (speculative/confidence.py)
    gate: DraftGate | None = None  # --draft-max auto: where a token-by-token model drafter's draft stops paying

    def min_length(self, params: SpecParams) -> int:
        """Shortest draft a model drafter may hand in (this request's n_min, else --draft-min): shorter is dropped."""
        return self.n_min if self.n_min is not None else params.draft_min

    def p_floor(self, given: float | str) -> float:
        """The top-1 probability this draft stops below: the request's p_min, else `given` (--draft-p-min, or a
        drafter's own default), `auto` resolved by whether a gate stops it (options.p_min_floor)."""
        return p_min_floor(self.p_min if self.p_min is not None else given, self.gate is not None)

    def keeps(self, p_top: float, p_min: float) -> bool:
        """Whether a token-by-token model drafter keeps its next token, whose top-1 probability is p_top: not below
        p_min, and under a gate where it pays for its verify row."""
        return p_top >= p_min and (self.gate is None or self.gate.keeps(len(self.result) + 1, self._gain(p_top)))

    def add(self, token: int, p_top: float) -> None:
        self.result.append(token)
        self.confidence.append(p_top)

    def goes_on(self, cap: int) -> bool:
        """After a kept token: whether to draft another, below `cap` and where the gate says it pays."""
        n = len(self.result)
        return n < cap and (self.gate is None or self.gate.goes_on(n, self._gain()))

    def _gain(self, p_next: float | None = None) -> float:
        """The expected tokens of the draft's last token (or of a next one of top-1 probability p_next)."""
        confidences = self.confidence if p_next is None else (*self.confidence, p_next)
        return calibrated_gains(self.gate.rates, confidences)[-1] if confidences else 1.0

    def truncate(self, n: int) -> None:
        """Keep the first n tokens of the draft (with their confidences and distributions)."""
        del self.result[n:]
        del self.confidence[n:]
        if self.probs is not None:
            self.probs = self.probs[:n] if n else None


class Drafter:
    """Base of every drafter: the hooks the chain calls (module docstring), all but `draft` doing nothing here."""

    name: str  # the --spec-type it is registered under; the chain's statistics and the planner go by it
    # Drafting costs next to nothing (a lookup in the history). With --spec-select gain every cheap drafter proposes
    # and the best proposal wins; a drafter that pays a forward per drafted token is asked only where none proposed.
    cheap = True
    # A draft costs one forward whatever its length (a block drafter): the planner prices its drafting per call, not
    # per drafted token.
    per_call = False

    def target_layers(self) -> tuple[int, ...]:
        """The target layers whose inputs process() reads for every decoded row (target features on request: id
        n_layer is the final pre-norm state). The session has the target capture them while a chain holding this
        drafter lives (Context.set_taps); none, the default, costs nothing."""
        return ()

    def begin(self, seq: int, prompt: list[int]) -> None:
        pass

    def process(self, batch: Batch) -> None:
        pass

    def catch_up(self, params: list[DraftParams]) -> None:
        pass

    def draft(self, params: list[DraftParams]) -> None:
        """Set `result` (and for sampled drafts `probs`) of every p in params whose `drafting` flag is set."""
        raise NotImplementedError

    def min_length(self, p: DraftParams) -> int:
        """The shortest draft of p worth verifying: the chain drops a draft it cuts below this (--draft-max auto)."""
        return 0

    def shorten(self, seq: int, n: int) -> None:
        pass

    def accept(self, seq: int, n_accepted: int, is_other: bool) -> None:
        pass

    def end(self, seq: int, output: list[int]) -> None:
        pass

    def save_state(self, seq: int) -> State:
        raise StateUnsupported(self.name)

    def restore_state(self, seq: int, state: State, n_vocab: int) -> None:
        raise StateUnsupported(self.name)

    def forget(self, seq: int) -> None:
        pass

    def slot_info(self, seq: int) -> dict:
        return {}


class HistoryDrafter(Drafter):
    """Base of the drafters that draft each sequence on its own from its token history (the n-gram family):
    one `draft_one` per drafting sequence, truncated to its per-call cap."""

    def draft(self, params: list[DraftParams]) -> None:
        for p in params:
            if p.drafting:
                p.result = self.draft_one(p)[: max(p.n_max, 0)]

    def draft_one(self, p: DraftParams) -> list[int]:
        raise NotImplementedError


def check_own_context(name: str, what: str, ctx, target, n_seq: int) -> None:
    """A drafter's own context (`what`: its head's or drafter's) matches the target's: n_seq sequences, and at least
    as many positions per sequence."""
    if ctx.n_seq != n_seq or target.n_seq != n_seq:
        raise SpecCliError(f"{name}: the {what}'s context has {ctx.n_seq} sequences, the target {target.n_seq}, "
                           f"expected {n_seq}")
    if ctx.n_ctx_seq < target.n_ctx_seq:
        raise SpecCliError(f"{name}: the {what}'s context must hold as many positions per sequence as the target's")


class TargetCache:
    """What the target's KV cache holds, token by position per sequence, mirrored from the target batches a model
    drafter is shown (`process`): the history its own cache follows."""

    def __init__(self, n_seq: int) -> None:
        self.tokens: list[list[int]] = [[] for _ in range(n_seq)]
        self.batch_pos0 = [0] * n_seq  # first position of each sequence's rows in the last batch recorded
        # end of the settled rows of that batch: up to its first row with logits (id_last of a verify batch, a
        # prompt's last row); rows after it hold drafted tokens the target has not decided yet
        self.settled = [0] * n_seq

    def record(self, batch: Batch) -> dict[int, int | None]:
        """Mirror a target batch. Per sequence in it: the first position of its rows, or None where they start past
        the mirrored positions (the target's cache was filled without this drafter); that mirror is then emptied."""
        starts: dict[int, int | None] = {}
        for seq in dict.fromkeys(batch.seq_ids):
            rows = batch.rows_of(seq)
            p0, known = batch.pos[rows[0]], self.tokens[seq]
            if p0 > len(known):
                known.clear()
                starts[seq] = None
                continue
            del known[p0:]
            known.extend(batch.tokens[i] for i in rows)
            self.batch_pos0[seq] = p0
            flagged = next((batch.pos[i] for i in rows if batch.logits[i]), batch.pos[rows[-1]])
            self.settled[seq] = flagged + 1
            starts[seq] = p0
        return starts

    def save_state(self, seq: int) -> State:
        return {"tokens": ints(self.tokens[seq]), "batch_pos0": np.asarray(self.batch_pos0[seq]),
                "settled": np.asarray(self.settled[seq])}

    def restore_state(self, seq: int, state: State, n_vocab: int) -> None:
        known = token_ids(state, "tokens", n_vocab).tolist()
        pos0, settled = scalar(state, "batch_pos0"), scalar(state, "settled")
        self.tokens[seq], self.batch_pos0[seq], self.settled[seq] = known, pos0, settled

    def forget(self, seq: int) -> None:
        self.tokens[seq], self.batch_pos0[seq], self.settled[seq] = [], 0, 0
