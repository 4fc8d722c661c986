"""Linear layers that keep GGUF weights quantized on the CPU (`--dtype q`), on torch's weight-only kernels.

Replaces `model.Linear` module by module. Both kernels unpack the weights once per tile of 4 input rows, so a
forward of 1 to 4 rows reads ~0.6 (int4) or ~1 (int8) byte per weight where float32 reads 4 (and MKL's float32
product for 2-16 rows costs 2-8x one row here): verifying a short draft costs about one decode. Beyond 4 rows the
cost grows with ceil(rows / 4) (they are float32 FMA kernels; scripts/measure_engine.py prints the curve).

- Q4_0, Q4_1, Q4_K -> `Int4Linear` on `aten._weight_int4pack_mm_for_cpu`. These formats are affine per 32 values
  (w = a * q + b, q in 0..15; for Q4_K a = d * scale, b = -dmin * min of each 32-value sub-block), which is the
  kernel's own format: w = (q - 8) * s + z per group of 32. The 4-bit codes are kept exactly. The kernel is fast
  only with bfloat16 operands (its AVX2/AVX-512 path; float32 takes a scalar loop), so s and z are bfloat16 and so
  are its activations and output: each weight is off by at most 7.5 |s - a| + |z error| (about 2**-8 of its
  group's largest value), and every product sees its input and output rounded to bfloat16.
- every other block type (Q5_*, Q8_0, Q6_K, ...) -> `Int8Linear` on `aten._weight_int8pack_mm`: the exact float32
  values re-quantized to int8 with one scale per output row (the kernel has no groups), error <= scale / 2.

Measured relative error of a layer's output against float32 weights: ~0.35% (int4), 1-2% (int8). llama.cpp rounds
activations to 8 bits per block before these products, an error of the same order; with these layers all four
models keep llama.cpp's greedy token wherever its top-2 margin is clear (tests/test_parity.py's teacher-forced
criterion, run with these layers, the CPU default, and with float32).
Rows are computed independently of each other, so a verify batch gives the logits of single-row decodes.
"""

from __future__ import annotations

import functools

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from torch import nn

from spec_cli.quants import _k_scales, dequantize

T = GGMLQuantizationType
GROUP = 32  # values per (scale, zero) group of the int4 kernel; the GGUF 4-bit formats' sub-block size


def _int4_mm(x: torch.Tensor, packed: torch.Tensor, scale_zero: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP, scale_zero)


# --- int4: GGUF 4-bit blocks -> the kernel's packed layout -----------------------------------------------------
# Each format stores its codes in units of L bytes holding 2L values: value i < L in the low nibble of byte i,
# value L + i in the high nibble. Q4_0/Q4_1: one 16-byte unit per 32-value block; Q4_K: four 32-byte units.


