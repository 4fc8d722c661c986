"""The frozen target over training windows, cache-free: the tapped layers' inputs of every position (target features
on request, Transformer.forward_tapped) and its top-K next tokens, batch by batch (what every draft-head trainer
reads from the target)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spec_cli.model.config import ModelConfig
from spec_cli.model.transformer import ForwardPlan, Transformer
from spec_cli.train.data import Progress, ProgressFn


@dataclass
class TargetPass:
    """What the frozen target says about windows (CPU tensors)."""

    features: torch.Tensor  # [N, T, len(taps), D] the tapped layers' inputs (id n_layer: the final pre-norm state)
    topk: torch.Tensor  # [N, T, K] int64 the target's top-K next tokens at every position


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


def run_target(model: Transformer, tokens: torch.Tensor, taps: tuple[int, ...], batch: int, top_k: int,
               progress: ProgressFn | None = None, stage: str = "features",
               store: torch.dtype | None = None) -> TargetPass:
    """tokens [N, T] -> the tapped layers' inputs (stored as `store`, default the model's dtype) and the top-K ids
    of every position, `batch` windows per forward."""
    cfg = model.cfg
    N, T = tokens.shape
    device = model.layer_devices[0]
    feats, topk = [], []
    for b0 in range(0, N, batch):
        tok = tokens[b0 : b0 + batch]
        B = tok.shape[0]
        kv = [scratch_kv(cfg, B, T, model.dtype, dev) for dev in model.layer_devices]
        with torch.inference_mode():
            h, tapped = model.forward_tapped(tok.to(device), causal_plan(B, T, cfg, device), kv, taps)
            ids = torch.cat([model.logits(h[i]).topk(top_k, dim=-1).indices[None] for i in range(B)])
        feats.append(tapped.to("cpu", store or tapped.dtype))
        topk.append(ids.cpu())
        if progress:
            progress(Progress(stage, min(b0 + batch, N) * T, N * T, {}))
    return TargetPass(torch.cat(feats), torch.cat(topk))
