"""A DFlash block drafter in llama.cpp's `dflash` layout (src/models/dflash.cpp; shared/design/hidden-state-drafters.md;
its files: dflash_file.py), and the context it drafts in.

Keys: dflash.target_layers INT32[K] (the target layers whose inputs are read: Hugging Face's target_layer_ids + 1),
dflash.block_size B, tokenizer.ggml.mask_token_id, the usual dflash.embedding_length H (the target's),
block_count L, feed_forward_length F, attention.head_count / head_count_kv / key_length d, layer_norm_rms_epsilon,
rope.freq_base. Tensors (torch order [out, in]): fc [H, K H_t] (optional fc.scale, a scalar), enc.output_norm [H]
(after fc); per layer i: blk.i.attn_norm [H], attn_q [n_h d, H], attn_k / attn_v [n_kv d, H], attn_output
[H, n_h d], attn_q_norm / attn_k_norm [d], ffn_norm [H], ffn_gate / ffn_up [F, H], ffn_down [H, F]; output_norm
[H]; optional output [V_d, H] with d2t I64 [V_d] (the target id of each row), else the target's output matrix;
optional token_embd [V, H], else the target's embedding. NeoX rope, no biases.

The context (DFlashContext) holds, for every committed target token p, in every layer K = rope(k_norm(W_k g_p)) and
V = W_v g_p at position p, where g_p = enc.output_norm(fc(the K tapped layers' inputs at p, concatenated)): the
features injected (`inject`; no attn_norm, no query).
A block decode: tokens [id_last, MASK x n] at positions P..P+n (the target's embedding of them); per layer
h = attn_norm(x); q, k, v with per-head q/k norms and NeoX rope; attention over the injected context and the whole
block, non-causal inside it (causal where the file says dflash.attention.causal); x += wo(attention);
x += FFN(ffn_norm(x)); logits = output(output_norm(x)). Row i >= 1 predicts the token at position P + i.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from spec_cli.errors import SpecCliError
from spec_cli.model import kernels
from spec_cli.model.config import ModelConfig
from spec_cli.model.context import Context
from spec_cli.model.draft_head import TargetSharedHead
from spec_cli.model.dspark_head import MarkovHead
from spec_cli.model.loader import LoadedModel
from spec_cli.model.qlinear import QLinear
from spec_cli.model.transformer import (
    Block,
    ForwardPlan,
    Linear,
    RMSNorm,
    apply_rope,
    attend_on_kernels,
    rope_table,
    rope_tables,
)


@dataclass(frozen=True)
class DFlashLayout:
    """What a dflash file's metadata says, beyond the head's ModelConfig."""

    target_layers: tuple[int, ...]  # target layer inputs read (Context.set_taps ids)
    target_hidden: int
    block_size: int  # B: a block holds the anchor and up to B - 1 masks
    mask_token: int
    causal: bool = False  # attention inside the block (dflash.attention.causal); DFlash's is non-causal


class DFlashHead(TargetSharedHead):
    """The drafter's parameters, and what a Context needs of a model (forward_hidden, logits, devices, dtype) to
    decode blocks over its cache; `inject` fills that cache from the target's features."""

    def __init__(self, cfg: ModelConfig, layout: DFlashLayout, target, own: set[str] = frozenset(),
                 n_draft: int | None = None):
        super().__init__(cfg, target, own, n_draft)
        H = cfg.n_embd
        self.layout = layout
        self.fc = Linear(len(layout.target_layers) * layout.target_hidden, H)
        self.fc_scale = 1.0  # fc.scale
        self.fc_norm = RMSNorm(H, cfg.rms_eps)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layer))
        self.out_norm = RMSNorm(H, cfg.rms_eps)
        self.markov: MarkovHead | None = None  # DSpark's (dspark_head.py), read from the file where it has one

    @property
    def layer_devices(self) -> list[torch.device]:
        return [self.device] * len(self.layers)

    @property
    def output_device(self) -> torch.device:
        return self.device

    @property
    def target_layers(self) -> tuple[int, ...]:
        return self.layout.target_layers

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """features [..., K, H_t] (the tapped layers' inputs) -> g [..., H] = enc.output_norm(fc(concat))."""
        x = self.fc(features.reshape(*features.shape[:-2], -1).to(self.device, self.dtype))
        return self.fc_norm(x * self.fc_scale if self.fc_scale != 1.0 else x)

    def on_kernels(self, x: torch.Tensor, k_cache: torch.Tensor) -> bool:
        """Whether a step runs on the CPU kernels: fused quantized q|k|v, float32 activations and cache."""
        return isinstance(self.layers[0].attn.qkv, QLinear) and kernels.usable(x) and k_cache.dtype == torch.float32

    def inject(self, g: torch.Tensor, seqs: torch.Tensor, positions: torch.Tensor, kv) -> None:
        """Keys and values of fused features g [n, H] written to every layer's cache at (seqs[i], positions[i])."""
        cfg = self.cfg
        g = g.to(self.device, self.dtype)
        n = g.shape[0]
        table = rope_table(cfg.rope_dim, cfg.rope_base, cfg.rope_scale, int(positions.max()) + 1, self.device)
        if self.on_kernels(g, kv[0][0]):  # q|k|v and its cache writes as a block decode does them (q unused)
            write = torch.ones(n, dtype=torch.uint8)
            for layer, (k_cache, v_cache) in zip(self.layers, kv):
                attn = layer.attn
                kernels.qkv_prep(attn.qkv(g), cfg.n_head, cfg.n_head_kv, cfg.head_dim, attn.q_norm.weight,
                                 attn.k_norm.weight, cfg.rms_eps, table, cfg.rope_dim, cfg.rope_type == "neox", seqs,
                                 positions, write, k_cache, v_cache)
            return
        cos, sin = (t[positions.to(t.device)].unsqueeze(1) for t in table)  # [n, 1, rope_dim / 2]
        for layer, (k_cache, v_cache) in zip(self.layers, kv):
            _, k, v = layer.attn.project(g)
            k = apply_rope(layer.attn.k_norm(k.view(n, cfg.n_head_kv, cfg.head_dim)), cos, sin, cfg.rope_type,
                           cfg.rope_dim)
            k_cache[seqs, :, positions] = k.to(k_cache.dtype)
            v_cache[seqs, :, positions] = v.view(n, cfg.n_head_kv, cfg.head_dim).to(v_cache.dtype)

    def forward_hidden(self, tokens: torch.Tensor, plan: ForwardPlan, kv) -> torch.Tensor:
        """A block decode: tokens [G, T] (each sequence's block) -> pre-norm states [G, T, H]; every row attends to
        the cache up to its sequence's last row of this decode (the whole block), or causally."""
        cfg = self.cfg
        x = self.embed_tokens(tokens)
        ends = plan.positions.amax(dim=1, keepdim=True)  # [G, 1]: the last position of each block
        kernel = self.on_kernels(x, kv[0][0])
        until = None
        if kernel:
            rope = rope_table(cfg.rope_dim, cfg.rope_base, cfg.rope_scale, plan.n_kv)
            if not self.layout.causal:
                until = ends.expand_as(plan.positions).reshape(-1).contiguous()
        else:
            rope = rope_tables(plan.positions, plan.n_kv, cfg.rope_dim, cfg.rope_base, cfg.rope_scale)
            if not self.layout.causal:
                key = torch.arange(plan.n_kv, device=ends.device)
                plan = replace(plan, mask_full=(key <= ends[..., None]).unsqueeze(1))  # [G, 1, 1, n_kv]
        for layer, (k_cache, v_cache) in zip(self.layers, kv):
            h = layer.attn_norm(x)
            if kernel:
                x = x + attend_on_kernels(layer.attn, h, plan, rope, k_cache, v_cache, until)
                x = x + self._ffn_on_kernels(layer.ffn, layer.ffn_norm(x))
            else:
                x = x + layer.attn(h, plan, rope, k_cache, v_cache)
                x = x + layer.ffn(layer.ffn_norm(x))
        return x

    @staticmethod
    def _ffn_on_kernels(ffn: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The FFN with its activation on the kernels too: no parallel region of torch's in a block (on a busy
        machine each one waits for a sleeping thread)."""
        if ffn.gate_up is None:
            return ffn(x)
        gate_up = ffn.gate_up(x).reshape(-1, 2 * ffn.gate_up.sizes[0])
        return ffn.w_down(kernels.glu(gate_up, ffn.gate_up.sizes[0], ffn.gelu)).view(x.shape)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.draft_logits(hidden)


class DFlashContext(Context):
    """The drafter's KV cache (L layers, n_seq sequences, positions as the target's): `inject` writes the committed
    tokens' features, `decode` runs blocks over them. A block must be decoded whole (one ubatch): the drafter keeps
    n_seq blocks within n_ubatch rows."""

    def __init__(self, head: DFlashHead, n_ctx: int, n_seq: int = 1, n_batch: int = 512, n_ubatch: int = 512):
        super().__init__(LoadedModel(head, head.cfg, None, 0.0), n_ctx, n_seq, n_batch, n_ubatch)
        self.head = head

    def inject(self, seqs: list[int], positions: list[int], g: torch.Tensor) -> None:
        """Features g [n, H] (DFlashHead.fuse) at (seqs[i], positions[i]); each sequence's positions continue its
        cache."""
        expected = list(self.lengths)
        for seq, pos in zip(seqs, positions):
            if pos != expected[seq]:
                raise SpecCliError(f"sequence {seq}: features injected at position {pos}, {expected[seq]} expected")
            if pos >= self.n_ctx_seq:
                raise SpecCliError(f"sequence {seq}: context full ({self.n_ctx_seq} tokens per sequence)")
            expected[seq] += 1
        if seqs:
            device = self.kv[0][0].device
            self.head.inject(g, torch.tensor(seqs, device=device), torch.tensor(positions, device=device), self.kv)
            self.lengths = expected
