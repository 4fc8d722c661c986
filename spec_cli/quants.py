"""GGML block formats -> torch tensors, dequantized on the device that holds the raw bytes.

Mirrors the block layouts and the float32 arithmetic of `gguf-py/gguf/quants.py` (`dequantize_blocks` of each
type), which follows ggml's `dequantize_row_*` in `ggml-quants.c`. Every product and sum below is done in the same
order, in float32, so the result equals `gguf.quants.dequantize` bit for bit; integer offsets (the `- 8` of Q4_0,
the `- 32` of Q6_K) are applied to the integer codes first because those are exact.

Each block function takes `blocks` [n_blocks, type_size] uint8 and returns float32 holding n_blocks * block_size
values in ggml order. `dequantize` runs it over chunks of blocks so the uint8 and float32 temporaries stay
cache-sized on the CPU (and bounded on a GPU) while the result is written once.
Types without a torch path fall back to the `gguf` package's numpy dequantizer.
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Callable

import gguf
import gguf.quants
import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, QK_K, GGMLQuantizationType

from spec_cli.errors import SpecCliError
from spec_cli.gguf_file import GGUFFile

T = GGMLQuantizationType
# (blocks [n_blocks, type_size] uint8, out [n_blocks, block_size] float32) -> None: writes the values into `out`
Dequantizer = Callable[[torch.Tensor, torch.Tensor], None]

# Output values per chunk: 8 MiB of float32 on the CPU fits in L3 next to the uint8 codes, and the per-op
# overhead of ~10 torch calls stays small against the work; a GPU only needs the bound on temporaries.
_CHUNK_VALUES = {"cpu": 1 << 20, "cuda": 1 << 24}
_DEFAULT_CHUNK_VALUES = 1 << 22


@functools.lru_cache(maxsize=None)
def _bit_weights(device: torch.device, n: int) -> torch.Tensor:
    """[8, n] uint8, row j = 2**(7 - j): a uint8 product with it moves bit j to bit 7 and drops the bits above."""
    weights = torch.tensor([1 << (7 - j) for j in range(8)], dtype=torch.uint8, device=device)
    return weights.view(8, 1).expand(8, n).contiguous()


def _f16(blocks: torch.Tensor, start: int, count: int = 1) -> torch.Tensor:
    """`count` consecutive fp16 fields from byte `start` of each block as float32: [n_blocks, count]."""
    return blocks[:, start : start + 2 * count].contiguous().view(torch.float16).float()


# Unpacking uses shifts and masks by scalars only: torch vectorizes those for uint8, while a shift by a tensor
# of per-position amounts runs element by element (several times slower on the CPU).


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Low nibbles then high nibbles of each group of bytes: [..., n] uint8 -> [..., 2, n]."""
    return torch.stack((qs & 0x0F, qs >> 4), dim=-2)


def _crumbs(qs: torch.Tensor) -> torch.Tensor:
    """2-bit fields at bits 0, 2, 4, 6 of each group of bytes: [..., n] uint8 -> [..., 4, n]."""
    return torch.stack((qs & 0x03, (qs >> 2) & 0x03, (qs >> 4) & 0x03, qs >> 6), dim=-2)


def _bits(qh: torch.Tensor) -> torch.Tensor:
    """Bits 0..7 of each group of bytes: [..., n] uint8 -> [..., 8, n] of 0/1."""
    return (qh.unsqueeze(-2) * _bit_weights(qh.device, qh.shape[-1])) >> 7


# --- plain floats -----------------------------------------------------------------------------------------


def _float_view(dtype: torch.dtype) -> Dequantizer:
    def dequant(blocks: torch.Tensor, out: torch.Tensor) -> None:
        if blocks.storage_offset() % dtype.itemsize:  # a dtype view needs an aligned start
            blocks = blocks.clone()
        out.copy_(blocks.view(dtype))

    return dequant


# --- 32-value blocks ---------------------------------------------------------------------------------------


def _q4_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # d: f16 | qs: 16 bytes, value j in the low nibble of byte j, value 16 + j in its high nibble
    n = blocks.shape[0]
    q = _nibbles(blocks[:, 2:]).view(n, 32).view(torch.int8) - 8  # [n, 32] in -8..7
    torch.mul(_f16(blocks, 0), q, out=out)