def _int4_fields(qtype: GGMLQuantizationType, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """blocks [N, n_blocks, type_size] -> (qs, a, b): qs [N, n_blocks, units, L] code bytes (a view of `blocks`),
    a and b [N, n_groups] float32 with value = a * code + b for every 32-value group, computed as the dequantizer
    computes them (same products, so a * code + b is its value bit for bit)."""
    N, nb, _ = blocks.shape
    f16 = lambda start: blocks[:, :, start : start + 2].contiguous().view(torch.float16).float().view(N, nb)  # noqa: E731
    if qtype == T.Q4_0:  # d | qs[16]: (q - 8) * d
        d = f16(0)
        return blocks[:, :, None, 2:], d, d * -8
    if qtype == T.Q4_1:  # d | m | qs[16]: q * d + m
        return blocks[:, :, None, 4:], f16(0), f16(2)
    if qtype == T.Q4_K:  # d | dmin | scales[12] | qs[128]: q * (d * sc) - dmin * m per 32 values
        a, m = _k_scales(blocks.reshape(N * nb, -1))  # [N * nb, 8, 1] each
        return blocks[:, :, 16:].unflatten(2, (4, 32)), a.view(N, nb * 8), -m.view(N, nb * 8)
    raise ValueError(f"{qtype.name} is not a 4-bit affine format")


def _pack_int4(qs: torch.Tensor, tile: int) -> torch.Tensor:
    """qs [N, n_blocks, units, L] -> the kernel's packed weight [N, K / 2] for its N tile of `tile` rows.

    The kernel reads, per tile of rows and per k, tile / 2 bytes: byte j holds row j's code in its low nibble and
    row j + tile / 2's in its high nibble (so one 256-bit load unpacks a whole tile). Built straight from the GGUF
    bytes: for k in the low half of a unit the codes are low nibbles, in the high half high nibbles.
    """
    N, B, U, L = qs.shape
    half = tile // 2
    src = qs.unflatten(0, (N // tile, 2, half))
    lo_rows, hi_rows = src[:, 0], src[:, 1]  # [n_tiles, half, B, U, L]
    packed = torch.empty(N // tile, B, U, 2, L, half, dtype=torch.uint8)  # [n_tiles, k = (block, unit, nibble, byte), j]
    view = packed.permute(0, 5, 1, 2, 3, 4)  # [n_tiles, j, B, U, 2, L]
    torch.bitwise_or(lo_rows & 0x0F, hi_rows << 4, out=view[..., 0, :])
    torch.bitwise_or(lo_rows >> 4, hi_rows & 0xF0, out=view[..., 1, :])
    return packed.view(N, B * U * L)


def _codes(qs: torch.Tensor) -> torch.Tensor:
    """qs [N, n_blocks, units, L] -> codes [N, K] uint8 in 0..15, in value order."""
    return torch.stack((qs & 0x0F, qs >> 4), dim=3).view(qs.shape[0], -1)


@functools.lru_cache(maxsize=None)
def _packing_tile() -> int | None:
    """The N tile whose layout `_pack_int4` must produce for this build and CPU (64 on AVX-512, 32 on AVX2), found
    by comparing with torch's own converter on random codes; None = unknown layout (use the converter)."""
    gen = torch.Generator().manual_seed(0)
    qs = torch.randint(0, 256, (128, 2, 1, 16), dtype=torch.uint8, generator=gen)
    reference = torch.ops.aten._convert_weight_to_int4pack_for_cpu(_codes(qs).to(torch.int32), 2)
    for tile in (64, 32):
        if torch.equal(_pack_int4(qs, tile), reference):
            return tile
    return None


def _scale_zero(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-group value = a * q + b -> the kernel's bfloat16 (s, z) [n_groups, N, 2] with value = (q - 8) * s + z.

    s = a rounded to bfloat16; z makes the two agree at the middle code 7.5, so the rounding of s costs at most
    7.5 * |s - a| at either end of the code range.
    """
    s = a.to(torch.bfloat16)
    z = a * 7.5 + b + s.float() * 0.5
    return torch.stack((s, z.to(torch.bfloat16)), dim=-1).transpose(0, 1).contiguous()


class Int4Linear(nn.Module):
    """y = x W^T (+ b) with W as 4-bit codes and per-32 (scale, zero): [*, K] -> [*, N] in x's dtype."""

    def __init__(self, packed: torch.Tensor, scale_zero: torch.Tensor, n_in: int, n_out: int, bias: nn.Parameter | None):
        super().__init__()
        self.n_in, self.n_out = n_in, n_out
        self.register_buffer("packed", packed)  # [N, K / 2] uint8, the kernel's layout
        self.register_buffer("scale_zero", scale_zero)  # [K / 32, N, 2] bfloat16
        self.bias = bias

    @classmethod
    def from_gguf(cls, raw: torch.Tensor, qtype: GGMLQuantizationType, shape: tuple[int, int],
                  bias: nn.Parameter | None = None) -> "Int4Linear":
        N, K = shape
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        blocks = raw.view(N, K // block_size, type_size)
        qs, a, b = _int4_fields(qtype, blocks)
        tile = _packing_tile()
        if tile is not None and N % tile == 0:
            packed = _pack_int4(qs, tile)
        else:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(_codes(qs).to(torch.int32), 2)
        return cls(packed, _scale_zero(a, b), K, N, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.n_in).to(torch.bfloat16)  # [M, K], a fresh contiguous copy
        y = _int4_mm(rows, self.packed, self.scale_zero).to(x.dtype)  # [M, N]
        if self.bias is not None:
            y += self.bias
        return y.view(*x.shape[:-1], self.n_out)


class Int8Linear(nn.Module):
    """y = x W^T (+ b) with W as int8 and one scale per output row: [*, K] -> [*, N] in x's dtype."""

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor, bias: nn.Parameter | None):
        super().__init__()
        self.n_out, self.n_in = weight.shape
        self.register_buffer("weight", weight)  # [N, K] int8
        self.register_buffer("scales", scales)  # [N] bfloat16
        self.bias = bias

    @classmethod
    def from_gguf(cls, raw: torch.Tensor, qtype: GGMLQuantizationType, shape: tuple[int, int],
                  bias: nn.Parameter | None = None) -> "Int8Linear":
        """Re-quantize the exact float32 values of GGUF blocks."""
        N, K = shape
        row_bytes = raw.numel() // N
        chunk = lambda r0, n: dequantize(raw[r0 * row_bytes : (r0 + n) * row_bytes], qtype, (n, K))  # noqa: E731
        return cls(*_requantize(N, K, chunk), bias)

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: nn.Parameter | None = None) -> "Int8Linear":
        """Quantize a float weight [N, K] (e.g. a distilled MTP head's block, stored as float32 in its GGUF)."""
        N, K = weight.shape
        return cls(*_requantize(N, K, lambda r0, n: weight[r0 : r0 + n].float()), bias)

    def select_rows(self, ids: torch.Tensor) -> "Int8Linear":
        """The layer restricted to output rows `ids` (a draft vocabulary): y[..., i] = full y[..., ids[i]]."""
        bias = None if self.bias is None else nn.Parameter(self.bias[ids], requires_grad=False)
        return Int8Linear(self.weight[ids].contiguous(), self.scales[ids].contiguous(), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.n_in).to(torch.bfloat16)  # [M, K]
        y = torch.ops.aten._weight_int8pack_mm(rows, self.weight, self.scales).to(x.dtype)  # [M, N]
        if self.bias is not None:
            y += self.bias
        return y.view(*x.shape[:-1], self.n_out)


def _requantize(N: int, K: int, rows) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 weight [N, K] and bfloat16 scales [N] from float32 rows given by `rows(r0, n)`, a few rows at a time
    (a chunk's floats stay in cache). Each scale is rounded UP to bfloat16, so |w| / scale <= 127."""
    weight = torch.empty(N, K, dtype=torch.int8)
    scales = torch.empty(N, dtype=torch.bfloat16)
    step = max(1, (1 << 17) // K)
    for r0 in range(0, N, step):
        n = min(step, N - r0)
        w = rows(r0, n)  # [n, K] float32
        s = _round_up_bf16(w.abs().amax(dim=1).div_(127).clamp_(min=torch.finfo(torch.float32).tiny))
        scales[r0 : r0 + n] = s
        weight[r0 : r0 + n] = (w / s.float()[:, None]).round_()
    return weight, scales


def _round_up_bf16(x: torch.Tensor) -> torch.Tensor:
    """The smallest bfloat16 >= x, for positive finite float32 x: round the 16 low mantissa bits up."""
    return ((x.view(torch.int32) + 0xFFFF) & -0x10000).view(torch.float32).to(torch.bfloat16)


def _concat(linears: list[nn.Module]) -> nn.Module | None:
    """One module computing the outputs of `linears` (same class, same input size) side by side: their weights
    concatenated along N. None where the int4 layout cannot be cut between them (N not a whole number of tiles)."""
    first = linears[0]
    biases = [m.bias if m.bias is not None else torch.zeros(m.n_out) for m in linears]
    bias = nn.Parameter(torch.cat(biases), requires_grad=False) if any(m.bias is not None for m in linears) else None
    if isinstance(first, Int4Linear):
        tile = _packing_tile()
        if tile is None or any(m.n_out % tile for m in linears):
            return None
        return Int4Linear(torch.cat([m.packed for m in linears]), torch.cat([m.scale_zero for m in linears], dim=1),
                          first.n_in, sum(m.n_out for m in linears), bias)
    return Int8Linear(torch.cat([m.weight for m in linears]), torch.cat([m.scales for m in linears]), bias)


class Fused(nn.Module):
    """Quantized linear layers that read the same input (q, k, v; gate, up), run as few kernel calls as possible:
    each run of consecutive layers of one class is concatenated into one product, whose output is split again.
    forward(x [*, K]) -> one tensor [*, n_out_i] per original layer, in order (views of a shared product)."""

    def __init__(self, linears: list[nn.Module]):
        super().__init__()
        self.products = nn.ModuleList()
        self.sizes: list[list[int]] = []  # per product: the n_out of each layer it holds
        start = 0
        for end in range(1, len(linears) + 1):
            if end < len(linears) and type(linears[end]) is type(linears[start]):
                continue
            run = linears[start:end]
            joined = _concat(run) if len(run) > 1 else None
            if joined is not None:
                self.products.append(joined)
                self.sizes.append([m.n_out for m in run])
            else:
                self.products.extend(run)
                self.sizes.extend([m.n_out] for m in run)
            start = end

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        outs: list[torch.Tensor] = []
        for product, sizes in zip(self.products, self.sizes):
            y = product(x)
            outs.extend(y.split(sizes, dim=-1) if len(sizes) > 1 else (y,))
        return outs


def fuse_projections(model: nn.Module) -> None:
    """Give every block's attention a fused q|k|v and its FFN a fused gate|up (model.Attention.qkv,
    model.FeedForward.gate_up) where at least two of the quantized layers can share one product; the parts
    are dropped (their weights live on in the product)."""
    for block in model.layers:
        fuse_block_projections(block)


def fuse_block_projections(block: nn.Module) -> None:
    """fuse_projections for one block (model.Block)."""
    for owner, names, attr in ((block.attn, ("wq", "wk", "wv"), "qkv"), (block.ffn, ("w_gate", "w_up"), "gate_up")):
        parts = [getattr(owner, n) for n in names]
        if not all(isinstance(m, (Int4Linear, Int8Linear)) for m in parts):
            continue
        fused = Fused(parts)
        if len(fused.products) < len(parts):
            setattr(owner, attr, fused)
            for n in names:
                setattr(owner, n, None)


INT4_TYPES = frozenset({T.Q4_0, T.Q4_1, T.Q4_K})


def supports(qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> bool:
    """Whether a weight of this type and [N, K] shape gets a quantized module (float types keep `Linear`)."""
    if len(shape) != 2 or qtype in (T.F32, T.F16, T.BF16) or qtype not in GGML_QUANT_SIZES:
        return False
    return shape[1] % GROUP == 0  # the int8 kernel has no tail loop over K


def quantized_linear(raw: torch.Tensor, qtype: GGMLQuantizationType, shape: tuple[int, int],
                     bias: nn.Parameter | None = None) -> nn.Module:
    """The quantized module for a GGUF weight [N, K] from its raw bytes ([n_bytes] uint8 on the CPU): int4 for the
    4-bit formats when N is a multiple of the kernel's 16-row step, int8 otherwise."""
    if qtype in INT4_TYPES and shape[0] % 16 == 0:
        return Int4Linear.from_gguf(raw, qtype, shape, bias)
    return Int8Linear.from_gguf(raw, qtype, shape, bias)
