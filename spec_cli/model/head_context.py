"""The context of a draft head that reads the target's features (the MTP head, EAGLE-3): its own KV cache plus a
per-context feed of the feature each head row reads.

Feed convention: the row at head position q (sequence s) reads feed[s, q]. The drafter writes it: the target's
features (transformed by the head: an MTP head reads the final pre-norm state as it is, EAGLE-3 its fused fc
projection) for rows of committed tokens, the head's own pre-norm output for rows being drafted. Everything else
(KV cache, batching, rollback by position) is Context's.

A head is any module with `cfg` (a ModelConfig: KV shape, vocabulary for the token checks), `device`, `dtype`,
`step(tokens [G, T], prev [G, T, D], plan, k_cache, v_cache) -> pre-norm output [G, T, D]` and
`draft_logits(hidden [n, D]) -> [n, V_d]`.
"""

from __future__ import annotations

import torch
from torch import nn

from spec_cli.model.context import Context
from spec_cli.model.loader import LoadedModel
from spec_cli.model.transformer import ForwardPlan
from spec_cli.options import default


class FeedRunner(nn.Module):
    """What Context needs from a model (forward_hidden, logits, devices, dtype), for one head and one feed."""

    def __init__(self, head: nn.Module, feed: torch.Tensor):
        super().__init__()
        self.head = head
        self.feed = feed  # [n_seq, n_ctx_seq + 1, D]
        self.dtype = head.dtype
        self.layer_devices = [head.device]
        self.output_device = head.device

    def forward_hidden(self, tokens: torch.Tensor, plan: ForwardPlan, kv) -> torch.Tensor:
        """tokens [G, T] -> the head's pre-norm output [G, T, D]; each row reads feed[seq, pos]."""
        G, T = tokens.shape
        prev = torch.zeros(G * T, self.feed.shape[-1], dtype=self.feed.dtype, device=self.feed.device)
        prev[plan.write_rows] = self.feed[plan.write_seq, plan.write_pos]  # padded rows read zeros
        k_cache, v_cache = kv[0]
        return self.head.step(tokens, prev.view(G, T, -1), plan, k_cache, v_cache)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head.draft_logits(hidden)  # drafting is all this context decodes for


class HeadContext(Context):
    """A head's own KV (one layer, n_seq sequences) plus its feed [n_seq, n_ctx_seq + 1, D]: one cell more than
    the positions, so that a row can read the feature of the position before the first it holds."""

    def __init__(self, head: nn.Module, n_ctx: int = default("ctx_size"), n_seq: int = 1,
                 n_batch: int = default("batch_size"), n_ubatch: int = default("ubatch_size")):
        n_ctx_seq = n_ctx // max(n_seq, 1)
        feed = torch.zeros(n_seq, n_ctx_seq + 1, head.cfg.n_embd, dtype=head.dtype, device=head.device)
        super().__init__(LoadedModel(FeedRunner(head, feed), head.cfg, None, 0.0), n_ctx, n_seq, n_batch, n_ubatch)
        self.head = head
        self.feed = feed

    def set_feed(self, seqs: list[int], positions: list[int], values: torch.Tensor) -> None:
        """feed[seq_i, pos_i] = values[i] (values [n, D] on any device)."""
        idx_s = torch.tensor(seqs, dtype=torch.long, device=self.feed.device)
        idx_p = torch.tensor(positions, dtype=torch.long, device=self.feed.device)
        self.feed[idx_s, idx_p] = values.to(self.feed.device, self.feed.dtype)