def _q4_1(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # d: f16 | m: f16 | qs: 16 bytes as in Q4_0
    n = blocks.shape[0]
    q = _nibbles(blocks[:, 4:]).view(n, 32)  # [n, 32] in 0..15
    torch.mul(_f16(blocks, 0), q, out=out).add_(_f16(blocks, 2))


def _q5_codes(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """5-bit codes of a Q5_0/Q5_1 block: bit j of the little-endian u32 `qh` is bit 4 of value j -> [n, 32]."""
    n = qs.shape[0]
    return _nibbles(qs).view(n, 32) | (_bits(qh.unsqueeze(-1)).view(n, 32) << 4)


def _q5_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # d: f16 | qh: 4 bytes | qs: 16 bytes
    q = _q5_codes(blocks[:, 2:6], blocks[:, 6:]).view(torch.int8) - 16  # [n, 32] in -16..15
    torch.mul(_f16(blocks, 0), q, out=out)


def _q5_1(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # d: f16 | m: f16 | qh: 4 bytes | qs: 16 bytes
    q = _q5_codes(blocks[:, 4:8], blocks[:, 8:])  # [n, 32] in 0..31
    torch.mul(_f16(blocks, 0), q, out=out).add_(_f16(blocks, 2))


def _q8_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # d: f16 | qs: 32 int8
    torch.mul(blocks[:, 2:].view(torch.int8), _f16(blocks, 0), out=out)


# --- 256-value super-blocks (K-quants) -----------------------------------------------------------------------


def _k_scale_min(scales: torch.Tensor) -> torch.Tensor:
    """Eight 6-bit scales and eight 6-bit mins packed in 12 bytes (Q4_K, Q5_K) -> [n, 2 (scale, min), 8] uint8.

    Bytes 0-3 hold scales 0-3 in their low 6 bits, bytes 4-7 mins 0-3; bytes 8-11 hold the low 4 bits of
    scales 4-7 (low nibble) and mins 4-7 (high nibble), whose top 2 bits sit in the top bits of bytes 0-7.
    """
    s = scales.contiguous().view(-1, 3, 4)
    first = s[:, :2]  # [n, 2, 4]: scales 0-3, mins 0-3
    last = _nibbles(s[:, 2]) | ((first >> 2) & 0x30)  # [n, 2, 4]: scales 4-7, mins 4-7
    return torch.cat((first & 0x3F, last), dim=-1)


def _q2_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # scales: 16 bytes (4-bit scale low, 4-bit min high) | qs: 64 bytes | d: f16 | dmin: f16
    n = blocks.shape[0]
    scales = _nibbles(blocks[:, :16].contiguous())  # [n, 2 (scale, min), 16]
    dm = (_f16(blocks, 80, 2).unsqueeze(-1) * scales).unsqueeze(-1)  # [n, 2, 16, 1]: d * scale, dmin * min
    q = _crumbs(blocks[:, 16:80].contiguous().view(n, 2, 32)).view(n, 16, 16)  # [n, 16 sub-blocks, 16] in 0..3
    out.view(n, 16, 16).copy_(q).mul_(dm[:, 0]).sub_(dm[:, 1])


def _q3_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # hmask: 32 bytes | qs: 64 bytes | scales: 12 bytes (16 x 6 bits) | d: f16
    n = blocks.shape[0]
    scales = blocks[:, 96:108].contiguous()
    low = _nibbles(scales[:, :8]).view(n, 16)  # low 4 bits of each scale
    high = _crumbs(scales[:, 8:]).view(n, 16)  # top 2 bits of each scale
    sc = (low | (high << 4)).view(torch.int8) - 32  # [n, 16] in -32..31
    dl = (_f16(blocks, 108) * sc).unsqueeze(-1)  # [n, 16, 1]
    ql = _crumbs(blocks[:, 32:96].contiguous().view(n, 2, 32)).view(n, 16, 16)
    # a clear hmask bit subtracts 4 from the 2-bit code
    qh = _bits(blocks[:, :32].contiguous()).view(n, 16, 16) ^ 1
    q = ql.view(torch.int8) - (qh << 2).view(torch.int8)  # [n, 16, 16] in -4..3
    out.view(n, 16, 16).copy_(q).mul_(dl)


def _q4_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # d: f16 | dmin: f16 | scales: 12 bytes | qs: 128 bytes (4 groups of 32 bytes: low nibbles, then high)
    n = blocks.shape[0]
    dm = (_f16(blocks, 0, 2).unsqueeze(-1) * _k_scale_min(blocks[:, 4:16])).unsqueeze(-1)  # [n, 2, 8, 1]
    q = _nibbles(blocks[:, 16:].contiguous().view(n, 4, 32)).view(n, 8, 32)  # [n, 8 sub-blocks, 32] in 0..15
    out.view(n, 8, 32).copy_(q).mul_(dm[:, 0]).sub_(dm[:, 1])


def _q5_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # d: f16 | dmin: f16 | scales: 12 bytes | qh: 32 bytes (bit i = sub-block i) | qs: 128 bytes as in Q4_K
    n = blocks.shape[0]
    dm = (_f16(blocks, 0, 2).unsqueeze(-1) * _k_scale_min(blocks[:, 4:16])).unsqueeze(-1)  # [n, 2, 8, 1]
    ql = _nibbles(blocks[:, 48:].contiguous().view(n, 4, 32)).view(n, 8, 32)
    qh = _bits(blocks[:, 16:48].contiguous())  # [n, 8, 32]
    q = ql | (qh << 4)  # [n, 8, 32] in 0..31
    out.view(n, 8, 32).copy_(q).mul_(dm[:, 0]).sub_(dm[:, 1])


def _q6_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # ql: 128 bytes (2 halves of 64: low nibbles, then high) | qh: 64 bytes (2 halves of 32 x four 2-bit fields)
    # | scales: 16 int8 | d: f16
    n = blocks.shape[0]
    ql = _nibbles(blocks[:, :128].contiguous().view(n, 2, 64)).view(n, 8, 32)
    qh = _crumbs(blocks[:, 128:192].contiguous().view(n, 2, 32)).view(n, 8, 32)
    q = (ql | (qh << 4)).view(torch.int8).sub_(32).view(n, 16, 16)  # [n, 16 sub-blocks, 16] in -32..31
    d = (_f16(blocks, 208) * blocks[:, 192:208].view(torch.int8)).unsqueeze(-1)  # [n, 16, 1]
    out.view(n, 16, 16).copy_(q).mul_(d)


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
assert all(GGML_QUANT_SIZES[t][0] in (1, 32, QK_K) for t in _DEQUANTIZERS)

SUPPORTED: frozenset[GGMLQuantizationType] = frozenset(_DEQUANTIZERS)


def _check_size(raw: torch.Tensor, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> tuple[int, int]:
    """(block_size, type_size) after checking that `raw` holds exactly the bytes of `shape` in `qtype`."""
    if qtype not in GGML_QUANT_SIZES:
        raise SpecCliError(f"unsupported GGML block type {qtype.name}")
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    if raw.dtype != torch.uint8 or raw.dim() != 1:
        raise SpecCliError(f"raw {qtype.name} data must be a 1-D uint8 tensor, got {raw.dtype} {tuple(raw.shape)}")
    n_values = math.prod(shape)
    if shape and shape[-1] % block_size:
        raise SpecCliError(f"{qtype.name} row of {shape[-1]} values is not a multiple of its block size {block_size}")
    expected = n_values // block_size * type_size
    if raw.numel() != expected:
        raise SpecCliError(f"{qtype.name} tensor of shape {tuple(shape)} needs {expected} bytes, got {raw.numel()}")
    return block_size, type_size


def _dequantize_numpy(raw: torch.Tensor, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> torch.Tensor:
    """The `gguf` package's numpy dequantizer (IQ* and other types without a torch path), on the CPU."""
    rows = raw.cpu().numpy().reshape(-1, raw.numel() // max(1, math.prod(shape[:-1])))
    try:
        values = gguf.quants.dequantize(rows, qtype)
    except NotImplementedError:
        raise SpecCliError(f"unsupported GGML block type {qtype.name}") from None
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).view(shape)


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
    # float32 results go straight into `out`; other dtypes through one reused float32 chunk, then a cast
    work = None if dtype == torch.float32 else torch.empty(min(step, n_blocks), block_size, device=raw.device)
    for b0 in range(0, n_blocks, step):
        chunk = blocks[b0 : b0 + step]
        if work is None:
            fn(chunk, out[b0 : b0 + step])
        else:
            fn(chunk, work[: chunk.shape[0]])
            out[b0 : b0 + step] = work[: chunk.shape[0]]
    return out.view(shape)


def load_tensor(
    gguf_file: GGUFFile, name: str, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Tensor `name` of an open GGUF file as a `dtype` tensor on `device`, dequantized there.

    The raw bytes go to the device first (a single host-to-device copy of the compact form), so on CUDA the
    dequantization runs on the GPU. On the CPU they are read straight from the memory map.
    """
    info = gguf_file.tensors.get(name)
    if info is None:
        raise SpecCliError(f"{gguf_file.path.name}: no tensor named {name}")
    with warnings.catch_warnings():
        # the memory map is read-only; `dequantize` only reads `raw` and always returns a new tensor
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        raw = torch.frombuffer(gguf_file.data(name), dtype=torch.uint8)
    return dequantize(raw.to(device), info.qtype, info.shape, dtype)
