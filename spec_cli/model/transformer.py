"""One decoder-only Transformer for llama / mistral / qwen2 / qwen3 / gemma3, driven by ModelConfig flags.

The network only: it reads and writes a KV cache it is handed (owned by `context.Context`) and never decides
which rows are decoded. Follows llama.cpp's graphs in src/models/{llama,qwen2,qwen3,gemma3}.cpp.
Rows arrive grouped per sequence and padded: x is [G, T, D] for G sequences of at most T new rows each; where every
block runs on the CPU kernels, which take each row's own sequence and position, in one group of rows as they come
(G = 1, `ForwardPlan.ragged`): no sequence is padded to the longest.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from spec_cli.model import kernels
from spec_cli.model.config import ModelConfig
from spec_cli.model.qlinear import QLinear


@dataclass
class ForwardPlan:
    """Where the rows of one decode go; built once per decode by the context, shared by every layer."""

    positions: torch.Tensor  # [G, T] int64; padded rows carry position 0
    write_rows: torch.Tensor  # [n_valid] int64: flat indices (g * T + t) of the real rows
    write_seq: torch.Tensor  # [n_valid] int64: cache sequence of each real row
    write_pos: torch.Tensor  # [n_valid] int64: cache position of each real row
    kv_seqs: slice | torch.Tensor  # selects the G cache sequences (a slice when contiguous: no copy)
    n_kv: int  # keys [0, n_kv) are read
    mask_full: torch.Tensor | None  # [G, 1, T, n_kv] bool, True = may attend (None when ragged)
    mask_swa: torch.Tensor | None  # same for sliding-window layers
    # one group (G = 1) of rows of any sequences, every row written: row i's sequence is write_seq[i]. Only the
    # kernels' blocks read such a plan (Transformer.runs_ragged); torch's attention needs the padded [G, T] one.
    ragged: bool = False

    def to(self, device: torch.device) -> "ForwardPlan":
        move = lambda t: t.to(device) if isinstance(t, torch.Tensor) else t  # noqa: E731
        return ForwardPlan(*(move(getattr(self, f)) for f in self.__dataclass_fields__))

    @functools.cached_property
    def row_seq(self) -> torch.Tensor:
        """[G * T] int64: the cache sequence of every (padded) row, for the attention kernel."""
        if self.ragged:
            return self.write_seq
        T = self.positions.shape[1]
        seqs = self.kv_seqs
        if isinstance(seqs, slice):
            seqs = torch.arange(seqs.start, seqs.stop, device=self.positions.device)
        return seqs.repeat_interleave(T)

    @functools.cached_property
    def row_write(self) -> torch.Tensor:
        """[G * T] uint8: 1 for the real rows (written to the cache), 0 for padding."""
        flags = torch.zeros(self.positions.numel(), dtype=torch.uint8, device=self.positions.device)
        flags[self.write_rows] = 1
        return flags

    @functools.cached_property
    def row_pos(self) -> torch.Tensor:
        """[G * T] int64: the position of every (padded) row."""
        return self.positions.reshape(-1).contiguous()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if kernels.usable(x):
            if torch.compiler.is_compiling():  # the same kernel, as a torch op (compiled.py registers it)
                return torch.ops.spec_cli.rms_norm(x, self.weight, self.eps)
            return kernels.rms_norm(x, self.weight, self.eps)
        if x.dtype == self.weight.dtype:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)  # bf16/f16 activations


class Linear(nn.Module):
    """y = x W^T (+ b). Kept minimal so a quantized implementation can replace it module by module."""

    def __init__(self, n_in: int, n_out: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_out, n_in), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(n_out), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def select_rows(self, ids: torch.Tensor) -> "Linear":
        """The layer restricted to output rows `ids` (a draft vocabulary): y[..., i] = full y[..., ids[i]]."""
        sub = Linear(0, 0)
        sub.weight = nn.Parameter(self.weight[ids], requires_grad=False)
        sub.bias = None if self.bias is None else nn.Parameter(self.bias[ids], requires_grad=False)
        return sub


_ROPE_TABLES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # (dim, base, scale, device) -> cos, sin [n, dim / 2]


def rope_table(dim: int, base: float, scale: float, n_pos: int,
               device: torch.device = torch.device("cpu")) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [>= n_pos, dim / 2] float32 on `device` for positions 0, 1, ...: one table per setting (angles in
    float64, on the CPU), grown by powers of two, so a position's values never depend on the batch it comes in
    nor on the device."""
    device = torch.device(device)
    key = (dim, base, scale, device)
    table = _ROPE_TABLES.get(key)
    if table is None or table[0].shape[0] < n_pos:
        n = 1 << max(n_pos - 1, 1023).bit_length()
        if device.type == "cpu":
            inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
            angles = (torch.arange(n, dtype=torch.float64) / scale)[:, None] * inv_freq
            table = (angles.cos().float(), angles.sin().float())
        else:
            table = tuple(t.to(device) for t in rope_table(dim, base, scale, n))
        _ROPE_TABLES[key] = table
    return table


