"""`draft-mtp` (alias `mtp`): drafting with the target's own NextN head (llama.cpp common/speculative.cpp, MTP impl;
llamacpp-speculative.md §2.8).

The head row at position p reads (token_p, h_{p-1}): the target's pre-norm hidden state one position back. So a
target batch t_a..t_b (positions a..b) gives head rows (t_a, h_{a-1}), (t_{a+1}, h_a), ..., (t_b, h_{b-1}); the
first row's h_{a-1} is the "pending" state of the previous batch. The hidden inputs live in MTPContext.feed
(feed[seq, p] = target hidden at p), so pending is simply feed[seq, last committed position].

The prompt's head rows are decoded by `begin`, with the prompt (llama.cpp fills the NextN layer's KV while it
processes the prompt): a short prompt's rows, deferred to the first draft, made that draft a 60-row head decode
(20-26 ms on qwen2.5-coder-1.5b, most of a target forward), paid at every request's first probe.
After that, head rows are not decoded in `process`: they are deferred (up to DEFER_MAX rows, like llama.cpp) and
decoded together with the next draft's seed rows, in one head decode; rows of rejected draft tokens are dropped by
`accept` before they cost anything (past DEFER_MAX, `process` decodes the backlog up to the verify batch's first
row, never the draft rows after it: TargetCache.settled). A sequence not asked for a draft in IDLE_STEPS target
decodes (the adaptive planner dropped the head) defers all its rows: an unused head costs nothing per step
(decoding every committed token's row, 64 at a time, kept draft-mtp at 0.96-0.97x of plain on free writing); asked
again, `catch_up` decodes the backlog from the target hidden states kept in the feed, outside the drafting time the
planner prices per token, and more than RESTART_WINDOW rows behind it restarts the head's KV from the last
RESTART_WINDOW committed positions (as draft-simple restarts its cache), so a probe after a long idle stretch costs
a window, not the whole stretch. Head positions are target positions minus `offset[seq]` (the target position of
the window's first row; 0 until a restart); the feed is indexed by head position. The window's first row reads no
hidden state (as position 0 does): the head's drafts change, not the output (the target verifies every token).
`n_done[seq]` = target positions [offset, n_done) whose head rows are final (built from committed tokens and target
hidden states); everything past it in the head KV is draft scratch, trimmed before the next decode.

Rollback after a verify (`--spec-mtp-rollback`): the draft's head rows at pos0, pos0+1, ... hold (id_last, d_1, ...).
The seed row read the target's own hidden state, so it equals the row a catch-up would decode and is always kept.
`partial` (llama.cpp's behaviour) also keeps the rows of accepted draft tokens, built from the head's own hidden
states instead of the target's, and drops only the rejected tail; `reeval` re-decodes the accepted rows from the
target's hidden states with the next draft. Both are lossless (the target verifies every token); they differ in the
head's cost per step and in what its KV holds for later drafts.

`draft`: seed row (id_last, h at the last committed position) at pos0 for every drafting sequence, behind their
deferred rows; then one batched head decode per draft position, each new row (token, the head's own pre-norm
output of the previous row) -- the same head applied recursively. Top-1 of a top-k 10 softmax, stop below p_min or
at the length cap. Drafts are greedy (no `probs`): exact under both verification modes.
"""

from __future__ import annotations

import torch

from spec_cli.errors import SpecCliError, UsageError
from spec_cli.model.batch import Batch
from spec_cli.model.context import Context
from spec_cli.model.mtp_head import MTPContext
from spec_cli.speculative.base import Drafter, DraftParams, SpecParams, TargetCache
from spec_cli.speculative.draft_model import DRAFT_TOP_K, IDLE_STEPS, RESTART_WINDOW

MTP_DRAFT_MAX = 3  # llama.cpp #23269: MTP acceptance falls off quickly with depth, so 3 (not the global 16)
MTP_DRAFT_P_MIN = 0.0  # llama.cpp #23269 default for MTP (not the global 0.75)
DEFER_MAX = 64  # head rows kept back for the next draft decode before `process` decodes them itself
ROLLBACK_MODES = ("partial", "reeval")


def check_rollback(value: str) -> str:
    """A --spec-mtp-rollback value, checked."""
    if value not in ROLLBACK_MODES:
        raise UsageError(f"unknown --spec-mtp-rollback '{value}' (choose from {', '.join(ROLLBACK_MODES)})")
    return value


