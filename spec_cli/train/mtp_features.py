"""What the frozen target says about the training windows of `spec-cli mtp-train`, and the cache-free forward
passes training runs: the target over fresh windows (hidden states, the last block's input, top-K ids) and the
NextN head over all positions at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from spec_cli.model.config import ModelConfig
from spec_cli.model.mtp_head import MTPHead
from spec_cli.model.transformer import ForwardPlan, Transformer, rope_tables
from spec_cli.train.data import Progress, ProgressFn

TOP_K = 8  # target candidates kept per position for the KL term


@dataclass
class Features:
    """What the frozen target says about a set of sequences (CPU tensors)."""

    tokens: torch.Tensor  # [N, T] int64
    hidden: torch.Tensor  # [N, T, D] pre-final-norm hidden state at every position
    last_in: torch.Tensor  # [M, T, D] input of the last block, first M <= N windows (for the eh_proj init)
    topk: torch.Tensor  # [N, T, K] int64 target's top-K token ids


def causal_plan(B: int, T: int, cfg: ModelConfig, device: torch.device) -> ForwardPlan:
    """Plan for B fresh sequences of T rows each at positions 0..T-1 (one scratch cache of T cells per sequence)."""
    pos = torch.arange(T, device=device).expand(B, T)  # [B, T]
    key = torch.arange(T, device=device)
    causal = key <= pos[..., None]  # [B, T, T]
    swa = causal & (pos[..., None] - key < cfg.sliding_window) if cfg.sliding_window else None
    return ForwardPlan(
        positions=pos,
        write_rows=torch.arange(B * T, device=device),
        write_seq=torch.arange(B, device=device).repeat_interleave(T),
        write_pos=pos.reshape(-1),
        kv_seqs=slice(0, B),
        n_kv=T,
        mask_full=causal.unsqueeze(1),
        mask_swa=swa.unsqueeze(1) if swa is not None else None,
    )


def scratch_kv(cfg: ModelConfig, B: int, T: int, dtype: torch.dtype, device: torch.device):
    shape = (B, cfg.n_head_kv, T, cfg.head_dim)
    return torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)


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
    the first windows holding `last_in_rows` positions."""
    cfg = model.cfg
    N, T = tokens.shape
    device = model.layer_devices[0]
    captured: list[torch.Tensor] = []
    hook = model.layers[-1].register_forward_pre_hook(lambda _m, args: captured.append(args[0]))
    hidden, last_in, topk = [], [], []
    try:
        for b0 in range(0, N, batch):
            tok = tokens[b0 : b0 + batch]
            B = tok.shape[0]
            kv = [scratch_kv(cfg, B, T, model.dtype, dev) for dev in model.layer_devices]
            with torch.inference_mode():
                h = model.forward_hidden(tok.to(device), causal_plan(B, T, cfg, device), kv)  # [B, T, D]
                ids = torch.cat([model.logits(h[i]).topk(TOP_K, dim=-1).indices[None] for i in range(B)])
            hidden.append(h.float().cpu())
            x = captured.pop()
            if b0 * T < last_in_rows:
                last_in.append(x.float().cpu())
            topk.append(ids.cpu())
            if progress:
                progress(Progress(stage, min(b0 + batch, N) * T, N * T, {}))
    finally:
        hook.remove()
    return Features(tokens, torch.cat(hidden), torch.cat(last_in) if last_in else torch.empty(0), torch.cat(topk))
