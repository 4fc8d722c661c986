"""What draft-mtp and draft-eagle3 share: a one-layer head with its own KV (head_context.HeadContext) that reads, for
the row of the token at target position p, a feature of target position p - 1 (target features on request,
Context.set_taps), and drafts by feeding its own pre-norm output back (llama.cpp common/speculative.cpp).

Rows. A target batch t_a..t_b (positions a..b) gives head rows (t_a, f_{a-1}), (t_{a+1}, f_a), ..., (t_b, f_{b-1});
f_b, the feature of the last committed token, is held back until the next token is known (the seed row of the
next draft reads it). f is the head's transform of the tapped target layers (`feed_rows`). Head positions are
target positions minus `offset[seq]`, the target position of the head's first row: `lead` to start with (draft-mtp
0: its first row reads no feature, as an MTP layer's position 0 does; draft-eagle3 1: its first row is (t_1, g_0),
there is none for t_0), moved by restarts. The feed (HeadContext) holds the feature each row reads, so f_t lives at
feed index t + 1 - offset.

The prompt's head rows are decoded by `begin`, with the prompt (llama.cpp fills the draft layer's KV while it
processes the prompt): a short prompt's rows, deferred to the first draft, made that draft a 60-row head decode
(20-26 ms on qwen2.5-coder-1.5b, most of a target forward), paid at every request's first probe.
After that, head rows are not decoded in `process`: they are deferred (up to DEFER_MAX rows, like llama.cpp) and
decoded together with the next draft's seed rows, in one head decode; rows of rejected draft tokens are dropped by
`accept` before they cost anything (past DEFER_MAX, `process` decodes the backlog up to the verify batch's first
row, never the draft rows after it: TargetCache.settled). A sequence not asked for a draft in IDLE_STEPS target
decodes (the adaptive planner dropped the head) defers all its rows: an unused head costs nothing per step
(decoding every committed token's row, 64 at a time, kept draft-mtp at 0.96-0.97x of plain on free writing); asked
again, `catch_up` decodes the backlog from the features kept in the feed, outside the drafting time the planner
prices per token, and more than RESTART_WINDOW rows behind it restarts the head's KV from the last RESTART_WINDOW
committed positions (as draft-simple restarts its cache), so a probe after a long idle stretch costs a window, not
the whole stretch. The drafts change, not the output (the target verifies every token).
`n_done[seq]` = target positions [offset, n_done) whose head rows are final (built from committed tokens and target
features); everything past it in the head KV is draft scratch, trimmed before the next decode.

Rollback after a verify (`rollback`): the draft's head rows at pos0, pos0+1, ... hold (id_last, d_1, ...). The seed
row read the target's own feature, so it equals the row a catch-up would decode and is always kept. `partial` also
keeps the rows of accepted draft tokens, built from the head's own outputs instead of the target's features, and
drops only the rejected tail; `reeval` re-decodes the accepted rows from the target's features with the next draft
(the target's features overwrite the draft's rows by position). Both are lossless (the target verifies every token).

`draft`: seed row (id_last, the held-back feature) for every drafting sequence, behind their deferred rows; then one
batched head decode per draft position, each new row (token, the head's own pre-norm output of the previous row).
Top-1 of a top-k 10 softmax, stop below p_min or at the length cap; where verification is by rejection
(`DraftParams.sampling`) and the head `samples`, each token is drawn from the head's distribution under the target's
sampler settings instead, and those distributions (q, over the draft vocabulary mapped to target ids) are returned.

A slot file holds a sequence's head KV, the feed rows of its committed positions (the target's features: a restored
slot's prompt is never decoded again, so they exist nowhere else), the mirror of the target cache, offset, n_done,
the idle count and the last draft's rows; the sampling generator is not kept (each request starts its own).
"""

from __future__ import annotations

import numpy as np
import torch

from spec_cli.errors import SpecCliError, StateError
from spec_cli.model.batch import Batch
from spec_cli.model.context import Context
from spec_cli.model.head_context import HeadContext
from spec_cli.model.sampling import draft_generator, sample_restricted
from spec_cli.model.state_arrays import (
    State,
    array_of,
    copy_into,
    counters,
    entry,
    fits,
    ints,
    prefixed,
    scalar,
    within,
)
from spec_cli.speculative.base import Drafter, DraftParams, SpecParams, TargetCache, check_own_context
from spec_cli.speculative.draft_model import DRAFT_TOP_K, IDLE_STEPS, RESTART_WINDOW

DEFER_MAX = 64  # head rows kept back for the next draft decode before `process` decodes them itself