class MTPDrafter(Drafter):
    name = "draft-mtp"
    cheap = False

    def __init__(self, ctx: MTPContext, target: Context, params: SpecParams, n_seq: int,
                 n_max: int = MTP_DRAFT_MAX, p_min: float = MTP_DRAFT_P_MIN):
        if ctx.n_seq != n_seq or target.n_seq != n_seq:
            raise SpecCliError(f"MTP context has {ctx.n_seq} sequences, the target {target.n_seq}, expected {n_seq}")
        if ctx.n_ctx_seq < target.n_ctx_seq:
            raise SpecCliError("the MTP context must hold as many positions per sequence as the target's")
        ctx.clear()  # a fresh drafter: no head row is final yet (n_done)
        self.ctx, self.target, self.params = ctx, target, params
        self.n_max, self.p_min = n_max, p_min
        self.target_cache = TargetCache(n_seq)  # target tokens by position (as in its KV)
        self.n_done = [0] * n_seq
        self.offset = [0] * n_seq  # target position of head position 0 (> 0 after a restart from a window)
        self.rows: dict[int, tuple[int, list[int]]] = {}  # seq -> (pos0, tokens) of the last draft's head rows
        self.lost: set[int] = set()  # sequences resumed past positions this drafter never processed
        self.idle = [0] * n_seq  # target decodes since the sequence last asked for a draft

    def target_layers(self) -> tuple[int, ...]:
        return (self.target.config.n_layer_main,)  # the final pre-norm state

    def begin(self, seq: int, prompt: list[int]) -> None:
        self.idle[seq] = 0
        if seq not in self.lost and self._backlog(seq) > 0:
            self._decode(self._catch_up(Batch(), [seq]))  # the prompt's rows, as part of its processing

    def process(self, batch: Batch) -> None:
        hidden = self.target.features_of(self.target_layers())[:, 0]  # [len(batch), D] pre-norm states, batch order
        if hidden.shape[0] != len(batch):
            raise SpecCliError("draft-mtp needs the target's features of every decoded row (open the drafter "
                               "through a session.Session)")
        for seq, p0 in self.target_cache.record(batch).items():
            if seq in self.rows and p0 != self.rows[seq][0]:
                del self.rows[seq]  # not the verify batch of the draft: its head rows are scratch
            if p0 is None:
                # positions this drafter never saw (a KV cache filled without it): no drafts until a fresh start
                self.lost.add(seq)
                self.offset[seq] = self.n_done[seq] = 0
                continue
            if p0 == 0:
                self.lost.discard(seq)
            if p0 < self.offset[seq]:
                # the target went back before the window (a cached prompt prefix): the feed no longer holds the hidden
                # states before it, so the head restarts at p0, its first row reading none (as position 0)
                self.ctx.seq_rm(seq, 0)
                self.offset[seq] = self.n_done[seq] = p0
            self.n_done[seq] = min(self.n_done[seq], p0)
            self.idle[seq] += 1
        self.ctx.set_feed(batch.seq_ids, [pos - self.offset[seq] for pos, seq in zip(batch.pos, batch.seq_ids)],
                          hidden)
        active = [seq for seq, idle in enumerate(self.idle) if idle <= IDLE_STEPS]
        if sum(self._backlog(seq) for seq in active) > DEFER_MAX:
            # settled rows only: the rest may be draft tokens the verify rejects (a 17-row ngram draft)
            until = {seq: self.target_cache.settled[seq] for seq in dict.fromkeys(batch.seq_ids)}
            self._decode(self._catch_up(Batch(), active, until))

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
        """Empty the head's KV of `seq` and move head position 0 to target position `offset`, keeping the target
        hidden states of the positions from there in the feed."""
        shift = offset - self.offset[seq]
        feed = self.ctx.feed[seq]
        n = len(self.target_cache.tokens[seq]) - offset
        feed[:n] = feed[shift : shift + n].clone()
        self.ctx.seq_rm(seq, 0)
        self.offset[seq] = self.n_done[seq] = offset

    def _backlog(self, seq: int) -> int:
        """Committed target rows whose head rows are not decoded yet."""
        return len(self.target_cache.tokens[seq]) - self.n_done[seq]

    def accept(self, seq: int, n_accepted: int, is_other: bool) -> None:
        # Same bookkeeping whoever drafted (is_other): the target kept id_last + n_accepted rows of the last batch,
        # so the pending hidden state is feed[seq, keep - 1] (verify row n_accepted) and later rows are dropped.
        if seq in self.lost:
            return
        keep = self.target_cache.batch_pos0[seq] + n_accepted + 1
        tokens = self.target_cache.tokens[seq]
        del tokens[keep:]
        self.n_done[seq] = max(min(self.n_done[seq], keep), self._kept_rows(seq, tokens))
        self.ctx.seq_rm(seq, self.n_done[seq] - self.offset[seq])

    def _kept_rows(self, seq: int, tokens: list[int]) -> int:
        """End of the last draft's head rows that stay final: the seed row, and under partial rollback the rows of
        the accepted draft tokens (the leading rows whose token is the committed one); 0 without a draft."""
        pos0, drafted = self.rows.pop(seq, (0, []))
        if not drafted or self.n_done[seq] < pos0:
            return 0
        limit = len(drafted) if self.params.mtp_rollback == "partial" else 1
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
                raise SpecCliError(f"draft-mtp: sequence {p.seq} has {n_processed} processed positions, "
                                   f"the target {p.pos0} (a target decode was not passed to process)")
            if min(p.n_max, self.n_max) > 0:
                active[p.seq] = p
        self._catch_up(batch, active)
        for seq, p in active.items():
            batch.add(p.id_last, p.pos0 - self.offset[seq], seq, True)  # seed: reads the pending hidden state
            self.rows[seq] = (p.pos0, [p.id_last])
        while active:
            logits, hidden = self._decode(batch)
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
                p_min = p.p_min if p.p_min is not None else self.p_min
                if p_top[k] < p_min:
                    del active[seq]
                    continue
                p.result.append(ids[k])
                if len(p.result) >= min(p.n_max, self.n_max):
                    del active[seq]
                    continue
                fed_seqs.append(seq)
                fed_pos.append(pos)
                fed_rows.append(i)
                step.add(ids[k], pos + 1, seq, True)  # reads feed[seq, pos]: the head's own output, set below
                self.rows[seq][1].append(ids[k])
            if fed_rows:
                self.ctx.set_feed(fed_seqs, fed_pos, hidden[fed_rows])
            batch = step
        for p in params:
            if len(p.result) < p.min_length(self.params):
                p.result.clear()

    def min_length(self, p: DraftParams) -> int:
        return p.min_length(self.params)

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
