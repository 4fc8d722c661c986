"""`draft-dflash`: block drafting with a DFlash drafter (`-md FILE` in llama.cpp's dflash layout, model/dflash_head.py;
llama.cpp common/speculative.cpp, its dflash implementation).

Features in, not tokens: after every target decode, `process` fuses the tapped layers' inputs of each decoded row
and injects them as keys and values into every draft layer at the row's position (DFlashContext.inject). The drafter's
cache thus mirrors the target's, position for position, and follows it back: a target batch starting at p0 cuts it
there first (a verify batch's rows replace the last block's, a cached prompt prefix ends there), and `accept` cuts it
after the accepted tokens, as the target's own cache is cut.

One forward per draft: every drafting sequence's block [id_last, MASK x n] at positions pos0..pos0+n, decoded
together (each attends to its own context and its whole block, non-causally), n = min(--draft-max, block_size - 1,
what the planner caps); the block's keys and values are dropped right after. Row i is the draft token at pos0 + i:
top-1 of a top-k 10 softmax, the draft stopping at the first below --draft-p-min; where verification is by
rejection (T > 0), drawn from the row's distribution under the target's sampler settings instead, those distributions
(q, over the draft vocabulary mapped to target ids) returned for the verify. A block's rows do not see each other's
drawn tokens, only the masks: q_i is still the distribution token i was drawn from, which is all rejection sampling
needs to stay exact.

A slot file holds a sequence's injected keys and values (a restored slot's prompt is never decoded again, so its
features exist nowhere else), the mirror of the target cache and whether the sequence is lost; the sampling generator
is not kept (each request starts its own).
"""

from __future__ import annotations

import numpy as np
import torch

from spec_cli.errors import SpecCliError, StateError
from spec_cli.model.batch import Batch
from spec_cli.model.context import Context
from spec_cli.model.dflash_head import DFlashContext
from spec_cli.model.sampling import draft_generator, sample_restricted
from spec_cli.model.state_arrays import State, prefixed, scalar, within
from spec_cli.speculative.base import Drafter, DraftParams, SpecParams, TargetCache, check_own_context
from spec_cli.speculative.draft_model import DRAFT_TOP_K


