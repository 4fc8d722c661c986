"""The compiled CPU kernels (kernels.cpp, built by `pip install` into `_kernels*.so`), called through ctypes.

What runs here on the CPU with float32 activations: every product with GGUF weights (kept as their blocks, never
re-quantized), attention over the KV cache, RMS norm and the gated FFN activation. Each computes a row's result the
same way whatever else is in the batch, so logits are bit-identical between one-row decodes, verify batches, server
slots and prompt-cache states (tests/test_batch_invariance.py). The kernels use their own thread pool, as many threads
as torch's intra-op setting (`-t`), and sleep after a short spin when idle.

Where the library was not built (no C++ compiler at install time), `available()` is False, `why_unavailable()`
says why, and the loader falls back to dequantized float32 weights with a warning.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import mmap
import os
from pathlib import Path

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

T = GGMLQuantizationType
# weight types the kernels multiply as they are; others are dequantized to F32 rows first
NATIVE_TYPES = frozenset({T.F32, T.F16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K})
ACT_Q8_0, ACT_Q8_1, ACT_Q8_K = 0, 1, 2  # activation formats of sc_quantize_row (kernels.cpp)
SPIN_NS = int(os.environ.get("SPEC_CLI_SPIN_US", "1000")) * 1000  # how long an idle worker spins before sleeping

_i64, _vp = ctypes.c_int64, ctypes.c_void_p


def _find_library() -> tuple[ctypes.CDLL | None, str]:
    here = Path(__file__).parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = here / f"_kernels{suffix}"
        if path.exists():
            try:
                return ctypes.CDLL(str(path)), ""
            except OSError as e:
                return None, f"{path.name} did not load: {e}"
    return None, "the C++ kernels were not built (reinstall with a C++ compiler: pip install -e .)"


_lib, _why = _find_library()
_BUILD = (lambda st: f"{st.st_size}-{st.st_mtime_ns}")(Path(_lib._name).stat()) if _lib is not None else "none"
if _lib is not None:
    _lib.sc_init.argtypes = [ctypes.c_int, ctypes.c_int, _i64]
    _lib.sc_has_avx2.restype = ctypes.c_int
    _lib.sc_has_vnni.restype = ctypes.c_int
    _lib.sc_linear.argtypes = [_vp, _vp, _i64, _vp, _i64]
    _lib.sc_linear.restype = ctypes.c_int
    _lib.sc_block.argtypes = [_vp, _vp, _i64, _vp, _vp, _vp, _vp, _vp, _vp, _vp, _i64, _vp]
    _lib.sc_block.restype = ctypes.c_int
    _lib.sc_blocks.argtypes = [ctypes.c_int, _vp, _vp, _vp, _i64, _vp, _vp, _vp, _vp, _vp, _vp, _vp, _i64, _vp, _vp,
                               _i64]
    _lib.sc_blocks.restype = ctypes.c_int
    _lib.sc_rms_norm.argtypes = [_vp, _vp, _vp, _i64, _i64, ctypes.c_float]
    _lib.sc_attention.argtypes = [_vp, _i64, _i64, _i64, ctypes.c_int, ctypes.c_int, ctypes.c_int, _vp, _vp, _i64,
                                  _vp, _vp, _i64, ctypes.c_float, _vp]
    _lib.sc_qkv_prep.argtypes = [_vp, _i64, _i64, ctypes.c_int, ctypes.c_int, ctypes.c_int, _vp, _vp, ctypes.c_float,
                                 _vp, _vp, ctypes.c_int, ctypes.c_int, _vp, _vp, _vp, _vp, _vp, _i64, _vp]
    _lib.sc_glu.argtypes = [_vp, _i64, _i64, _i64, ctypes.c_int, _vp]
    _lib.sc_quantize_row.argtypes = [ctypes.c_int, _vp, _i64, _vp, _vp, _vp, _vp]
    _lib.sc_pack_x8.argtypes = [ctypes.c_int, _vp, _i64, _i64, _vp]
    _lib.sc_pack_x8.restype = ctypes.c_int
    _lib.sc_int8_peak.argtypes = [_i64]
    _lib.sc_int8_peak.restype = ctypes.c_double

_state = {"threads": 0, "avx2": True, "vnni": True}


def available() -> bool:
    return _lib is not None


def why_unavailable() -> str:
    return _why


def build_id() -> str:
    """Which build of the library is loaded (its size and modification time), for caches of measured speeds."""
    return _BUILD


def usable(x: torch.Tensor) -> bool:
    """Whether the kernels compute on this activation tensor: float32 on the CPU, no gradient wanted (they have no
    backward; training the MTP head goes through torch)."""
    return (_lib is not None and x.device.type == "cpu" and x.dtype == torch.float32
            and not (x.requires_grad and torch.is_grad_enabled()))


def use_avx2(enabled: bool) -> None:
    """Choose the AVX2 kernels (default, where the CPU has them) or the portable scalar ones (tests compare both)."""
    _state["avx2"] = enabled
    _state["threads"] = 0  # re-init on the next call


def use_vnni(enabled: bool) -> None:
    """Let the packed products use AVX-512 VNNI (default, where the CPU has it) or keep them to AVX2: the same
    bits either way (tests compare both)."""
    _state["vnni"] = enabled
    _state["threads"] = 0


def has_avx2() -> bool:
    return _lib is not None and bool(_lib.sc_has_avx2())


def has_vnni() -> bool:
    return _lib is not None and bool(_lib.sc_has_vnni())


def int8_peak(rounds: int = 2_000_000) -> float:
    """int8 products per second of the multiply instruction the packed products use (AVX-512 VNNI vpdpbusd, else
    AVX2 vpmaddubsw), 16 independent chains on each of torch's threads at once; 0.0 without AVX2."""
    _sync_threads()
    return _lib.sc_int8_peak(rounds)


