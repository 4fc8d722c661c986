"""An EAGLE-3 draft head: one decoder layer that reads the inputs of three target layers and the token embedding, in
llama.cpp's `eagle3` layout (src/models/eagle3.cpp; shared/design/hidden-state-drafters.md; its files:
eagle3_file.py).

Keys (`eagle3.*`): target_layers INT32[3] (the PR branches' `extract_layers` accepted), target_hidden_size H_t,
norm_before_residual and norm_before_fc (optional bools), and the usual embedding_length H, feed_forward_length F,
attention.head_count / head_count_kv / key_length, layer_norm_rms_epsilon, rope.freq_base / dimension_count,
block_count 1. Tensors (torch order [out, in]): fc [H, 3 H_t]; enc.output_norm [3 H_t] (norm_before_fc);
blk.0.attn_norm [H] (on the token embedding); blk.0.attn_norm_2 [H] (on the fused feature; the PR branches'
blk.0.hidden_norm accepted); blk.0.attn_q [n_h d, 2H], attn_k / attn_v [n_kv d, 2H], attn_output [H, n_h d], Q and K
rows permuted for llama's interleaved-pair rope; blk.0.ffn_norm, ffn_gate / ffn_up [F, H], ffn_down [H, F];
output_norm [H]; optional output [V_d, H] (absent: the target's output matrix), token_embd [V, H] (absent: the
target's embedding), d2t I64 [V_d] (the target id of each draft-vocabulary row; the PR branches' offsets, target =
i + d2t[i], recognized), rope_freqs [d / 2] (llama-3 rope scaling).

Forward for a row at head position t holding (token x_{t+1}, fused feature g_t):
    e = attn_norm(embed(x)), gn = attn_norm_2(g), a = concat(e, gn) [2H]; q, k, v = W a; rope (adjacent pairs);
    causal attention over the head's KV; h1 = attn + (gn if norm_before_residual else g);
    h2 = h1 + FFN(ffn_norm(h1))  (the pre-norm state, fed back as g of the next draft position);
    logits = output(output_norm(h2)) over the V_d draft-vocabulary rows (token d2t[i] for row i).
with g_t = fc(feat_t) (fc(RMSNorm(feat_t)) with norm_before_fc), feat_t = the three tapped layers' inputs at t.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from spec_cli.model import kernels
from spec_cli.model.config import ModelConfig
from spec_cli.model.draft_head import TargetSharedHead
from spec_cli.model.qlinear import QLinear
from spec_cli.model.transformer import (
    Attention,
    FeedForward,
    ForwardPlan,
    Linear,
    RMSNorm,
    attend_on_kernels,
    rope_table,
    rope_tables,
)

N_FEATURES = 3  # tapped target layers


@dataclass(frozen=True)
class Eagle3Layout:
    """What an eagle3 file's metadata says, beyond the head's ModelConfig."""

    target_layers: tuple[int, ...]
    target_hidden: int
    norm_before_residual: bool
    norm_before_fc: bool
    pr_branch: bool  # written by an early PR branch (its key and tensor names): d2t holds offsets there


class Eagle3Head(TargetSharedHead):
    """The head's own parameters; the target's embedding and output matrix (where the file has none) are used
    through draft_head.TargetSharedHead."""

    def __init__(self, cfg: ModelConfig, layout: Eagle3Layout, target, own: set[str] = frozenset(),
                 n_draft: int | None = None):
        super().__init__(cfg, target, own, n_draft)
        H, Ht = cfg.n_embd, layout.target_hidden
        self.layout = layout
        self.fc = Linear(N_FEATURES * Ht, H)
        self.fc_norm = RMSNorm(N_FEATURES * Ht, cfg.rms_eps) if layout.norm_before_fc else None
        self.attn_norm = RMSNorm(H, cfg.rms_eps)
        self.hidden_norm = RMSNorm(H, cfg.rms_eps)
        self.attn = Attention(cfg, swa=False)
        for proj in (self.attn.wq, self.attn.wk, self.attn.wv):  # q, k, v read [embedding; feature]: 2H
            proj.weight = nn.Parameter(torch.empty(proj.weight.shape[0], 2 * H), requires_grad=False)
        self.ffn_norm = RMSNorm(H, cfg.rms_eps)
        self.ffn = FeedForward(cfg)
        self.out_norm = RMSNorm(H, cfg.rms_eps)
        self.rope_freqs: torch.Tensor | None = None  # [rope_dim / 2] llama-3 rope scaling factors
        self._rope_table: tuple[torch.Tensor, torch.Tensor] | None = None

    # --- forward -------------------------------------------------------------------------------------------

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """features [..., 3, H_t] (the tapped layers' inputs) -> g [..., H] = fc(feat) (fc(norm(feat)))."""
        x = features.reshape(*features.shape[:-2], -1).to(self.device, self.dtype)
        if self.fc_norm is not None:
            x = self.fc_norm(x)
        return self.fc(x)

    def forward(self, tokens: torch.Tensor, g: torch.Tensor, plan: ForwardPlan, rope, k_cache, v_cache):
        """tokens [G, T], g [G, T, H] (fused features, or the pre-norm states of the draft positions before) ->
        the pre-norm states h2 [G, T, H]; keys and values written to the caches by the plan."""
        g = g.to(self.device, self.dtype)
        gn = self.hidden_norm(g)
        x = torch.cat((self.attn_norm(self.embed_tokens(tokens)), gn), dim=-1)  # [G, T, 2H]
        if rope is None:  # a decode on the kernels (step): rope and attention there (torch's SDPA on one row cost
            # most of a draft token: 14 ms of 23 on the 0.5b's head)
            a = attend_on_kernels(self.attn, x, plan, self.rope_table(plan.n_kv), k_cache, v_cache)
        else:
            a = self.attn(x, plan, rope, k_cache, v_cache)
        h = a + (gn if self.layout.norm_before_residual else g)
        return h + self.ffn(self.ffn_norm(h))

    def step(self, tokens: torch.Tensor, g: torch.Tensor, plan: ForwardPlan, k_cache, v_cache) -> torch.Tensor:
        """`forward` at the plan's positions with the head's rope (a HeadContext's decode): on the CPU kernels where
        the head's projections are (float32 activations and cache, fused quantized q|k|v), else torch's ops."""
        if isinstance(self.attn.qkv, QLinear) and kernels.usable(g) and k_cache.dtype == torch.float32:
            return self(tokens, g, plan, None, k_cache, v_cache)
        return self(tokens, g, plan, self.rope(plan.positions, plan.n_kv), k_cache, v_cache)

    def rope_table(self, n_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [>= n_pos, rope_dim / 2] float32 on the CPU: the shared table, or with rope_freqs the head's own
        (each frequency divided by its factor)."""
        cfg = self.cfg
        if self.rope_freqs is None:
            return rope_table(cfg.rope_dim, cfg.rope_base, cfg.rope_scale, n_pos)
        if self._rope_table is None or self._rope_table[0].shape[0] < n_pos:
            n = 1 << max(n_pos - 1, 1023).bit_length()
            inv = 1.0 / (cfg.rope_base ** (torch.arange(0, cfg.rope_dim, 2, dtype=torch.float64) / cfg.rope_dim))
            angles = (torch.arange(n, dtype=torch.float64) / cfg.rope_scale)[:, None] * inv / self.rope_freqs.double()
            self._rope_table = (angles.cos().float(), angles.sin().float())
        return self._rope_table

    def rope(self, positions: torch.Tensor, n_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [G, 1, T, rope_dim / 2] of positions [G, T] (each < n_pos), on their device."""
        cfg = self.cfg
        if self.rope_freqs is None:
            return rope_tables(positions, n_pos, cfg.rope_dim, cfg.rope_base, cfg.rope_scale)
        cos, sin = (t.to(positions.device)[positions].unsqueeze(1) for t in self.rope_table(n_pos))
        return cos, sin

    @property
    def target_layers(self) -> tuple[int, ...]:
        return self.layout.target_layers
