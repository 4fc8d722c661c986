"""GGML block formats -> torch tensors, dequantized on the device that holds the raw bytes.

Mirrors the block layouts and the float32 arithmetic of `gguf-py/gguf/quants.py` (`dequantize_blocks` of each
type), which follows ggml's `dequantize_row_*` in `ggml-quants.c`. Each product and sum is done in the same order
in float32, so the result equals `gguf.quants.dequantize` bit for bit. Integer offsets (the `- 8` of Q4_0, the
`- 32` of Q6_K) are applied to the integer codes, where they are exact; `a - b` is `a + (-b)` in IEEE arithmetic.

A block function gets `blocks` [n, type_size] uint8 and writes the n * block_size values, in ggml order, into
`out` [n, block_size] float32. `dequantize` runs it over chunks of blocks: the codes of a chunk stay in cache
while they are unpacked, scaled and written once. Types without a torch path fall back to the `gguf` package.
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import gguf.quants
import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from spec_cli.errors import SpecCliError
from spec_cli.model.gguf_file import GGUFFile

T = GGMLQuantizationType

# Values per chunk. On the CPU 2**19 keeps a chunk's codes and float32 output (2 MiB) in cache and amortizes the
# ~25 torch calls per chunk, while the small per-block temporaries (scales, not reused) stay near 64 KiB; on a GPU
# the bound only limits the scratch memory.
_CHUNK_VALUES = {"cpu": 1 << 19, "cuda": 1 << 24}
_DEFAULT_CHUNK_VALUES = 1 << 22

# the low `width` bits of each byte of an int64
_LOW_BITS = {1: 0x0101010101010101, 2: 0x0303030303030303, 4: 0x0F0F0F0F0F0F0F0F}


class _Scratch:
    """Buffers that the chunks of one `dequantize` call reuse, by name.

    Fresh chunk-sized temporaries are a trap on the CPU: while a loader keeps every result alive, glibc serves them
    with new mappings (or trims its heap after them), and their pages fault in again on every chunk, which made a
    chunk about 3x slower than with these reused buffers.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self._buffers: dict[str, torch.Tensor] = {}

    def __call__(self, name: str, shape: tuple[int, ...], dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        size = math.prod(shape)
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < size or buf.dtype != dtype:
            buf = self._buffers[name] = torch.empty(size, dtype=dtype, device=self.device)
        return buf[:size].view(shape)

    def stage(self, name: str, field: torch.Tensor) -> torch.Tensor:
        """A contiguous copy of a strided byte field of the blocks (vectorized byte ops need contiguous rows)."""
        return self(name, tuple(field.shape)).copy_(field)


def _split(src: torch.Tensor, width: int, dst: torch.Tensor) -> torch.Tensor:
    """Cut each byte of `src` [..., m] into 8 // width fields: dst [..., 8 // width, m], row k = bits k*width...

    Works on whole int64 words (m is a multiple of 8 and `src` contiguous): a shift moves every byte of a word
    alike and the mask drops the bits that crossed from a neighbouring byte. A per-row shift amount on uint8
    would run element by element.
    """
    words, fields = src.view(torch.int64), dst.view(torch.int64)
    for k in range(8 // width):
        torch.bitwise_right_shift(words, k * width, out=fields[..., k, :])
    fields &= _LOW_BITS[width]
    return dst


@functools.lru_cache(maxsize=None)
def _spread_bits(device: torch.device) -> torch.Tensor:
    """[256] int64: the 8 bytes of entry b are bit 0 .. bit 7 of b, times 16 (the fifth bit of a 5-bit code)."""
    bits = (torch.arange(256).view(256, 1) >> torch.arange(8)) & 1
    return (bits.to(torch.uint8) << 4).contiguous().view(torch.int64).view(256).to(device)


def _f16(blocks: torch.Tensor, start: int, count: int = 1) -> torch.Tensor:
    """`count` consecutive fp16 fields from byte `start` of each block, as float32: [n, count]."""
    return blocks[:, start : start + 2 * count].contiguous().view(torch.float16).float()


# --- plain floats -----------------------------------------------------------------------------------------


def _float_view(dtype: torch.dtype) -> Dequantizer:
    def dequant(blocks: torch.Tensor, out: torch.Tensor, tmp: _Scratch) -> None:
        if blocks.storage_offset() % dtype.itemsize:  # a dtype view needs an aligned start
            blocks = tmp.stage("bytes", blocks)
        out.copy_(blocks.view(dtype))

    return dequant


# --- 32-value blocks ---------------------------------------------------------------------------------------
# qs: 16 bytes, value j in the low nibble of byte j, value 16 + j in its high nibble;
# qh (Q5_*): 4 bytes, bit j of the little-endian u32 is bit 4 of value j.


def _nibbles32(blocks: torch.Tensor, start: int, tmp: _Scratch) -> torch.Tensor:
    """The 4-bit codes of 16 `qs` bytes at `start`: [n, 32] uint8 in 0..15."""
    n = blocks.shape[0]
    qs = tmp.stage("qs", blocks[:, start : start + 16])
    return _split(qs, 4, tmp("q", (n, 2, 16))).view(n, 32)


def _codes5(blocks: torch.Tensor, start: int, tmp: _Scratch) -> torch.Tensor:
    """The 5-bit codes of `qh` at `start` and `qs` after it: [n, 32] uint8 in 0..31."""
    n = blocks.shape[0]
    q = _nibbles32(blocks, start + 4, tmp)
    qh = tmp("qh", (n, 4), torch.int32).copy_(blocks[:, start : start + 4])
    high = torch.index_select(_spread_bits(q.device), 0, qh.view(-1), out=tmp("high", (n * 4,), torch.int64))
    return q.bitwise_or_(high.view(torch.uint8).view(n, 32))


def _q4_0(blocks: torch.Tensor, out: torch.Tensor, tmp: _Scratch) -> None:
    # d: f16 | qs
    q = _nibbles32(blocks, 2, tmp).view(torch.int8).sub_(8)  # [n, 32] in -8..7
    out.copy_(q).mul_(_f16(blocks, 0))


def _q4_1(blocks: torch.Tensor, out: torch.Tensor, tmp: _Scratch) -> None:
    # d: f16 | m: f16 | qs
    dm = _f16(blocks, 0, 2)  # [n, 2]
    out.copy_(_nibbles32(blocks, 4, tmp)).mul_(dm[:, :1]).add_(dm[:, 1:])


def _q5_0(blocks: torch.Tensor, out: torch.Tensor, tmp: _Scratch) -> None:
    # d: f16 | qh | qs
    q = _codes5(blocks, 2, tmp).view(torch.int8).sub_(16)  # [n, 32] in -16..15
    out.copy_(q).mul_(_f16(blocks, 0))


def _q5_1(blocks: torch.Tensor, out: torch.Tensor, tmp: _Scratch) -> None:
    # d: f16 | m: f16 | qh | qs
    dm = _f16(blocks, 0, 2)  # [n, 2]
    out.copy_(_codes5(blocks, 4, tmp)).mul_(dm[:, :1]).add_(dm[:, 1:])


def _q8_0(blocks: torch.Tensor, out: torch.Tensor, tmp: _Scratch) -> None:
    # d: f16 | qs: 32 int8
    out.copy_(blocks[:, 2:].view(torch.int8)).mul_(_f16(blocks, 0))


# --- 256-value super-blocks (K-quants) -----------------------------------------------------------------------


def _k_scale_min(scales: torch.Tensor) -> torch.Tensor:
    """Eight 6-bit scales and eight 6-bit mins packed in 12 bytes (Q4_K, Q5_K) -> [n, 2 (scale, min), 8] uint8.

    Bytes 0-3 hold scales 0-3 in their low 6 bits, bytes 4-7 mins 0-3; bytes 8-11 hold the low 4 bits of
    scales 4-7 (low nibble) and mins 4-7 (high nibble), whose top 2 bits sit in the top bits of bytes 0-7.
    """
    s = scales.contiguous().view(-1, 3, 4)
    first = s[:, :2]  # [n, 2, 4]: scales 0-3, mins 0-3
    last = torch.stack((s[:, 2] & 0x0F, s[:, 2] >> 4), dim=1) | ((first >> 2) & 0x30)  # scales 4-7, mins 4-7
    return torch.cat((first & 0x3F, last), dim=-1)


def _q2_k(blocks: torch.Tensor, out: torch.Tensor, tmp: _Scratch) -> None:
    # scales: 16 bytes (4-bit scale low, 4-bit min high) | qs: 64 bytes | d: f16 | dmin: f16
    n = blocks.shape[0]
    scales = blocks[:, :16]
    dm = _f16(blocks, 80, 2)  # [n, 2]
    dl = (dm[:, :1] * (scales & 0x0F)).unsqueeze(-1)  # [n, 16, 1]
    ml = (dm[:, 1:] * (scales >> 4)).unsqueeze(-1)  # [n, 16, 1]
    q = _split(tmp.stage("qs", blocks[:, 16:80].view(n, 2, 32)), 2, tmp("q", (n, 2, 4, 32)))  # in 0..3
    out.view(n, 16, 16).copy_(q.view(n, 16, 16)).mul_(dl).sub_(ml)


def _q3_k(blocks: torch.Tensor, out: torch.Tensor, tmp: _Scratch) -> None:
    # hmask: 32 bytes | qs: 64 bytes | scales: 12 bytes (16 x 6 bits) | d: f16
    n = blocks.shape[0]
    scales = blocks[:, 96:108].contiguous()
    low = torch.cat((scales[:, :8] & 0x0F, scales[:, :8] >> 4), dim=1)  # [n, 16]: low 4 bits of each scale
    high = torch.cat([(scales[:, 8:] >> s) & 0x03 for s in (0, 2, 4, 6)], dim=1)  # [n, 16]: top 2 bits
    sc = (low | (high << 4)).view(torch.int8) - 32  # [n, 16] in -32..31
    dl = (_f16(blocks, 108) * sc).unsqueeze(-1)  # [n, 16, 1]
    q = _split(tmp.stage("qs", blocks[:, 32:96].view(n, 2, 32)), 2, tmp("q", (n, 2, 4, 32)))  # in 0..3
    hmask = _split(tmp.stage("hmask", blocks[:, :32].view(n, 1, 32)), 1, tmp("bits", (n, 1, 8, 32)))
    # a clear hmask bit subtracts 4 from the 2-bit code: q - 4 * (1 - bit)
    hmask.bitwise_xor_(1).bitwise_left_shift_(2)
    q.view(torch.int8).sub_(hmask.view(n, 2, 4, 32).view(torch.int8))  # in -4..3
    out.view(n, 16, 16).copy_(q.view(torch.int8).view(n, 16, 16)).mul_(dl)


def _k_scales(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K per sub-block factors: d * scale and dmin * min, each [n, 8, 1] float32."""
    scale_min = _k_scale_min(blocks[:, 4:16]).float()  # [n, 2, 8]
    dm = _f16(blocks, 0, 2)  # [n, 2]: d, dmin
    return (dm[:, :1] * scale_min[:, 0]).unsqueeze(-1), (dm[:, 1:] * scale_min[:, 1]).unsqueeze(-1)


def _q4_k(blocks: torch.Tensor, out: torch.Tensor, tmp: _Scratch) -> None:
    # d: f16 | dmin: f16 | scales: 12 bytes | qs: 128 bytes (4 groups of 32 bytes: low nibbles, then high)
    n = blocks.shape[0]
    d, m = _k_scales(blocks)
    q = _split(tmp.stage("qs", blocks[:, 16:].view(n, 4, 32)), 4, tmp("q", (n, 4, 2, 32)))  # in 0..15
    out.view(n, 8, 32).copy_(q.view(n, 8, 32)).mul_(d).sub_(m)


def _q5_k(blocks: torch.Tensor, out: torch.Tensor, tmp: _Scratch) -> None:
    # d: f16 | dmin: f16 | scales: 12 bytes | qh: 32 bytes (bit i = sub-block i) | qs: 128 bytes as in Q4_K
    n = blocks.shape[0]
    d, m = _k_scales(blocks)
    q = _split(tmp.stage("qs", blocks[:, 48:].view(n, 4, 32)), 4, tmp("q", (n, 4, 2, 32)))
    qh = _split(tmp.stage("qh", blocks[:, 16:48].view(n, 1, 32)), 1, tmp("bits", (n, 1, 8, 32)))
    q.view(n, 8, 32).bitwise_or_(qh.view(n, 8, 32).bitwise_left_shift_(4))  # in 0..31
    out.view(n, 8, 32).copy_(q.view(n, 8, 32)).mul_(d).sub_(m)


def _q6_k(blocks: torch.Tensor, out: torch.Tensor, tmp: _Scratch) -> None:
    # ql: 128 bytes (2 halves of 64: low nibbles, then high) | qh: 64 bytes (2 halves of 32 x four 2-bit fields)
    # | scales: 16 int8 | d: f16
    n = blocks.shape[0]
    ql = _split(tmp.stage("ql", blocks[:, :128].view(n, 2, 64)), 4, tmp("q", (n, 2, 2, 64)))
    qh = _split(tmp.stage("qh", blocks[:, 128:192].view(n, 2, 32)), 2, tmp("qh4", (n, 2, 4, 32)))
    q = ql.view(n, 8, 32).bitwise_or_(qh.view(n, 8, 32).bitwise_left_shift_(4))  # in 0..63
    q = q.view(torch.int8).sub_(32).view(n, 16, 16)  # [n, 16 sub-blocks, 16] in -32..31
    d = (_f16(blocks, 208) * blocks[:, 192:208].view(torch.int8)).unsqueeze(-1)  # [n, 16, 1]
    out.view(n, 16, 16).copy_(q).mul_(d)


# (blocks [n, type_size] uint8, out [n, block_size] float32, scratch) -> None
Dequantizer = Callable[[torch.Tensor, torch.Tensor, _Scratch], None]

_DEQUANTIZERS: dict[GGMLQuantizationType, Dequantizer] = {
    T.F32: _float_view(torch.float32),
    T.F16: _float_view(torch.float16),
    T.BF16: _float_view(torch.bfloat16),
    T.Q4_0: _q4_0,
    T.Q4_1: _q4_1,
    T.Q5_0: _q5_0,
    T.Q5_1: _q5_1,
    T.Q8_0: _q8_0,
    T.Q2_K: _q2_k,
    T.Q3_K: _q3_k,
    T.Q4_K: _q4_k,
    T.Q5_K: _q5_k,
    T.Q6_K: _q6_k,
}

SUPPORTED: frozenset[GGMLQuantizationType] = frozenset(_DEQUANTIZERS)


def _check_size(raw: torch.Tensor, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> tuple[int, int]:
    """(block_size, type_size) after checking that `raw` holds exactly the bytes of `shape` in `qtype`."""
    if qtype not in GGML_QUANT_SIZES:
        raise SpecCliError(f"unsupported GGML block type {qtype.name}")
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    if raw.dtype != torch.uint8 or raw.dim() != 1:
        raise SpecCliError(f"raw {qtype.name} data must be a 1-D uint8 tensor, got {raw.dtype} {tuple(raw.shape)}")
    if shape and shape[-1] % block_size:
        raise SpecCliError(f"{qtype.name} row of {shape[-1]} values is not a multiple of its block size {block_size}")
    expected = math.prod(shape) // block_size * type_size
    if raw.numel() != expected:
        raise SpecCliError(f"{qtype.name} tensor of shape {shape} needs {expected} bytes, got {raw.numel()}")
    return block_size, type_size


def _dequantize_numpy(raw: torch.Tensor, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> torch.Tensor:
    """The `gguf` package's numpy dequantizer (IQ* and other types without a torch path), on the CPU."""
    rows = raw.cpu().numpy().reshape(math.prod(shape[:-1]), -1)
    try:
        values = gguf.quants.dequantize(rows, qtype)
    except NotImplementedError:
        raise SpecCliError(f"unsupported GGML block type {qtype.name}") from None
    return torch.from_numpy(np.array(values, dtype=np.float32)).view(shape)


def dequantize(
    raw: torch.Tensor, qtype: GGMLQuantizationType, shape: tuple[int, ...], dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Values of a GGML tensor from its bytes `raw` ([n_bytes] uint8): a new `shape` tensor of `dtype` on raw.device.

    `shape` is in torch order, its last dimension the contiguous ggml ne0. Computed in float32, then cast.
    """
    shape = tuple(shape)
    block_size, type_size = _check_size(raw, qtype, shape)
    fn = _DEQUANTIZERS.get(qtype)
    if fn is None:
        return _dequantize_numpy(raw, qtype, shape).to(device=raw.device, dtype=dtype)
    n_blocks = raw.numel() // type_size
    out = torch.empty(n_blocks, block_size, dtype=dtype, device=raw.device)  # [n_blocks, block_size]
    blocks = raw.view(n_blocks, type_size)  # [n_blocks, type_size]
    step = max(1, _CHUNK_VALUES.get(raw.device.type, _DEFAULT_CHUNK_VALUES) // block_size)
    tmp = _Scratch(raw.device)
    for b0 in range(0, n_blocks, step):
        chunk = blocks[b0 : b0 + step]
        if dtype == torch.float32:
            fn(chunk, out[b0 : b0 + step], tmp)
        else:  # through a float32 chunk, then a cast
            values = tmp("values", (chunk.shape[0], block_size), torch.float32)
            fn(chunk, values, tmp)
            out[b0 : b0 + step] = values
    return out.view(shape)


def load_tensor(
    gguf_file: GGUFFile, name: str, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Tensor `name` of an open GGUF file as a `dtype` tensor on `device`, dequantized there.

    The raw bytes go to the device first (one host-to-device copy of the compact form), so on CUDA the
    dequantization runs on the GPU. On the CPU they are read straight from the memory map.
    """
    info = gguf_file.tensors.get(name)
    if info is None:
        raise SpecCliError(f"{gguf_file.path.name}: no tensor named {name}")
    raw = gguf_file.tensor_bytes(name)  # a view of the read-only memory map; `dequantize` only reads it
    return dequantize(raw.to(device), info.qtype, info.shape, dtype)