def _sync_threads() -> None:
    n = torch.get_num_threads()
    if n != _state["threads"]:
        _lib.sc_init(n, 2 if _state["avx2"] and _state["vnni"] else int(_state["avx2"]), SPIN_NS)
        _state["threads"] = n


MAX_SEGMENTS = 8  # ScLinear's arrays (kernels.cpp MAX_SEG)
X8 = 256  # type id offset of rows repacked 8 at a time (kernels.cpp X8)
HUGE_PAGE = 2 << 20  # bytes of an x86-64 transparent huge page
PACKED_TYPES = frozenset({T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q6_K})  # those with an X8 layout


def pack(segments: list[tuple[GGMLQuantizationType, torch.Tensor]]) -> list[tuple[int, torch.Tensor]]:
    """Weight segments as the kernels read them fastest, (type, rows): the rows of a segment of a
    PACKED_TYPES type regrouped 8 at a time (type X8 + its id: the same bytes in another order, as ggml's CPU
    backend repacks Q4_0/Q4_K for AVX2), the last group padded with zero rows that the kernels compute and never
    write (so every row of such a matrix goes through the same kernel: a row's result does not depend on how many
    rows the matrix has); everything else as it is. Every segment is copied into `weight_buffer`s (the memory
    map's pages are then left alone)."""
    out: list[tuple[int, torch.Tensor]] = []
    for qtype, raw in segments:
        if qtype not in PACKED_TYPES:
            out.append((qtype, weight_buffer(raw.shape).copy_(raw)))
            continue
        _sync_threads()
        n, row = raw.shape
        packed = weight_buffer(((n + 7) // 8 * 8, row))
        block, size = GGML_QUANT_SIZES[qtype]
        n_in = row // size * block
        _lib.sc_pack_x8(int(qtype), raw.contiguous().data_ptr(), n, n_in, packed.data_ptr())
        out.append((X8 + int(qtype), packed[:n]))  # n rows; the padding lives on in the view's storage
    return out


def weight_buffer(shape: tuple[int, int]) -> torch.Tensor:
    """An uninitialized uint8 tensor of `shape` for weights that every decode streams whole, in anonymous memory
    advised for transparent huge pages (MADV_HUGEPAGE, from a 2 MiB boundary). Under THP's usual `madvise` policy
    plain allocations and the GGUF memory map get 4 KiB pages, and the TLB misses of reading ~1 GB of them per token
    cost qwen2.5-coder-1.5b 5-8 % and the 0.5b 5-12 % of their decode speed on a 2-core EPYC VM (llama.cpp's buffers
    have 4 KiB pages too). Where THP is off or unsupported the advice is ignored: plain pages."""
    n = shape[0] * shape[1]
    if n < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(shape, dtype=torch.uint8)
    # private: a shared anonymous map is shmem, which THP leaves alone by default; the tensor keeps it alive
    region = mmap.mmap(-1, n + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
    except OSError:
        pass
    whole = torch.frombuffer(region, dtype=torch.uint8)
    skip = -whole.data_ptr() % HUGE_PAGE
    return whole[skip : skip + n].view(shape)


class LinearDesc(ctypes.Structure):
    """kernels.cpp's ScLinear: weight segments [(qtype, raw [n_out, row_bytes] uint8)] stacked along the outputs, of
    rows of K inputs, plus a bias [sum n_out] or None. Packs the segments (`pack`) and keeps them; holds raw pointers
    to the bias: it must outlive the descriptor."""

    _fields_ = [("n_seg", ctypes.c_int32), ("wtypes", ctypes.c_int32 * MAX_SEGMENTS),
                ("weights", ctypes.c_void_p * MAX_SEGMENTS), ("n_out", ctypes.c_int64 * MAX_SEGMENTS),
                ("K", ctypes.c_int64), ("bias", ctypes.c_void_p)]

    def __init__(self, segments: list[tuple[GGMLQuantizationType, torch.Tensor]], K: int, bias: torch.Tensor | None):
        if not 1 <= len(segments) <= MAX_SEGMENTS:
            raise ValueError(f"a linear layer takes 1 to {MAX_SEGMENTS} weight segments, got {len(segments)}")
        self.packed = segments = pack(segments)
        super().__init__(len(segments), tuple(int(t) for t, _ in segments), tuple(r.data_ptr() for _, r in segments),
                         tuple(r.shape[0] for _, r in segments), K, ptr(bias))
        self.n_total = sum(r.shape[0] for _, r in segments)


def ptr(t: torch.Tensor | None) -> int | None:
    """A tensor's data pointer for ctypes, None for no tensor."""
    return t.data_ptr() if t is not None else None


def linear(desc: LinearDesc, x: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 contiguous -> [M, n_out] float32."""
    _sync_threads()
    y = torch.empty(x.shape[0], desc.n_total, dtype=torch.float32)
    rc = _lib.sc_linear(ctypes.addressof(desc), x.data_ptr(), x.shape[0], y.data_ptr(), desc.n_total)
    if rc:
        raise RuntimeError(f"sc_linear failed ({rc}): unsupported weight type or shape")
    return y


class BlockDesc(ctypes.Structure):
    """kernels.cpp's ScBlock: one decoder block's shapes, norm weights and projections (model.Block.kernel_desc)."""

    _fields_ = [("n_embd", ctypes.c_int64), ("n_ff", ctypes.c_int64), ("n_head", ctypes.c_int32),
                ("n_kv_head", ctypes.c_int32), ("head_dim", ctypes.c_int32), ("rope_dim", ctypes.c_int32),
                ("neox", ctypes.c_int32), ("gelu", ctypes.c_int32), ("eps", ctypes.c_float),
                ("attn_scale", ctypes.c_float), ("window", ctypes.c_int64),
                *((name, ctypes.c_void_p) for name in ("attn_norm", "ffn_norm", "post_attn_norm", "post_ffn_norm",
                                                        "q_norm", "k_norm")),
                *((name, LinearDesc) for name in ("qkv", "wo", "gate_up", "down"))]


def block(desc: BlockDesc, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], row_seq: torch.Tensor,
          row_pos: torch.Tensor, row_write: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    """One decoder block over rows x [R, D] float32 contiguous -> [R, D]; rope, rows and caches as for qkv_prep."""
    _sync_threads()
    out = torch.empty_like(x)
    cos, sin = rope
    rc = _lib.sc_block(ctypes.addressof(desc), x.data_ptr(), x.shape[0], cos.data_ptr(), sin.data_ptr(),
                       row_seq.data_ptr(), row_pos.data_ptr(), row_write.data_ptr(), k_cache.data_ptr(),
                       v_cache.data_ptr(), k_cache.shape[2], out.data_ptr())
    if rc:
        raise RuntimeError(f"sc_block failed ({rc}): unsupported weight type or shape")
    return out


class BlockStack:
    """A model's decoder blocks for sc_blocks: their descriptors (each block's attention window set) and which use
    the sliding-window rope base. `key` tells whether it still describes the model (model.Transformer.kernel_stack)."""

    def __init__(self, descs: tuple[BlockDesc, ...], windows: tuple[int, ...], swa: tuple[bool, ...]):
        for desc, window in zip(descs, windows):
            desc.window = window
        self.key = (descs, windows)
        n = len(descs)
        self.descs = (_vp * n)(*(ctypes.addressof(d) for d in descs))  # the descs stay alive through `key`
        self.swa = (ctypes.c_uint8 * n)(*swa)


Taps = tuple[torch.Tensor, torch.Tensor]  # (slot of each layer [n + 1] int32, -1 = untapped; out [R, n_taps, D])


def blocks(stack: BlockStack, x: torch.Tensor, ropes: list[tuple[torch.Tensor, torch.Tensor]], row_seq: torch.Tensor,
           row_pos: torch.Tensor, row_write: torch.Tensor, k_caches: list[torch.Tensor],
           v_caches: list[torch.Tensor], taps: Taps | None = None) -> torch.Tensor:
    """Every block of `stack` over rows x [R, D] float32 contiguous, in place (x is overwritten and returned); ropes
    [full, sliding window] tables, rows as for qkv_prep, the caches of each block. `taps`: the input of block i (i =
    the number of blocks: the last one's output) is copied into out[:, slot[i]] where slot[i] >= 0."""
    _sync_threads()
    n = len(k_caches)
    cos = (_vp * 2)(ropes[0][0].data_ptr(), ropes[1][0].data_ptr())
    sin = (_vp * 2)(ropes[0][1].data_ptr(), ropes[1][1].data_ptr())
    ks = (_vp * n)(*(k.data_ptr() for k in k_caches))
    vs = (_vp * n)(*(v.data_ptr() for v in v_caches))
    slots, out = taps if taps is not None else (None, None)
    if out is not None and (slots.dtype != torch.int32 or slots.numel() != n + 1 or not out.is_contiguous()
                            or out.shape[0] != x.shape[0] or out.shape[2] != x.shape[1]):
        raise ValueError("taps: slots [n_blocks + 1] int32 and a contiguous out [R, n_taps, D] expected")
    rc = _lib.sc_blocks(n, stack.descs, stack.swa, x.data_ptr(), x.shape[0], cos, sin, row_seq.data_ptr(),
                        row_pos.data_ptr(), row_write.data_ptr(), ks, vs, k_caches[0].shape[2], ptr(slots), ptr(out),
                        out.shape[1] if out is not None else 0)
    if rc:
        raise RuntimeError(f"sc_blocks failed ({rc}): unsupported weight type or shape")
    return x


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """[..., D] -> [..., D]: x / sqrt(mean(x^2) + eps) * weight, row by row (the sum of squares in double)."""
    x = x.contiguous()
    out = torch.empty_like(x)
    D = x.shape[-1]
    _lib.sc_rms_norm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // D, D, eps)
    return out


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, row_seq: torch.Tensor,
              row_pos: torch.Tensor, window: int, scale: float) -> torch.Tensor:
    """q [R, H, hd] (each head's vector contiguous), caches [n_seq, H_kv, n_ctx, hd], row_seq/row_pos [R] int64 ->
    [R, H * hd]: row r attends to its sequence's keys [0, pos] (the last `window` of them when window > 0)."""
    _sync_threads()
    R, H, hd = q.shape
    if q.stride(2) != 1:
        q = q.contiguous()
    out = torch.empty(R, H * hd, dtype=torch.float32)
    _lib.sc_attention(q.data_ptr(), q.stride(0), q.stride(1), R, H, k_cache.shape[1], hd, k_cache.data_ptr(),
                      v_cache.data_ptr(), k_cache.shape[2], row_seq.data_ptr(), row_pos.data_ptr(), window, scale,
                      out.data_ptr())
    return out


def qkv_prep(qkv: torch.Tensor, n_head: int, n_kv_head: int, head_dim: int, q_norm: torch.Tensor | None,
             k_norm: torch.Tensor | None, eps: float, rope: tuple[torch.Tensor, torch.Tensor], rope_dim: int, neox: bool,
             row_seq: torch.Tensor, row_pos: torch.Tensor, row_write: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor) -> torch.Tensor:
    """Rows of a fused q|k|v product [R, (H + 2 H_kv) hd] -> q [R, H, hd], each head normed (q_norm/k_norm given)
    and rotated by its row's position (rope = cos, sin tables [n_pos, rope_dim / 2]); k and v of the rows flagged in
    row_write [R] uint8 are stored into the caches [n_seq, H_kv, n_ctx, hd] at (row_seq, row_pos)."""
    R = qkv.shape[0]
    q = torch.empty(R, n_head, head_dim, dtype=torch.float32)
    cos, sin = rope
    _lib.sc_qkv_prep(qkv.data_ptr(), qkv.stride(0), R, n_head, n_kv_head, head_dim,
                     ptr(q_norm), ptr(k_norm), eps, cos.data_ptr(), sin.data_ptr(), rope_dim,
                     int(neox), row_seq.data_ptr(), row_pos.data_ptr(), row_write.data_ptr(), k_cache.data_ptr(),
                     v_cache.data_ptr(), k_cache.shape[2], q.data_ptr())
    return q


def glu(gate_up: torch.Tensor, n_ff: int, gelu: bool) -> torch.Tensor:
    """gate_up [M, 2 F] (gate columns first) -> act(gate) * up [M, F]; act = SiLU, or tanh-approximated GELU."""
    _sync_threads()
    M = gate_up.shape[0]
    out = torch.empty(M, n_ff, dtype=torch.float32)
    _lib.sc_glu(gate_up.data_ptr(), gate_up.stride(0), M, n_ff, int(gelu), out.data_ptr())
    return out


def quantize_row(kind: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One float32 row [K] as the kernels quantize activations: codes [K] int8, scales, code sums (int16; per 256-value
    block of Q8_K the 16 sums of 16 codes then the 8 sums of 32, else the sum of each 32) and, for Q8_1,
    fp16(d * sum). For tests."""
    K = x.numel()
    block = 256 if kind == ACT_Q8_K else 32
    q = torch.empty(K, dtype=torch.int8)
    d = torch.empty(K // block)
    isum = torch.empty(K // 256 * 24 if kind == ACT_Q8_K else K // 32, dtype=torch.int16)
    s = torch.empty(K // 32)
    _lib.sc_quantize_row(kind, x.contiguous().data_ptr(), K, q.data_ptr(), d.data_ptr(), isum.data_ptr(), s.data_ptr())
    return q, d, isum, s
