"""What the frozen target says about the training windows of `spec-cli mtp-train`, and the cache-free forward
passes training runs: the target over fresh windows (hidden states, the last block's input, top-K ids) and the
NextN head over all positions at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from spec_cli.model.mtp_head import MTPHead
from spec_cli.model.transformer import Transformer, rope_tables
from spec_cli.train.data import ProgressFn
from spec_cli.train.target_pass import causal_plan, run_target, scratch_kv

TOP_K = 8  # target candidates kept per position for the KL term


@dataclass
class Features:
    """What the frozen target says about a set of sequences (CPU tensors)."""

    tokens: torch.Tensor  # [N, T] int64
    hidden: torch.Tensor  # [N, T, D] pre-final-norm hidden state at every position
    last_in: torch.Tensor  # [M, T, D] input of the last block, first M <= N windows (for the eh_proj init)
    topk: torch.Tensor  # [N, T, K] int64 target's top-K token ids


def shifted(hidden: torch.Tensor) -> torch.Tensor:
    """[B, T, D] target hidden states -> the head's hidden input: row p gets h_{p-1}, row 0 gets zeros."""
    return F.pad(hidden[:, :-1], (0, 0, 1, 0))


def head_forward(head: MTPHead, tokens: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
    """tokens [B, T], prev [B, T, D] (row p: hidden input of position p) -> head pre-norm output [B, T, D],
    all positions at once with a fresh cache (training, and the reference the drafter is tested against)."""
    B, T = tokens.shape
    cfg, device = head.cfg, head.device
    plan = causal_plan(B, T, cfg, device)
    base = cfg.rope_base_swa if head.block.swa else cfg.rope_base
    rope = rope_tables(plan.positions, T, cfg.rope_dim, base, cfg.rope_scale)
    k, v = scratch_kv(cfg, B, T, prev.dtype, device)  # a fresh cache each call: autograd flows through it
    return head(tokens.to(device), prev.to(device), plan, rope, k, v)


def target_features(model: Transformer, tokens: torch.Tensor, batch: int, progress: ProgressFn | None = None,
                    stage: str = "features", last_in_rows: int = 16384) -> Features:
    """Run the frozen target over [N, T] token windows: hidden states, top-K ids, and the last block's input for
    the first windows holding `last_in_rows` positions (target features on request: taps n_layer - 1 and n_layer)."""
    n = len(model.layers)
    out = run_target(model, tokens, (n - 1, n), batch, TOP_K, progress, stage)
    m = min(tokens.shape[0], -(-last_in_rows // tokens.shape[1]))
    return Features(tokens, out.features[:, :, 1].float(), out.features[:m, :, 0].float(), out.topk)