class DFlashDrafter(Drafter):
    name = "draft-dflash"
    cheap = False
    per_call = True  # a draft costs one forward whatever its length (the planner prices it per call)
    first_row = 1  # the block row that holds the first draft token (row 0 is id_last's)

    def __init__(self, ctx: DFlashContext, target: Context, params: SpecParams, n_seq: int):
        check_own_context(self.name, "drafter", ctx, target, n_seq)
        ctx.clear()
        self.ctx, self.target, self.params = ctx, target, params
        self.head = ctx.head
        # a block holds the anchor and up to block_size - 1 masks, and every sequence's block fits one ubatch
        self.n_max = max(0, min(params.draft_max, self.block_capacity(), ctx.n_ubatch // n_seq - self.first_row))
        self.target_cache = TargetCache(n_seq)
        self.lost: set[int] = set()  # sequences whose target cache was filled without this drafter
        self.rng: list[torch.Generator | None] = [None] * n_seq  # per request, for sampled drafts

    def block_capacity(self) -> int:
        """The most draft tokens one block gives."""
        return self.head.layout.block_size - 1

    def target_layers(self) -> tuple[int, ...]:
        return self.head.target_layers

    def begin(self, seq: int, prompt: list[int]) -> None:
        self.rng[seq] = None

    def process(self, batch: Batch) -> None:
        features = self.target.features_of(self.target_layers())  # [len(batch), K, H_t], batch order
        if features.shape[0] != len(batch):
            raise SpecCliError(f"{self.name} needs the target's features of every decoded row (open the drafter "
                               "through a session.Session)")
        for seq, p0 in self.target_cache.record(batch).items():
            if p0 is not None and p0 > self.ctx.lengths[seq]:
                p0 = None  # rows this drafter never injected (it was lost before)
            if p0 is None:
                self.lost.add(seq)
                self.ctx.seq_rm(seq, 0)
                continue
            if p0 == 0:
                self.lost.discard(seq)
            self.ctx.seq_rm(seq, p0)  # the target writes these positions afresh
        keep = [i for i, seq in enumerate(batch.seq_ids) if seq not in self.lost]
        if keep:
            self.ctx.inject([batch.seq_ids[i] for i in keep], [batch.pos[i] for i in keep],
                            self.head.fuse(features[keep]))

    def accept(self, seq: int, n_accepted: int, is_other: bool) -> None:
        # whoever drafted: the target kept id_last and the accepted tokens of the last batch
        keep = self.target_cache.batch_pos0[seq] + n_accepted + 1
        del self.target_cache.tokens[seq][keep:]
        self.ctx.seq_rm(seq, keep)

    def min_length(self, p: DraftParams) -> int:
        return p.min_length(self.params)

    # --- slot files ---------------------------------------------------------------------------------------------

    def save_state(self, seq: int) -> State:
        return {**prefixed("kv/", self.ctx.seq_state(seq)), **prefixed("target/", self.target_cache.save_state(seq)),
                "lost": np.asarray(int(seq in self.lost))}

    def restore_state(self, seq: int, state: State, n_vocab: int) -> None:
        lost, kv = scalar(state, "lost", 0, 1), within(state, "kv/")
        self.target_cache.restore_state(seq, within(state, "target/"), n_vocab)
        n_tokens = len(self.target_cache.tokens[seq])
        if scalar(kv, "length") > n_tokens:
            raise StateError(f"{int(kv['length'])} injected positions, past the {n_tokens} target positions")
        self.ctx.restore_seq(seq, kv)
        self.rng[seq] = None
        if lost:
            self.lost.add(seq)
        else:
            self.lost.discard(seq)

    def forget(self, seq: int) -> None:
        self.target_cache.forget(seq)
        self.ctx.seq_rm(seq, 0)
        self.lost.discard(seq)
        self.rng[seq] = None

    def slot_info(self, seq: int) -> dict:
        return {"n_kv": self.ctx.lengths[seq], "lost": seq in self.lost}

    def draft(self, params: list[DraftParams]) -> None:
        batch, blocks = Batch(), []
        for p in params:
            n = min(p.n_max, self.n_max)
            if p.seq in self.lost or n <= 0:
                continue
            if self.ctx.lengths[p.seq] != p.pos0:
                raise SpecCliError(f"{self.name}: sequence {p.seq} has {self.ctx.lengths[p.seq]} injected positions, "
                                   f"the target {p.pos0} (a target decode was not passed to process)")
            blocks.append((p, sum(batch.logits), n))
            for i, token in enumerate(self.block_tokens(p, n)):
                batch.add(token, p.pos0 + i, p.seq, i >= self.first_row)
        if not blocks:
            return
        out = self.ctx.decode(batch, hidden=True)
        for p, _, _ in blocks:
            self.ctx.seq_rm(p.seq, p.pos0)  # the block's keys and values: the verify injects the real ones
        self.read_blocks(blocks, out.logits, out.hidden)
        for p in params:
            if len(p.result) < p.min_length(self.params):
                p.result.clear()
                p.probs = None

    def block_tokens(self, p: DraftParams, n: int) -> list[int]:
        """The block of a draft of n tokens: id_last, then masks."""
        return [p.id_last] + [self.head.layout.mask_token] * n

    def read_blocks(self, blocks: list[tuple[DraftParams, int, int]], logits: torch.Tensor,
                    hidden: torch.Tensor) -> None:
        """Each block's draft from its rows' logits (`blocks`: the request, its first row among the flagged ones,
        its length)."""
        for p, row, n in blocks:
            self.read_rows(p, logits[row : row + n])

    def read_rows(self, p: DraftParams, logits: torch.Tensor, stop_below: float | None = None) -> None:
        """The draft tokens of rows logits [n, V_d]: top-1 (or drawn, returning q), up to the first row whose top-1
        is below p_min (`stop_below` in its place where given)."""
        vocab = self.head.draft_vocab
        top = torch.topk(logits, min(DRAFT_TOP_K, logits.shape[-1]), dim=-1)
        p_top = torch.softmax(top.values, dim=-1)[:, 0].tolist()
        best = top.indices[:, 0]
        ids = (best if vocab is None else vocab[best]).tolist()
        p_min = stop_below if stop_below is not None else p.p_floor(self.params.draft_p_min)
        q_rows = []
        for i, token in enumerate(ids):
            if p_top[i] < p_min:
                break
            if p.sampling is not None:
                if self.rng[p.seq] is None:
                    self.rng[p.seq] = draft_generator(p.sampling, logits.device)
                token, q = sample_restricted(logits[i], vocab, self.target.config.n_vocab, p.sampling,
                                             self.rng[p.seq])
                q_rows.append(q)
            p.result.append(token)
        if q_rows:
            p.probs = torch.stack(q_rows)