def rope_tables(positions: torch.Tensor, n_pos: int, dim: int, base: float,
                scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [G, T] (each < n_pos) -> cos, sin [G, 1, T, dim/2] (broadcast over heads): rows of the table on
    the positions' device (two gathers: no host sync, nothing computed per step)."""
    cos, sin = rope_table(dim, base, scale, n_pos, positions.device)
    return cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope_type: str, rope_dim: int) -> torch.Tensor:
    # x [G, H, T, head_dim]; only the first rope_dim dims rotate
    rot, rest = x[..., :rope_dim], x[..., rope_dim:]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    if rope_type == "neox":
        x1, x2 = rot.chunk(2, dim=-1)
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    else:  # "norm": adjacent pairs
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, swa: bool):
        super().__init__()
        self.cfg, self.swa = cfg, swa
        d, hd = cfg.n_embd, cfg.head_dim
        self.wq = Linear(d, cfg.n_head * hd, cfg.qkv_bias)
        self.wk = Linear(d, cfg.n_head_kv * hd, cfg.qkv_bias)
        self.wv = Linear(d, cfg.n_head_kv * hd, cfg.qkv_bias)
        self.wo = Linear(cfg.n_head * hd, d)
        self.q_norm = RMSNorm(hd, cfg.rms_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(hd, cfg.rms_eps) if cfg.qk_norm else None
        self.qkv: nn.Module | None = None  # x -> (q, k, v) in one product, set in place of wq/wk/wv by qlinear

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [..., D] -> q [..., n_head * hd], k and v [..., n_head_kv * hd] (one product where fused)."""
        if self.qkv is not None:
            return self.qkv(x).split(self.qkv.sizes, dim=-1)
        return self.wq(x), self.wk(x), self.wv(x)

    def forward(self, x, plan: ForwardPlan, rope, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        # x [G, T, D]; k_cache/v_cache [n_seq, kv_heads, n_ctx_seq, head_dim]
        cfg = self.cfg
        G, T, _ = x.shape
        q, k, v = self.project(x)
        q = q.view(G, T, cfg.n_head, cfg.head_dim)
        k = k.view(G, T, cfg.n_head_kv, cfg.head_dim)
        v = v.view(G, T, cfg.n_head_kv, cfg.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = (t.transpose(1, 2) for t in rope)  # [G, T, 1, rope_dim / 2]
        q = apply_rope(q, cos, sin, cfg.rope_type, cfg.rope_dim)  # [G, T, H, hd]
        k = apply_rope(k, cos, sin, cfg.rope_type, cfg.rope_dim)  # [G, T, Hkv, hd]
        # write the real rows into the static cache by (sequence, position); padded rows are never written
        k_rows = k.reshape(G * T, cfg.n_head_kv, cfg.head_dim)[plan.write_rows]
        v_rows = v.reshape(G * T, cfg.n_head_kv, cfg.head_dim)[plan.write_rows]
        k_cache[plan.write_seq, :, plan.write_pos] = k_rows.to(k_cache.dtype)
        v_cache[plan.write_seq, :, plan.write_pos] = v_rows.to(v_cache.dtype)
        keys = k_cache[plan.kv_seqs, :, : plan.n_kv]  # [G, Hkv, n_kv, hd]
        values = v_cache[plan.kv_seqs, :, : plan.n_kv]
        mask = plan.mask_swa if self.swa else plan.mask_full
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys.to(q.dtype), values.to(q.dtype), attn_mask=mask, scale=cfg.attn_scale,
            enable_gqa=cfg.n_head != cfg.n_head_kv,
        )  # [G, H, T, hd]
        return self.wo(out.transpose(1, 2).reshape(G, T, cfg.n_head * cfg.head_dim))


def attend_on_kernels(attn: Attention, x: torch.Tensor, plan: ForwardPlan, rope: tuple[torch.Tensor, torch.Tensor],
                      k_cache: torch.Tensor, v_cache: torch.Tensor, until: torch.Tensor | None = None) -> torch.Tensor:
    """An attention (fused quantized q|k|v) over rows x [G, T, n_in] on the CPU kernels, one call each:
    kernels.qkv_prep (per-head q/k norms, rope by the whole table `rope` indexed by row position, the cache writes of
    the plan's rows), kernels.attention over the cache, then wo -> [G, T, D]. Row r attends to its sequence's keys
    [0, until[r]] (default its own position: causal; a block drafter passes its block's last position)."""
    cfg = attn.cfg
    G, T, _ = x.shape
    norm = lambda n: n.weight if n is not None else None  # noqa: E731
    qkv = attn.qkv(x).reshape(G * T, -1)
    q = kernels.qkv_prep(qkv, cfg.n_head, cfg.n_head_kv, cfg.head_dim, norm(attn.q_norm), norm(attn.k_norm),
                         cfg.rms_eps, rope, cfg.rope_dim, cfg.rope_type == "neox", plan.row_seq, plan.row_pos,
                         plan.row_write, k_cache, v_cache)
    out = kernels.attention(q, k_cache, v_cache, plan.row_seq, plan.row_pos if until is None else until, 0,
                            cfg.attn_scale)
    return attn.wo(out).view(G, T, -1)


def gelu_tanh(t: torch.Tensor) -> torch.Tensor:
    if t.device.type == "cpu" and torch.compiler.is_compiling():  # aten's GELU in a compiled graph (compiled.py)
        return torch.ops.spec_cli.gelu_tanh(t)
    return F.gelu(t, approximate="tanh")


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w_gate = Linear(cfg.n_embd, cfg.n_ff)
        self.w_up = Linear(cfg.n_embd, cfg.n_ff)
        self.w_down = Linear(cfg.n_ff, cfg.n_embd)
        self.gelu = cfg.ffn_act != "silu"  # GELU with the tanh approximation (gemma), else SiLU
        self.act = gelu_tanh if self.gelu else F.silu
        self.gate_up: nn.Module | None = None  # x -> (gate, up) in one product, set by qlinear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None:
            gate, up = self.gate_up(x).split(self.gate_up.sizes, dim=-1)
        else:
            gate, up = self.w_gate(x), self.w_up(x)
        return self.w_down(self.act(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.swa = bool(cfg.swa_layers[layer]) if cfg.swa_layers else False
        self.attn_norm = RMSNorm(cfg.n_embd, cfg.rms_eps)
        self.attn = Attention(cfg, self.swa)
        self.ffn_norm = RMSNorm(cfg.n_embd, cfg.rms_eps)
        self.ffn = FeedForward(cfg)
        self.post_attn_norm = RMSNorm(cfg.n_embd, cfg.rms_eps) if cfg.post_norms else None
        self.post_ffn_norm = RMSNorm(cfg.n_embd, cfg.rms_eps) if cfg.post_norms else None
        # (sc_block descriptor or None where it does not apply, the parts its pointers point into, kept alive);
        # built on first use, reset by qlinear.fuse_block_projections, the one place projections change after load
        self.kernel: tuple[kernels.BlockDesc | None, tuple] | None = None

    def forward(self, x, plan, rope, k_cache, v_cache):
        desc = self.kernel_for(x, k_cache)
        if desc is not None:
            return self._forward_kernels(desc, x, plan, k_cache, v_cache)
        return self.forward_torch(x, plan, rope, k_cache, v_cache)

    def kernel_for(self, x: torch.Tensor, k_cache: torch.Tensor) -> "kernels.BlockDesc | None":
        """The sc_block descriptor when this call runs on the kernels (float32 CPU activations and cache, quantized
        fused projections), else None (torch ops: forward_torch)."""
        if kernels.usable(x) and k_cache.dtype == torch.float32:
            return self.kernel_desc()
        return None

    def forward_torch(self, x, plan, rope, k_cache, v_cache):
        """The block in torch ops (float weights, CUDA); also what compiled.py compiles."""
        h = self.attn(self.attn_norm(x), plan, rope, k_cache, v_cache)
        if self.post_attn_norm is not None:
            h = self.post_attn_norm(h)
        x = x + h
        h = self.ffn(self.ffn_norm(x))
        if self.post_ffn_norm is not None:
            h = self.post_ffn_norm(h)
        return x + h

    def _forward_kernels(self, desc, x, plan: ForwardPlan, k_cache: torch.Tensor,
                         v_cache: torch.Tensor) -> torch.Tensor:
        """The whole block in one kernel call (kernels.cpp sc_block): the steps of forward() on the kernels, rope and
        cache writes row by row."""
        cfg = self.attn.cfg
        G, T, D = x.shape
        base = cfg.rope_base_swa if self.swa else cfg.rope_base
        rope = rope_table(cfg.rope_dim, base, cfg.rope_scale, plan.n_kv)
        desc.window = (cfg.sliding_window or 0) if self.swa else 0  # per call, like the rope base (swa is settable)
        out = kernels.block(desc, x.reshape(G * T, D).contiguous(), rope, plan.row_seq, plan.row_pos, plan.row_write,
                            k_cache, v_cache)
        return out.view(G, T, D)

    def kernel_desc(self) -> "kernels.BlockDesc | None":
        """The block as kernels.cpp's ScBlock, or None where a projection is not a QLinear (float weights, or q/k/v
        or gate/up not fused)."""
        if self.kernel is None:
            attn, ffn = self.attn, self.ffn
            projections = (attn.qkv, attn.wo, ffn.gate_up, ffn.w_down)
            norms = tuple(n.weight if n is not None else None for n in (self.attn_norm, self.ffn_norm,
                                                                        self.post_attn_norm, self.post_ffn_norm,
                                                                        attn.q_norm, attn.k_norm))
            desc = None
            if all(isinstance(p, QLinear) for p in projections):
                cfg = attn.cfg
                desc = kernels.BlockDesc(
                    cfg.n_embd, ffn.gate_up.sizes[0], cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.rope_dim,
                    cfg.rope_type == "neox", ffn.gelu, cfg.rms_eps, cfg.attn_scale, 0,  # window: set per call
                    *(kernels.ptr(n) for n in norms), *(p.desc for p in projections))
            self.kernel = (desc, projections + norms)
        return self.kernel[0]


class Embedding(nn.Module):
    """Token embedding. Holds either a float matrix or the raw GGML rows, dequantized on lookup (saves memory:
    qwen2.5-coder-1.5b's 151936 x 1536 table is 0.9 GB in float32 but 0.13 GB as Q4_K)."""

    def __init__(self, n_vocab: int, n_embd: int):
        super().__init__()
        self.n_vocab, self.n_embd = n_vocab, n_embd
        self.weight: torch.Tensor | None = None  # [n_vocab, n_embd] float
        self.raw: torch.Tensor | None = None  # [n_vocab, row_bytes] uint8
        self.qtype = None
        self.dtype = torch.float32

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.weight is not None:
            return F.embedding(tokens, self.weight)
        from spec_cli.model.quants import dequantize

        rows = self.raw[tokens.reshape(-1)]  # [N, row_bytes]
        out = dequantize(rows.reshape(-1), self.qtype, (rows.shape[0], self.n_embd), self.dtype)
        return out.view(*tokens.shape, self.n_embd)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embd = Embedding(cfg.n_vocab, cfg.n_embd)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layer_main))
        self.norm = RMSNorm(cfg.n_embd, cfg.rms_eps)
        self.output = Linear(cfg.n_embd, cfg.n_vocab)
        self.layer_devices: list[torch.device] = [torch.device("cpu")] * cfg.n_layer_main
        self.output_device = torch.device("cpu")
        self.dtype = torch.float32
        self._stack: kernels.BlockStack | None = None  # kernel_stack's, rebuilt when a block or window changes
        self._tap_slots: dict[tuple[int, ...], torch.Tensor] = {}  # tap_slots' tensors

    def forward_hidden(self, tokens: torch.Tensor, plan: ForwardPlan, kv: list[tuple[torch.Tensor, torch.Tensor]],
                       step=None) -> torch.Tensor:
        """tokens [G, T] -> pre-final-norm hidden states [G, T, D] (on the last layer's device). `step`, when given,
        runs the blocks' loop (compiled.CompiledStep: the same blocks in one compiled graph; one device)."""
        return self.forward_tapped(tokens, plan, kv, (), step)[0]

    def forward_tapped(self, tokens: torch.Tensor, plan: ForwardPlan, kv: list[tuple[torch.Tensor, torch.Tensor]],
                       taps: tuple[int, ...], step=None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """forward_hidden plus the target features a drafter asked for: the input of each layer in `taps` (ids in
        [0, n_layer]; n_layer = the last block's output, the final pre-norm state) for every row, as features
        [G, T, len(taps), D] on the last layer's device (None without taps: nothing is copied)."""
        distinct = tuple(sorted(set(taps)))
        if distinct != taps:  # each layer captured once, in order, then laid out as asked
            hidden, out = self.forward_tapped(tokens, plan, kv, distinct, step)
            return hidden, out[:, :, [distinct.index(layer) for layer in taps]]
        cfg = self.cfg
        x = self.tok_embd(tokens).to(self.dtype)
        if cfg.embed_scale != 1.0:
            x = x * cfg.embed_scale
        if step is not None:  # one graph for the whole loop below
            return step(self, x, plan, kv, taps)
        stack = self.kernel_stack(x, kv)
        if stack is not None:  # the loop below in one kernel call, the taps copied by it
            G, T, D = x.shape
            x = x.reshape(G * T, D).contiguous()  # the embedding's own tensor: the blocks overwrite it
            out = torch.empty(G * T, len(taps), D) if taps else None
            kernels.blocks(stack, x, self.kernel_ropes(plan.n_kv), plan.row_seq, plan.row_pos, plan.row_write,
                           [k for k, _ in kv], [v for _, v in kv], (self.tap_slots(taps), out) if taps else None)
            return x.view(G, T, D), out.view(G, T, len(taps), D) if taps else None
        tapped: dict[int, torch.Tensor] = {}
        plans: dict[torch.device, tuple] = {}
        for i, (layer, device, (k_cache, v_cache)) in enumerate(zip(self.layers, self.layer_devices, kv)):
            if i in taps:
                tapped[i] = x  # each block returns a new tensor: this one is not written again
            if device not in plans:
                p = plan if plan.positions.device == device else plan.to(device)
                plans[device] = (p, self.ropes(p.positions, p.n_kv))
            p, ropes = plans[device]
            x = layer(x.to(device), p, ropes[layer.swa], k_cache, v_cache)
        tapped[len(self.layers)] = x
        return x, torch.stack([tapped[i].to(x.device) for i in taps], dim=2) if taps else None

    def tap_slots(self, taps: tuple[int, ...]) -> torch.Tensor:
        """[n_layer + 1] int32: the slot of each tapped layer in `taps`, -1 elsewhere (kernels.blocks' taps); made
        once per set of taps."""
        slots = self._tap_slots.get(taps)
        if slots is None:
            slots = self._tap_slots[taps] = torch.full((len(self.layers) + 1,), -1, dtype=torch.int32)
            for slot, layer in enumerate(taps):
                slots[layer] = slot
        return slots

    def runs_ragged(self, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
        """Whether a step may come as a ragged plan (ForwardPlan.ragged): where its blocks run on the kernels in one
        call (kernel_stack), whose every row carries its own sequence and position."""
        return self.dtype == torch.float32 and kv[0][0].dtype == torch.float32 and self.block_stack() is not None

    def kernel_stack(self, x: torch.Tensor, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> "kernels.BlockStack | None":
        """Every block on the kernels in one call, or None where one block is not (float weights, CUDA, -ngl
        splits, -tp shards): then the blocks run one call each (Block.forward)."""
        if not kernels.usable(x) or kv[0][0].dtype != torch.float32:
            return None
        return self.block_stack()

    def block_stack(self) -> "kernels.BlockStack | None":
        """kernel_stack's stack for any step of float32 rows and caches, or None where a block is not on the
        kernels or not on the CPU."""
        if not kernels.available() or any(d.type != "cpu" for d in self.layer_devices):
            return None
        descs = tuple(layer.kernel_desc() for layer in self.layers)
        if any(d is None for d in descs):
            return None
        window = self.cfg.sliding_window or 0
        swa = tuple(layer.swa for layer in self.layers)
        windows = tuple(window if s else 0 for s in swa)
        if self._stack is None or self._stack.key != (descs, windows):
            self._stack = kernels.BlockStack(descs, windows, swa)
        return self._stack

    def kernel_ropes(self, n_pos: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The whole rope tables up to n_pos that the kernels index by row position: [full, sliding window]."""
        cfg = self.cfg
        return [rope_table(cfg.rope_dim, base, cfg.rope_scale, n_pos) for base in (cfg.rope_base, cfg.rope_base_swa)]

    def ropes(self, positions: torch.Tensor, n_pos: int) -> dict[bool, tuple[torch.Tensor, torch.Tensor]]:
        """The rope tables of these positions (each < n_pos) for full-attention (False) and sliding-window (True)
        layers; one pair when both use the same base."""
        cfg = self.cfg
        full = rope_tables(positions, n_pos, cfg.rope_dim, cfg.rope_base, cfg.rope_scale)
        if cfg.rope_base_swa == cfg.rope_base:
            return {False: full, True: full}
        return {False: full, True: rope_tables(positions, n_pos, cfg.rope_dim, cfg.rope_base_swa, cfg.rope_scale)}

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., D] (pre-norm) -> logits [..., V] in float32."""
        return self.output(self.normed(hidden)).float()

    def normed(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., D] (pre-norm) -> final-normed [..., D] on the output's device (what the output matrix reads)."""
        return self.norm(hidden.to(self.output_device))