class HeadDrafter(Drafter):
    """The shared drafting loop; a subclass names the type and sets `lead`, `samples`, `target_layers`, `feed_rows`
    and `rollback`."""

    cheap = False
    lead = 0  # target position of the first head row (module docstring)
    samples = False  # draws sampled drafts (returns q) where verification is by rejection

    def __init__(self, ctx: HeadContext, target: Context, params: SpecParams, n_seq: int, n_max: int,
                 p_min: float | str):
        check_own_context(self.name, "head", ctx, target, n_seq)
        ctx.clear()  # a fresh drafter: no head row is final yet (n_done)
        self.ctx, self.target, self.params = ctx, target, params
        self.n_max, self.p_min = n_max, p_min
        self.target_cache = TargetCache(n_seq)  # target tokens by position (as in its KV)
        self.offset = [self.lead] * n_seq  # target position of head position 0
        self.n_done = list(self.offset)
        self.rows: dict[int, tuple[int, list[int]]] = {}  # seq -> (pos0, tokens) of the last draft's head rows
        self.lost: set[int] = set()  # sequences resumed past positions this drafter never processed
        self.idle = [0] * n_seq  # target decodes since the sequence last asked for a draft
        self.rng: list[torch.Generator | None] = [None] * n_seq  # per request, for sampled drafts

    # --- what a head type decides -------------------------------------------------------------------------

    def feed_rows(self, features: torch.Tensor) -> torch.Tensor:
        """The target's features of decoded rows [n, n_taps, D_t] (target_layers) -> what head rows read [n, D]."""
        raise NotImplementedError

    @property
    def rollback(self) -> str:
        """`partial` or `reeval` (module docstring)."""
        raise NotImplementedError

    # --- the drafter hooks ------------------------------------------------------------------------------------

    def begin(self, seq: int, prompt: list[int]) -> None:
        self.idle[seq] = 0
        self.rng[seq] = None
        if seq not in self.lost and self._backlog(seq) > 0:
            self._decode(self._catch_up(Batch(), [seq]))  # the prompt's rows, as part of its processing

    def process(self, batch: Batch) -> None:
        features = self.target.features_of(self.target_layers())  # [len(batch), n_taps, D_t], batch order
        if features.shape[0] != len(batch):
            raise SpecCliError(f"{self.name} needs the target's features of every decoded row (open the drafter "
                               "through a session.Session)")
        for seq, p0 in self.target_cache.record(batch).items():
            self._follow(seq, p0)
        keep = [i for i, (pos, seq) in enumerate(zip(batch.pos, batch.seq_ids)) if pos + 1 >= self.offset[seq]]
        self.ctx.set_feed([batch.seq_ids[i] for i in keep],
                          [batch.pos[i] + 1 - self.offset[batch.seq_ids[i]] for i in keep],
                          self.feed_rows(features[keep]))
        active = [seq for seq, idle in enumerate(self.idle) if idle <= IDLE_STEPS]
        if sum(self._backlog(seq) for seq in active) > DEFER_MAX:
            # settled rows only: the rest may be draft tokens the verify rejects (a 17-row ngram draft)
            until = {seq: self.target_cache.settled[seq] for seq in dict.fromkeys(batch.seq_ids)}
            self._decode(self._catch_up(Batch(), active, until))

    def _follow(self, seq: int, p0: int | None) -> None:
        """Bookkeeping for a target batch of `seq` starting at p0 (TargetCache.record's result)."""
        if seq in self.rows and p0 != self.rows[seq][0]:
            del self.rows[seq]  # not the verify batch of the draft: its head rows are scratch
        if p0 is None:
            # positions this drafter never saw (a KV cache filled without it): no drafts until a fresh start
            self.lost.add(seq)
            self._start_at(seq, self.lead)
            return
        if p0 == 0:
            self.lost.discard(seq)
            self._start_at(seq, self.lead)
        elif p0 < self.offset[seq]:
            # the target went back before the window (a cached prompt prefix): the feed no longer holds the features
            # before it, so the head restarts with the first row whose feature this batch brings
            self._start_at(seq, p0 + self.lead)
        self.n_done[seq] = max(self.offset[seq], min(self.n_done[seq], p0))
        self.idle[seq] += 1

    def _start_at(self, seq: int, offset: int) -> None:
        """An empty head KV for `seq` whose first row will be that of target position `offset`."""
        self.ctx.seq_rm(seq, 0)
        self.ctx.feed[seq, 0] = 0  # read by a first row that has no feature (lead 0)
        self.offset[seq] = self.n_done[seq] = offset

    def catch_up(self, params: list[DraftParams]) -> None:
        """Called by the chain before `draft`: the backlog of a sequence that was idle (from a window of the last
        RESTART_WINDOW positions where it is longer) or is more than DEFER_MAX rows behind, decoded apart from the
        draft, whose time the planner prices per drafted token."""
        behind = []
        for p in params:
            seq = p.seq
            if seq in self.lost:
                continue
            idle = self.idle[seq] > IDLE_STEPS
            if idle and self._backlog(seq) > RESTART_WINDOW:
                self._restart(seq, len(self.target_cache.tokens[seq]) - RESTART_WINDOW)
            if (idle and self._backlog(seq) > 0) or self._backlog(seq) > DEFER_MAX:
                behind.append(seq)
        if behind:
            self._decode(self._catch_up(Batch(), behind))

    def _restart(self, seq: int, offset: int) -> None:
        """Empty the head's KV of `seq` and move head position 0 to target position `offset`, keeping the features
        of the positions from offset - 1 on in the feed (the first row reads the one before it with lead 1; with
        lead 0 it reads none)."""
        shift = offset - self.offset[seq]
        feed = self.ctx.feed[seq]
        n = len(self.target_cache.tokens[seq]) - offset
        feed[: n + 1] = feed[shift : shift + n + 1].clone()
        self.ctx.seq_rm(seq, 0)
        if not self.lead:
            feed[0] = 0
        self.offset[seq] = self.n_done[seq] = offset

    def _backlog(self, seq: int) -> int:
        """Committed target rows whose head rows are not decoded yet."""
        return len(self.target_cache.tokens[seq]) - self.n_done[seq]

    def accept(self, seq: int, n_accepted: int, is_other: bool) -> None:
        # Same bookkeeping whoever drafted (is_other): the target kept id_last + n_accepted rows of the last batch,
        # so the held-back feature is that of verify row n_accepted and later rows are dropped.
        if seq in self.lost:
            return
        keep = self.target_cache.batch_pos0[seq] + n_accepted + 1
        tokens = self.target_cache.tokens[seq]
        del tokens[keep:]
        self.n_done[seq] = max(self.offset[seq], min(self.n_done[seq], keep), self._kept_rows(seq, tokens))
        self.ctx.seq_rm(seq, self.n_done[seq] - self.offset[seq])

    def _kept_rows(self, seq: int, tokens: list[int]) -> int:
        """End of the last draft's head rows that stay final: the seed row, and under partial rollback the rows of
        the accepted draft tokens (the leading rows whose token is the committed one); 0 without a draft."""
        pos0, drafted = self.rows.pop(seq, (0, []))
        if not drafted or self.n_done[seq] < pos0:
            return 0
        limit = len(drafted) if self.rollback == "partial" else 1
        n = 0
        while n < limit and pos0 + n < len(tokens) and tokens[pos0 + n] == drafted[n]:
            n += 1
        return pos0 + n

    def draft(self, params: list[DraftParams]) -> None:
        active: dict[int, DraftParams] = {}
        batch = Batch()
        self.rows = {}
        for p in params:
            self.idle[p.seq] = 0
            if p.seq in self.lost:
                continue
            n_processed = len(self.target_cache.tokens[p.seq])
            if n_processed != p.pos0:
                raise SpecCliError(f"{self.name}: sequence {p.seq} has {n_processed} processed positions, "
                                   f"the target {p.pos0} (a target decode was not passed to process)")
            if min(p.n_max, self.n_max) > 0:
                active[p.seq] = p
        self._catch_up(batch, active)
        for seq, p in active.items():
            batch.add(p.id_last, p.pos0 - self.offset[seq], seq, True)  # seed: reads the held-back feature
            self.rows[seq] = (p.pos0, [p.id_last])
        q_rows: dict[int, list[torch.Tensor]] = {seq: [] for seq in active}
        while active:
            logits, hidden = self._decode(batch)
            batch = self._next_rows(batch, logits, hidden, active, q_rows)
        for p in params:
            if len(p.result) < p.min_length(self.params):
                p.truncate(0)
            elif q_rows.get(p.seq) and p.result:
                p.probs = torch.stack(q_rows[p.seq])  # [len(result), n_vocab]

    def _next_rows(self, batch: Batch, logits: torch.Tensor, hidden: torch.Tensor, active: dict[int, DraftParams],
                   q_rows: dict[int, list[torch.Tensor]]) -> Batch:
        """One draft position for every active sequence from the flagged rows' logits: the token (top-1, or drawn
        for a sampled draft), the sequences that stop, and the next rows, each reading its sequence's pre-norm
        output of this position (set in the feed)."""
        flagged = [i for i, f in enumerate(batch.logits) if f]
        top = torch.topk(logits, min(DRAFT_TOP_K, logits.shape[-1]), dim=-1)
        p_top = torch.softmax(top.values, dim=-1)[:, 0].tolist()  # top-1 probability under the top-k softmax
        best = top.indices[:, 0]
        vocab = self.ctx.head.draft_vocab  # logits rows are draft-vocabulary entries when the head has one
        ids = (best if vocab is None else vocab[best]).tolist()
        step, fed_seqs, fed_pos, fed_rows = Batch(), [], [], []
        for k, i in enumerate(flagged):
            seq, pos = batch.seq_ids[i], batch.pos[i]
            p = active[seq]
            if not p.keeps(p_top[k], p.p_floor(self.p_min)):
                del active[seq]
                continue
            if self.samples and p.sampling is not None:
                if self.rng[seq] is None:
                    self.rng[seq] = draft_generator(p.sampling, logits.device)
                ids[k], q = sample_restricted(logits[k], vocab, self.target.config.n_vocab, p.sampling,
                                              self.rng[seq])
                q_rows[seq].append(q)
            p.add(ids[k], p_top[k])
            if not p.goes_on(min(p.n_max, self.n_max)):
                del active[seq]
                continue
            fed_seqs.append(seq)
            fed_pos.append(pos + 1)
            fed_rows.append(i)
            step.add(ids[k], pos + 1, seq, True)  # reads feed[seq, pos + 1]: the head's own output, set below
            self.rows[seq][1].append(ids[k])
        if fed_rows:
            self.ctx.set_feed(fed_seqs, fed_pos, hidden[fed_rows])
        return step

    def min_length(self, p: DraftParams) -> int:
        return p.min_length(self.params)

    # --- slot files ---------------------------------------------------------------------------------------------

    def save_state(self, seq: int) -> State:
        pos0, drafted = self.rows.get(seq, (0, None))
        n_feed = self._n_feed(len(self.target_cache.tokens[seq]), self.offset[seq])
        return {**prefixed("kv/", self.ctx.seq_state(seq)), "feed": array_of(self.ctx.feed[seq, :n_feed]),
                **prefixed("target/", self.target_cache.save_state(seq)),
                "counters": np.asarray([self.offset[seq], self.n_done[seq], self.idle[seq], int(seq in self.lost)]),
                "rows": ints([] if drafted is None else [pos0, *drafted])}

    def restore_state(self, seq: int, state: State, n_vocab: int) -> None:
        offset, n_done, idle, lost = counters(state, "counters", 4)
        rows, kv, feed = entry(state, "rows").tolist(), within(state, "kv/"), entry(state, "feed", None, 2)
        self.target_cache.restore_state(seq, within(state, "target/"), n_vocab)
        n_tokens = len(self.target_cache.tokens[seq])
        if not offset <= n_done <= max(n_tokens, offset) or scalar(kv, "length") < n_done - offset:
            raise StateError(f"head rows [{offset}, {n_done}) do not fit {n_tokens} target positions and the head KV")
        fits(self.ctx.feed[seq, :self._n_feed(n_tokens, offset)], feed, "feed")
        self.ctx.restore_seq(seq, kv)
        copy_into(self.ctx.feed[seq, :len(feed)], feed)
        self.offset[seq], self.n_done[seq], self.idle[seq], self.rng[seq] = offset, n_done, idle, None
        if lost:
            self.lost.add(seq)
        else:
            self.lost.discard(seq)
        self.rows.pop(seq, None)
        if rows:
            self.rows[seq] = (rows[0], rows[1:])

    def forget(self, seq: int) -> None:
        self.target_cache.forget(seq)
        self.rows.pop(seq, None)
        self.lost.discard(seq)
        self.idle[seq], self.rng[seq] = 0, None
        self._start_at(seq, self.lead)

    def slot_info(self, seq: int) -> dict:
        return {"n_kv": self.ctx.lengths[seq], "lost": seq in self.lost}

    def _n_feed(self, n_tokens: int, offset: int) -> int:
        """Feed rows that n_tokens committed positions read: f_t of target position t lives at t + 1 - offset."""
        return min(max(n_tokens - offset + 1, 0), self.ctx.feed.shape[1])

    def _catch_up(self, batch: Batch, seqs, until: dict[int, int] | None = None) -> Batch:
        """Add the deferred head rows of target positions [n_done, processed) of `seqs` to `batch` (after trimming
        draft scratch), or only up to `until[seq]` where given."""
        for seq in seqs:
            tokens, start, offset = self.target_cache.tokens[seq], self.n_done[seq], self.offset[seq]
            end = min(len(tokens), (until or {}).get(seq, len(tokens)))
            self.ctx.seq_rm(seq, start - offset)
            for pos in range(start, end):
                batch.add(tokens[pos], pos - offset, seq, False)
            self.n_done[seq] = max(start, end)
        return batch

    def _decode(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Head decode in n_batch slices -> (logits of flagged rows [n_flagged, V], hidden of all rows [n, D])."""
        outs = [self.ctx.decode(part, hidden=True) for part in batch.split(self.ctx.n_batch)]
        return torch.cat([o.logits for o in outs]), torch.cat([o.hidden for o in outs])
