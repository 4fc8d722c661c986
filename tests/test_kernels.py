"""The compiled CPU kernels (spec_cli/model/kernels) and the QLinear layers over them (spec_cli/model/qlinear.py):

- for every block type multiplied natively, QLinear(x) is x @ dequantize(W).T up to the 8-bit activation
  quantization (float types: up to float rounding), with the AVX2 and the portable scalar kernels, which agree
  with each other to float rounding;
- every row's output is bit-identical whatever the batch: 1..16 rows, any order, beside 130 others (several row
  tiles, activations quantized by the thread pool), with a bias, on 1 or 2 threads;
- a fused QLinear of segments of different block types is its parts side by side, bit for bit;
- activations are quantized by ggml's rules (hand-checked values; the AVX2 quantizer read back through one-hot
  weights equals the scalar one bit for bit);
- block types without a native kernel become float32 rows and still match;
- attention over the KV cache (causal, GQA, sliding window) matches a plain softmax attention, each row alone
  equals it in a batch of rows of other sequences; the q/k norm + rope + KV write step, RMS norm and the gated
  activations match torch;
- a whole tiny model on the kernels stays within a few percent of its float32-weight logits.
Bit-identity of whole models' logits across batches is tests/test_batch_invariance.py's.
"""

from __future__ import annotations

import gc
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, quants
from gguf import GGMLQuantizationType as T
from torch import nn

from spec_cli.model import kernels, qlinear
from spec_cli.model.batch import Batch
from spec_cli.model.context import Context
from spec_cli.model.loader import load_model
from spec_cli.model.qlinear import QLinear
from spec_cli.model.quants import dequantize
from spec_cli.model.transformer import Transformer, apply_rope, rope_table
from tests.tiny_gguf import K_DIMS, quantizable, random_blocks, write_tiny_gguf

pytestmark = pytest.mark.skipif(not kernels.available(), reason="the compiled kernels were not built")

NATIVE = [T.F32, T.F16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K]
FLOAT = (T.F32, T.F16)
N, K = 52, 512  # n_out not a multiple of 4 (the kernels' row groups), K two 256-value super-blocks
QUANT_REL_ERR = 0.02  # 8-bit activations cost ~0.5-1 % of a product's norm
FLOAT_REL_ERR = 1e-5


def test_native_types_are_the_documented_ones():
    assert kernels.NATIVE_TYPES == frozenset(NATIVE)


# --- fixtures and helpers ------------------------------------------------------------------------------------

@pytest.fixture(params=["avx2", "scalar"])
def isa(request):
    """Runs a test with the AVX2 kernels, then with the portable scalar ones."""
    if request.param == "avx2" and not kernels.has_avx2():
        pytest.skip("this CPU has no AVX2/FMA/F16C")
    kernels.use_avx2(request.param == "avx2")
    yield request.param
    kernels.use_avx2(True)


@pytest.fixture(params=[1, 2])
def threads(request):
    old = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(old)


def with_isa(avx2: bool, fn):
    """fn() computed with the AVX2 (True) or the scalar (False) kernels; AVX2 is restored afterwards."""
    kernels.use_avx2(avx2)
    try:
        return fn()
    finally:
        kernels.use_avx2(True)


def with_threads(n: int, fn):
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return fn()
    finally:
        torch.set_num_threads(old)


def make_weight(qtype: T, shape: tuple[int, int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(raw GGUF bytes [n_bytes] uint8, dequantized float32 [N, K]) of a random weight whose rows have very
    different magnitudes: quantized with gguf.quants where it can, random K-type blocks (tests/tiny_gguf.py)
    otherwise."""
    rng = np.random.default_rng(seed)
    n, k = shape
    w = (rng.standard_normal(shape) * rng.uniform(0.01, 1.0, (n, 1))).astype(np.float32)
    if qtype == T.F32:
        blocks = w.view(np.uint8)
    elif quantizable(qtype):
        blocks = quants.quantize(w, qtype).view(np.uint8)  # F16: float16 values, seen as bytes
    else:
        blocks = random_blocks(qtype, shape, 1.0, rng)
    raw = torch.from_numpy(np.ascontiguousarray(blocks).reshape(-1).copy())
    return raw, dequantize(raw, qtype, shape)


def make_rows(m: int, k: int = K, seed: int = 1) -> torch.Tensor:
    """[m, k] activations: rows of different magnitudes, a few outliers, row 3 all zeros (zero scales)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-2, 1, m).view(m, 1)
    x[torch.rand(m, k, generator=g) < 0.01] *= 20
    if m > 3:
        x[3] = 0
    return x


def reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    y = x.double() @ w.double().T
    return y if bias is None else y + bias.double()


def row_rel_err(y: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Per-row ||y - ref|| / ||ref|| (rows whose reference is zero must be exactly zero: error 0 or inf)."""
    num = (y.double() - ref).norm(dim=-1)
    den = ref.norm(dim=-1)
    return torch.where(den > 0, num / den.clamp_min(1e-300), torch.where(num > 0, math.inf, 0.0))


# --- (a) QLinear against the dequantized weights -------------------------------------------------------------

ACT_OF = {T.Q4_0: kernels.ACT_Q8_0, T.Q5_0: kernels.ACT_Q8_0, T.Q8_0: kernels.ACT_Q8_0, T.Q4_1: kernels.ACT_Q8_1,
          T.Q5_1: kernels.ACT_Q8_1, T.Q4_K: kernels.ACT_Q8_K, T.Q5_K: kernels.ACT_Q8_K, T.Q6_K: kernels.ACT_Q8_K}


@pytest.mark.parametrize("qtype", NATIVE, ids=lambda t: t.name)
def test_qlinear_matches_dequantized_weights(qtype, isa):
    raw, w = make_weight(qtype, (N, K))
    layer = QLinear.from_gguf(raw, qtype, (N, K))
    assert [t for t, _ in layer.segments] == [qtype] and layer.n_out == N and layer.quantized == (qtype not in FLOAT)
    x = torch.randn(16, K, generator=torch.Generator().manual_seed(1)) * torch.logspace(-2, 1, 16).view(16, 1)
    x[3] = 0
    y = layer(x)
    assert y.shape == (16, N) and y.dtype == torch.float32
    err = row_rel_err(y, reference(x, w))
    bound = FLOAT_REL_ERR if qtype in FLOAT else QUANT_REL_ERR
    assert err.max() < bound, f"{qtype.name} [{isa}]: worst row relative error {err.max():.3g} (bound {bound})"
    assert torch.equal(y[3], torch.zeros(N))  # an all-zero row (zero activation scales) gives exact zeros
    assert torch.equal(layer(x.view(4, 4, K)), y.view(4, 4, N))  # leading dims are rows


def quantized_reference(qtype: T, raw: torch.Tensor, w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """ggml's product in float64: each row quantized as the kernels do (`quantize_row`), times the dequantized
    weights; with Q8_1 activations the weights' block minimums m meet the stored s = fp16(amax / 127 * sum of
    codes) instead of d * sum of codes."""
    kind = ACT_OF[qtype]
    block = 256 if kind == kernels.ACT_Q8_K else 32
    out = []
    for row in x:
        q, d, isum, s = kernels.quantize_row(kind, row)
        xq = q.double() * d.double().repeat_interleave(block)
        y = w.double() @ xq
        if kind == kernels.ACT_Q8_1:
            bs = GGML_QUANT_SIZES[qtype][1]
            m = raw.view(N, K // 32, bs)[:, :, 2:4].contiguous().view(torch.float16).double().view(N, K // 32)
            y += m @ (s.double() - d.double() * isum.double())
        out.append(y)
    return torch.stack(out)


@pytest.mark.parametrize("qtype", [t for t in NATIVE if t not in FLOAT], ids=lambda t: t.name)
def test_qlinear_is_the_product_with_ggml_quantized_activations(qtype, isa):
    """Against the product with the activations quantized by ggml's rules, only float rounding is left (here with
    outliers: an activation block's scale follows its largest value)."""
    raw, w = make_weight(qtype, (N, K), seed=9)
    x = make_rows(16, seed=9)
    y = QLinear.from_gguf(raw, qtype, (N, K))(x).double()
    ref = quantized_reference(qtype, raw, w, x)
    scale = x.abs().double() @ w.abs().double().T
    ratio = ((y - ref).abs() / scale).nan_to_num()
    assert ratio.max() < 1e-5, f"{qtype.name} [{isa}]: max |y - ref| / (|x| @ |w|) = {ratio.max():.3g}"


# --- (b) AVX2 and scalar kernels agree ------------------------------------------------------------------------

@pytest.mark.parametrize("qtype", NATIVE, ids=lambda t: t.name)
def test_avx2_and_scalar_kernels_agree(qtype):
    if not kernels.has_avx2():
        pytest.skip("this CPU has no AVX2/FMA/F16C")
    raw, w = make_weight(qtype, (N, K), seed=2)
    layer = QLinear.from_gguf(raw, qtype, (N, K))
    x = make_rows(16, seed=3)
    fast = with_isa(True, lambda: layer(x))
    slow = with_isa(False, lambda: layer(x))
    # the same quantized activations and integer block sums; only the float accumulation order differs, so the
    # difference is float rounding of a sum of K / 32 (or K) terms: bounded by the sum of the terms' magnitudes
    scale = x.abs().double() @ w.abs().double().T
    diff = (fast.double() - slow.double()).abs()
    ratio = (diff / scale).nan_to_num().max()
    assert (diff <= 1e-5 * scale + 1e-30).all(), f"{qtype.name}: max |avx2 - scalar| / (|x| @ |w|) = {ratio:.3g}"


@pytest.mark.parametrize("qtype", sorted(kernels.PACKED_TYPES), ids=lambda t: t.name)
def test_rows_are_packed_8_at_a_time_where_avx2_and_scalar_give_the_same_bits(qtype):
    """Rows of these types are regrouped 8 at a time (X8) for the kernels, the last group padded; the AVX2 and
    scalar kernels do the same arithmetic lane by lane there."""
    if not kernels.has_avx2():
        pytest.skip("this CPU has no AVX2/FMA/F16C")
    raw, _ = make_weight(qtype, (N, K), seed=2)
    layer = QLinear.from_gguf(raw, qtype, (N, K))
    assert [(t, p.shape[0]) for t, p in kernels.pack(layer.segments)] == [(kernels.X8 + qtype, N)]
    x = make_rows(16, seed=3)
    fast = with_isa(True, lambda: layer(x))
    slow = with_isa(False, lambda: layer(x))
    assert torch.equal(fast, slow)


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q5_K], ids=lambda t: t.name)  # packed, and kept as it is
def test_weights_past_a_huge_page_live_in_aligned_buffers_and_multiply_alike(qtype, monkeypatch):
    """Segments of 2 MiB and more are copied into huge-page-advised buffers from a 2 MiB boundary that outlive
    every other reference; the products equal those over plain allocations bit for bit."""
    shape = (4096, 1024)  # 2.25 MiB of Q4_K, 2.75 MiB of Q5_K
    raw, _ = make_weight(qtype, shape, seed=21)
    assert raw.numel() >= kernels.HUGE_PAGE
    x = make_rows(5, shape[1], seed=22)
    huge = QLinear.from_gguf(raw, qtype, shape)
    segment = huge.desc.packed[0][1]
    assert segment.data_ptr() % kernels.HUGE_PAGE == 0 and segment.data_ptr() != raw.data_ptr()
    del segment
    gc.collect()
    y = huge(x)
    monkeypatch.setattr(kernels, "HUGE_PAGE", 1 << 40)  # every buffer a plain torch.empty
    plain = QLinear.from_gguf(raw, qtype, shape)
    assert torch.equal(plain(x), y)


@pytest.mark.parametrize("qtype", sorted(kernels.PACKED_TYPES), ids=lambda t: t.name)
def test_vnni_and_avx2_products_give_the_same_bits(qtype):
    if not kernels.has_vnni():
        pytest.skip("this CPU has no AVX-512 VNNI")
    raw, _ = make_weight(qtype, (N, K), seed=13)
    layer = QLinear.from_gguf(raw, qtype, (N, K))
    x = make_rows(16, seed=14)
    vnni = layer(x)
    kernels.use_vnni(False)
    try:
        assert torch.equal(layer(x), vnni)
    finally:
        kernels.use_vnni(True)


def test_the_multiply_peak_is_measured_where_the_products_have_simd_kernels():
    """int8_peak (scripts/measure_kernels.py's yardstick) is a rate of tens of G products/s or more with AVX2, 0
    with the scalar kernels."""
    if not kernels.has_avx2():
        pytest.skip("this CPU has no AVX2/FMA/F16C")
    assert kernels.int8_peak(20_000) > 1e10
    assert with_isa(False, lambda: kernels.int8_peak(20_000)) == 0.0


def test_measure_kernels_reports_every_packed_type_against_the_peak():
    """scripts/measure_kernels.py (the figures of docs/performance.md) runs on the current packing and prints a GB/s
    and a share of the peak per block type and row count."""
    if not kernels.has_avx2():
        pytest.skip("this CPU has no AVX2/FMA/F16C: no peak to share")
    script = Path(__file__).parent.parent / "scripts" / "measure_kernels.py"
    run = subprocess.run([sys.executable, str(script), "-k", "256", "--mb", "1", "--rows", "1,3", "--seconds", "0"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    rows = [line.split() for line in run.stdout.splitlines()[1:]]
    assert [r[0] for r in rows] == ["Q4_K", "Q6_K", "Q5_0", "Q8_0", "Q4_1"]
    assert all(r.count("GB/s") == 2 and r.count("%") == 2 for r in rows), run.stdout


# --- (c) each row's output is independent of the batch ---------------------------------------------------------

@pytest.mark.parametrize("qtype", NATIVE, ids=lambda t: t.name)
def test_rows_are_bit_identical_in_any_batch(qtype, isa, threads):
    raw, _ = make_weight(qtype, (N, K), seed=4)
    bias = nn.Parameter(torch.randn(N, generator=torch.Generator().manual_seed(5)), requires_grad=False)
    layer = QLinear.from_gguf(raw, qtype, (N, K), bias)
    x = make_rows(16, seed=6)
    alone = with_threads(1, lambda: torch.cat([layer(x[i : i + 1]) for i in range(16)]))  # each row by itself
    assert not torch.equal(alone[:, 0], alone[0, 0].expand(16))  # (rows differ: the test can see a swap)
    for m in range(1, 17):  # the first m rows as one batch
        assert torch.equal(layer(x[:m]), alone[:m]), f"{qtype.name} [{isa}, {threads} threads]: batch of {m} rows"
    perm = torch.randperm(16, generator=torch.Generator().manual_seed(7))
    assert torch.equal(layer(x[perm]), alone[perm])
    assert torch.equal(layer(x.flip(0)), alone.flip(0))
    # among 130 rows: three 64-row tiles, and M * K large enough for the threads to quantize the activations
    big = make_rows(130, seed=8)
    where = torch.tensor([0, 5, 63, 64, 65, 100, 127, 128, 129, 17, 40, 77, 90, 111, 2, 33])
    big[where] = x
    assert torch.equal(layer(big)[where], alone)


# --- (d) fused segments ----------------------------------------------------------------------------------------

FUSED = [(T.Q4_K, 36), (T.Q6_K, 20), (T.Q8_0, 13), (T.F16, 8), (T.Q5_1, 7), (T.F32, 5), (T.Q4_0, 9), (T.Q5_K, 4)]


def test_fused_segments_of_different_types_equal_the_parts(isa, threads):
    parts = []
    for i, (qtype, n) in enumerate(FUSED):  # 8 segments, the most one call takes
        raw, _ = make_weight(qtype, (n, K), seed=10 + i)
        bias = nn.Parameter(torch.randn(n), requires_grad=False) if i % 2 else None
        parts.append(QLinear.from_gguf(raw, qtype, (n, K), bias))
    fused = qlinear._concat(parts)
    assert fused.sizes == [n for _, n in FUSED] and [t for t, _ in fused.segments] == [t for t, _ in FUSED]
    x = make_rows(11, seed=12)
    side_by_side = torch.cat([p(x) for p in parts], dim=-1)
    assert torch.equal(fused(x), side_by_side)
    assert torch.equal(torch.cat([fused(x[i : i + 1]) for i in range(11)]), side_by_side)


def test_fuse_block_projections_fuses_qkv_and_gate_up():
    def lin(qtype, n, seed, bias=False):
        raw, _ = make_weight(qtype, (n, K), seed)
        b = nn.Parameter(torch.randn(n), requires_grad=False) if bias else None
        return QLinear.from_gguf(raw, qtype, (n, K), b)

    wq, wk, wv = lin(T.Q4_K, 32, 20, True), lin(T.Q4_K, 16, 21, True), lin(T.Q6_K, 16, 22, True)
    gate, up = lin(T.Q5_0, 24, 23), lin(T.Q8_0, 24, 24)
    block = SimpleNamespace(attn=SimpleNamespace(wq=wq, wk=wk, wv=wv), ffn=SimpleNamespace(w_gate=gate, w_up=up))
    qlinear.fuse_block_projections(block)
    assert block.attn.wq is None and block.ffn.w_gate is None
    x = make_rows(5, seed=25)
    q, k, v = block.attn.qkv(x).split(block.attn.qkv.sizes, dim=-1)
    assert torch.equal(q, wq(x)) and torch.equal(k, wk(x)) and torch.equal(v, wv(x))
    assert torch.equal(block.ffn.gate_up(x), torch.cat([gate(x), up(x)], dim=-1))


# --- (e) activation quantization -------------------------------------------------------------------------------

def test_quantize_row_q8_0_follows_ggml():
    # ggml (quantize_row_q8_0, x86): d = amax / 127 rounded to fp16, codes = round-half-even(x * (127 / amax))
    x = torch.zeros(128)
    # block 0, amax 127: the multiplier is 1, so the codes are the values rounded half to even
    x[:12] = torch.tensor([127, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5, 126.5, -127, 0.49, 10.2])
    # block 1, amax 1: the multiplier is 127 (63.5 -> 64, 31.75 -> 32, 95.25 -> 95, 38.1 -> 38)
    x[32:38] = torch.tensor([1.0, 0.5, -0.5, 0.25, 0.75, 0.3])
    # block 2 stays zero: d = 0 and zero codes
    # block 3, amax 254 (negative): the multiplier is 0.5 (1.5 -> 2, 2.5 -> 2, 3.5 -> 4, 0.5 -> 0)
    x[96:102] = torch.tensor([-254, 3, 5, 7, -5, 1])
    q, d, isum, _ = kernels.quantize_row(kernels.ACT_Q8_0, x)
    codes = torch.zeros(128, dtype=torch.int8)
    codes[:12] = torch.tensor([127, 0, 2, 2, 0, -2, -2, 4, 126, -127, 0, 10])
    codes[32:38] = torch.tensor([127, 64, -64, 32, 95, 38])
    codes[96:102] = torch.tensor([-127, 2, 2, 4, -2, 0])
    assert torch.equal(q, codes)
    # fp16(1 / 127) = 2^-7 * 1032 / 1024 (1 / 127 = 2^-7 * 1.00787...)
    assert d.tolist() == [1.0, 2**-7 * 1032 / 1024, 0.0, 2.0]
    assert isum.tolist() == [codes[i * 32 : i * 32 + 32].sum().item() for i in range(4)]
    # Q8_1: the same codes and scales, plus s = fp16(amax / 127 * sum of codes)
    q1, d1, isum1, s1 = kernels.quantize_row(kernels.ACT_Q8_1, x)
    assert torch.equal(q1, q) and torch.equal(d1, d) and torch.equal(isum1, isum)
    db = torch.tensor([127.0, 1.0, 0.0, 254.0]) / 127  # the unrounded float32 scales
    assert torch.equal(s1, (db * isum.float()).to(torch.float16).float())


def test_quantize_row_q8_k_follows_ggml():
    # ggml's quantize_row_q8_K_ref: iscale = -127 / (the signed value of largest magnitude), codes =
    # min(127, round-half-even(iscale * x)), d = 1 / iscale; sums of each 16 codes (then of each 32 here)
    x = torch.zeros(256)
    x[:8] = torch.tensor([2.0, -2.0, 1.0, 0.5, -0.25, 0.75, 1.5, -1.0])  # iscale -63.5
    x[100] = -2.0  # as large as the first maximum but later: the first one gives the scale its sign
    q, d, isum, _ = kernels.quantize_row(kernels.ACT_Q8_K, x)
    codes = torch.zeros(256, dtype=torch.int8)
    # -127, 127, -63.5 -> -64, -31.75 -> -32, 15.875 -> 16, -47.625 -> -48, -95.25 -> -95, 63.5 -> 64
    codes[:8] = torch.tensor([-127, 127, -64, -32, 16, -48, -95, 64])
    codes[100] = 127
    assert torch.equal(q, codes)
    assert torch.equal(d, 1 / torch.tensor([-127 / 2.0]))  # float32 1 / iscale
    per16 = codes.view(16, 16).sum(-1)
    assert isum.tolist() == per16.tolist() + per16.view(8, 2).sum(-1).tolist()


def _one_hot_q8_0(k: int) -> torch.Tensor:
    """Q8_0 weights [k, k] whose row n is 1.0 at column n: y = the dequantized activations d * q exactly."""
    blocks = torch.zeros(k, k // 32, 34, dtype=torch.uint8)
    n = torch.arange(k)
    blocks[n, n // 32, :2] = torch.tensor([1.0], dtype=torch.float16).view(torch.uint8)
    blocks[n, n // 32, 2 + n % 32] = 1
    return blocks.view(-1)


def _q4_1_mins(k: int) -> torch.Tensor:
    """Q4_1 weights [k / 32, k]: row b has d = 0 and min 1.0 in block b only: y = the Q8_1 sums s exactly."""
    blocks = torch.zeros(k // 32, k // 32, 20, dtype=torch.uint8)
    b = torch.arange(k // 32)
    blocks[b, b, 2:4] = torch.tensor([1.0], dtype=torch.float16).view(torch.uint8)
    return blocks.view(-1)


def test_kernels_quantize_activations_as_quantize_row_does(isa):
    """The quantizer the products use (AVX2 or scalar) equals the scalar reference `quantize_row` bit for bit,
    read back through weights that pick single codes (exact products and sums)."""
    x = make_rows(8, seed=30)
    x[5, :32] = torch.tensor([0.5, 1.5, 2.5, -2.5] * 8) * (127 / 64)  # ties after scaling
    codes = QLinear.from_gguf(_one_hot_q8_0(K), T.Q8_0, (K, K))(x)
    mins = QLinear.from_gguf(_q4_1_mins(K), T.Q4_1, (K // 32, K))(x)
    for r in range(8):
        q, d, _, _ = kernels.quantize_row(kernels.ACT_Q8_0, x[r])
        assert torch.equal(codes[r], d.repeat_interleave(32) * q.float()), f"row {r} [{isa}]"
        _, _, _, s = kernels.quantize_row(kernels.ACT_Q8_1, x[r])
        assert torch.equal(mins[r], s), f"row {r} [{isa}]"


# --- (f) other block types -------------------------------------------------------------------------------------

@pytest.mark.parametrize("qtype", [T.Q2_K, T.Q3_K], ids=lambda t: t.name)
def test_unsupported_types_become_float32_rows(qtype, isa):
    raw, w = make_weight(qtype, (N, K), seed=40)
    assert qtype not in kernels.NATIVE_TYPES and qlinear.supports(qtype, (N, K))
    layer = QLinear.from_gguf(raw, qtype, (N, K))
    (seg_type, seg), = layer.segments
    assert seg_type == T.F32 and not layer.quantized
    assert torch.equal(seg.view(torch.float32).view(N, K), w)
    x = make_rows(9, seed=41)
    assert row_rel_err(layer(x), reference(x, w)).max() < FLOAT_REL_ERR


def test_supports():
    assert qlinear.supports(T.Q4_K, (8, 512)) and qlinear.supports(T.Q4_0, (8, 64))
    assert not qlinear.supports(T.Q4_K, (8, 64))  # a 256-value block type needs rows of whole blocks
    assert not qlinear.supports(T.F32, (8, 48))  # the kernels need K a multiple of 32
    assert not qlinear.supports(T.F32, (8,))


def test_from_float_and_select_rows(isa):
    w = torch.randn(40, K, generator=torch.Generator().manual_seed(50))
    layer = QLinear.from_float(w, nn.Parameter(torch.randn(40), requires_grad=False))
    (seg_type, raw), = layer.segments
    assert seg_type == T.Q8_0
    # the same blocks as gguf's reference quantizer (ties, where the rounding rules differ, have probability 0)
    assert torch.equal(raw, torch.from_numpy(quants.quantize(w.numpy(), T.Q8_0)))
    back = dequantize(raw.reshape(-1), T.Q8_0, (40, K))
    step = w.view(40, K // 32, 32).abs().amax(-1, keepdim=True) / 127
    # half a step, plus the fp16 rounding of the scale times a code of up to 127
    assert ((back - w).view(40, K // 32, 32).abs() <= step * (0.5 + 127 * 2**-11) * 1.0001).all()
    x = make_rows(6, seed=51)
    ids = torch.tensor([39, 0, 7, 7, 21])
    sub = layer.select_rows(ids)
    assert sub.n_out == 5 and torch.equal(sub(x), layer(x)[:, ids])


# --- attention, RMS norm, GLU ------------------------------------------------------------------------------------

N_SEQ, N_CTX, HD = 3, 40, 16


def kv_cache(h_kv: int, seed: int = 60) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N_SEQ, h_kv, N_CTX, HD, generator=g), torch.randn(N_SEQ, h_kv, N_CTX, HD, generator=g)


def attention_reference(q, k_cache, v_cache, row_seq, row_pos, window, scale) -> torch.Tensor:
    """Plain softmax attention in float64: row r attends its sequence's keys [0, pos] (the last `window`)."""
    R, H, hd = q.shape
    group = H // k_cache.shape[1]
    out = torch.empty(R, H, hd, dtype=torch.float64)
    key_pos = torch.arange(k_cache.shape[2])
    for r in range(R):
        s, p = int(row_seq[r]), int(row_pos[r])
        allowed = (key_pos <= p) & ((p - key_pos < window) if window > 0 else True)
        for h in range(H):
            keys, values = k_cache[s, h // group].double(), v_cache[s, h // group].double()
            scores = (keys @ q[r, h].double()) * scale
            scores[~allowed] = -math.inf
            out[r, h] = torch.softmax(scores, dim=0) @ values
    return out.view(R, H * hd)


ROWS = [(0, 0), (0, 5), (1, 17), (2, 39), (1, 3), (2, 8), (0, 22), (1, 30)]  # (sequence, position)


@pytest.mark.parametrize("heads,window", [((4, 4), 0), ((4, 2), 0), ((8, 2), 0), ((4, 2), 8), ((4, 1), 3)],
                         ids=["mha", "gqa", "gqa4", "gqa-window8", "mqa-window3"])
def test_attention_matches_softmax_reference(heads, window, isa, threads):
    H, H_kv = heads
    k_cache, v_cache = kv_cache(H_kv)
    g = torch.Generator().manual_seed(61)
    # q as the model passes it: a view into a wider q|k|v product row (row stride > H * hd)
    qkv = torch.randn(len(ROWS), (H + 2 * H_kv) * HD, generator=g)
    q = qkv[:, : H * HD].view(len(ROWS), H, HD)
    row_seq = torch.tensor([s for s, _ in ROWS])
    row_pos = torch.tensor([p for _, p in ROWS])
    scale = HD**-0.5
    out = kernels.attention(q, k_cache, v_cache, row_seq, row_pos, window, scale)
    assert out.shape == (len(ROWS), H * HD)
    expected = attention_reference(q, k_cache, v_cache, row_seq, row_pos, window, scale)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    # each row alone (1 thread) is bit-identical to the row in the batch, and to the row in a reversed batch
    alone = with_threads(1, lambda: torch.cat([
        kernels.attention(q[r : r + 1], k_cache, v_cache, row_seq[r : r + 1], row_pos[r : r + 1], window, scale)
        for r in range(len(ROWS))]))
    assert torch.equal(out, alone)
    flip = kernels.attention(q.flip(0).contiguous(), k_cache, v_cache, row_seq.flip(0), row_pos.flip(0), window,
                             scale)
    assert torch.equal(flip, alone.flip(0))
    # one row on 4 threads: a KV head's query heads split between work items, the same bits as all in one
    split = with_threads(4, lambda: kernels.attention(q[3:4], k_cache, v_cache, row_seq[3:4], row_pos[3:4], window,
                                                      scale))
    assert torch.equal(split, alone[3:4])


def test_attention_ignores_keys_past_the_row(isa):
    """Cells past a row's position (a rolled-back draft, another row's future) never change its result."""
    k_cache, v_cache = kv_cache(2, seed=62)
    q = torch.randn(3, 4, HD, generator=torch.Generator().manual_seed(63))
    row_seq, row_pos = torch.tensor([0, 1, 2]), torch.tensor([4, 10, 0])
    before = kernels.attention(q, k_cache, v_cache, row_seq, row_pos, 0, 0.25)
    k2, v2 = k_cache.clone(), v_cache.clone()
    k2[0, :, 5:] = 1e3
    v2[1, :, 11:] = -7.0
    k2[2, :, 1:] = 0.0
    assert torch.equal(kernels.attention(q, k2, v2, row_seq, row_pos, 0, 0.25), before)


def test_attention_avx2_and_scalar_agree():
    if not kernels.has_avx2():
        pytest.skip("this CPU has no AVX2/FMA/F16C")
    k_cache, v_cache = kv_cache(2, seed=64)
    q = torch.randn(len(ROWS), 4, HD, generator=torch.Generator().manual_seed(65))
    row_seq = torch.tensor([s for s, _ in ROWS])
    row_pos = torch.tensor([p for _, p in ROWS])
    run = lambda: kernels.attention(q, k_cache, v_cache, row_seq, row_pos, 0, 0.25)  # noqa: E731
    torch.testing.assert_close(with_isa(True, run), with_isa(False, run), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("neox,normed,rope_dim", [(False, False, HD), (True, False, HD), (True, True, HD),
                                                   (False, True, HD // 2)],
                         ids=["norm-rope", "neox-rope", "neox-qk-norm", "partial-rope-qk-norm"])
def test_qkv_prep_matches_torch_and_writes_only_flagged_rows(neox, normed, rope_dim):
    """Per row of a fused q|k|v product: q (and k) heads RMS-normed, rotated by the row's position; k and v of the
    rows flagged for writing stored at (sequence, position); each row alone gives the same bits as in the batch."""
    H, H_kv = 4, 2
    g = torch.Generator().manual_seed(80)
    R = len(ROWS)
    qkv = torch.randn(R, (H + 2 * H_kv) * HD + 4, generator=g)[:, : (H + 2 * H_kv) * HD]  # a wider row stride
    q_norm, k_norm = (torch.rand(HD, generator=g) + 0.5, torch.rand(HD, generator=g) + 0.5) if normed else (None, None)
    row_seq = torch.tensor([s for s, _ in ROWS])
    row_pos = torch.tensor([p for _, p in ROWS])
    row_write = torch.tensor([1, 1, 0, 1, 1, 0, 1, 1], dtype=torch.uint8)
    cos, sin = rope_table(rope_dim, 10000.0, 1.0, N_CTX)

    def run(rows):
        k_cache, v_cache = torch.full((N_SEQ, H_kv, N_CTX, HD), 7.0), torch.full((N_SEQ, H_kv, N_CTX, HD), 7.0)
        q = kernels.qkv_prep(qkv[rows].contiguous(), H, H_kv, HD, q_norm, k_norm, 1e-6, (cos, sin), rope_dim, neox,
                             row_seq[rows], row_pos[rows], row_write[rows], k_cache, v_cache)
        return q, k_cache, v_cache

    q, k_cache, v_cache = run(torch.arange(R))

    def prep(x, w):  # x [R, heads, hd] -> normed, rotated
        x = x.double()
        if w is not None:
            x = F.rms_norm(x, (HD,), w.double(), 1e-6)
        c, s = cos[row_pos].double()[:, None, :], sin[row_pos].double()[:, None, :]
        return apply_rope(x, c, s, "neox" if neox else "norm", rope_dim)

    parts = qkv.view(R, H + 2 * H_kv, HD)
    torch.testing.assert_close(q.double(), prep(parts[:, :H], q_norm), atol=1e-5, rtol=1e-5)
    k_want, v_want = prep(parts[:, H : H + H_kv], k_norm), parts[:, H + H_kv :]
    written = torch.zeros(N_SEQ, N_CTX, dtype=torch.bool)
    for r, (s_, p_) in enumerate(ROWS):
        if row_write[r]:
            written[s_, p_] = True
            torch.testing.assert_close(k_cache[s_, :, p_].double(), k_want[r], atol=1e-5, rtol=1e-5)
            assert torch.equal(v_cache[s_, :, p_], v_want[r])
    assert (k_cache.permute(0, 2, 1, 3)[~written] == 7.0).all() and (v_cache.permute(0, 2, 1, 3)[~written] == 7.0).all()
    for r in range(R):  # one row by itself: the same q and the same cache cells, bit for bit
        q1, k1, v1 = run(torch.tensor([r]))
        assert torch.equal(q1[0], q[r])
        s_, p_ = ROWS[r]
        if row_write[r]:
            assert torch.equal(k1[s_, :, p_], k_cache[s_, :, p_]) and torch.equal(v1[s_, :, p_], v_cache[s_, :, p_])


def test_rms_norm_and_glu_match_torch_row_by_row(isa, threads):
    g = torch.Generator().manual_seed(70)
    x = torch.randn(9, 96, generator=g) * torch.logspace(-3, 2, 9).view(9, 1)
    w = torch.randn(96, generator=g)
    y = kernels.rms_norm(x, w, 1e-6)
    torch.testing.assert_close(y, F.rms_norm(x.double(), (96,), w.double(), 1e-6).float(), atol=1e-5, rtol=1e-5)
    assert torch.equal(torch.cat([kernels.rms_norm(x[i : i + 1], w, 1e-6) for i in range(9)]), y)
    n_ff = 1100  # more than one 1024-column span per row
    gate_up = torch.randn(5, 2 * n_ff + 8, generator=g)[:, : 2 * n_ff] * 3  # a row stride wider than the row
    gate, up = gate_up[:, :n_ff].double(), gate_up[:, n_ff:].double()
    for gelu, act in ((False, F.silu(gate)), (True, F.gelu(gate, approximate="tanh"))):
        out = kernels.glu(gate_up, n_ff, gelu)
        torch.testing.assert_close(out.double(), act * up, atol=1e-5, rtol=1e-5)
        assert torch.equal(torch.cat([kernels.glu(gate_up[i : i + 1], n_ff, gelu) for i in range(5)]), out)


# --- a whole model -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch,qtype,mixed", [("qwen2", T.Q4_0, False), ("llama", T.Q8_0, False),
                                              ("gemma3", T.Q5_1, False), ("llama", T.Q4_K, True)],
                         ids=["qwen2-Q4_0", "llama-Q8_0", "gemma3-Q5_1", "llama-Q4_K_M"])
def test_tiny_model_on_the_kernels_is_close_to_float32_weights(tmp_path, arch, qtype, mixed):
    """The default CPU path (blocks kept, 8-bit activations, a block per kernel call) against the same weights dequantized to float32 and
    multiplied by torch: teacher-forced logits within a few percent (measured 0.9-2.4 %: each product's 8-bit
    activations add ~1 %)."""
    extra = dict(dims=K_DIMS, qtype_overrides={"attn_v.weight": T.Q6_K, "ffn_down.weight": T.Q6_K,
                                               "output.weight": T.Q6_K, "attn_k.weight": T.Q5_K}) if mixed else {}
    path = write_tiny_gguf(tmp_path / "m.gguf", arch=arch, seed=5, qtype=qtype,
                           n_layer=6 if arch == "gemma3" else 2, **extra)
    q, f32 = load_model(path, device="cpu"), load_model(path, device="cpu", dtype="f32")
    assert q.weights == "q" and f32.weights == "f32"
    assert all(block.kernel_desc() is not None for block in q.model.layers)  # each block is one kernel call
    first = q.model.layers[0].kernel_desc()
    assert q.model.layers[0].kernel_desc() is first  # built once ...
    qlinear.fuse_block_projections(q.model.layers[0])  # ... and again after projections change (the MTP head)
    assert q.model.layers[0].kernel is None and q.model.layers[0].kernel_desc() is not first
    batch = Batch()
    for i, tok in enumerate(range(40, 72)):
        batch.add(tok, i, 0, True)
    got, want = Context(q, n_ctx=64).decode(batch).logits, Context(f32, n_ctx=64).decode(batch).logits
    rel = ((got - want).norm(dim=-1) / want.norm(dim=-1)).max()
    assert rel < 0.05, f"{arch} {qtype.name}: worst position's relative logit error {rel:.3g}"


def test_one_call_for_every_block_equals_a_call_per_block(tmp_path, monkeypatch):
    """Transformer.kernel_stack (kernels.cpp sc_blocks: every block in one call, in place) against a call per block:
    the same logits bit for bit, for a prompt and one-row steps, over sliding-window blocks and a global one whose
    rope bases differ (each block must get its own kind's table)."""
    path = write_tiny_gguf(tmp_path / "g.gguf", arch="gemma3", seed=3, qtype=T.Q4_K, dims=K_DIMS, n_layer=6,
                           qtype_overrides={"ffn_down.weight": T.Q6_K})
    lm = load_model(path, device="cpu")
    lm.config.rope_base = 1e6  # the global block's (gemma3's files have 1e6 there, 1e4 for the sliding ones)

    def logits() -> torch.Tensor:
        ctx, out = Context(lm, n_ctx=64), []
        for start, stop in ((0, 20), (20, 21), (21, 22), (22, 25)):
            batch = Batch()
            for pos in range(start, stop):
                batch.add(40 + pos, pos, 0, True)
            out.append(ctx.decode(batch).logits)
        return torch.cat(out)

    stacked = logits()
    assert lm.model._stack is not None and len(lm.model._stack.key[0]) == 6
    monkeypatch.setattr(Transformer, "kernel_stack", lambda self, x, kv: None)
    assert torch.equal(logits(), stacked)


# --- without the compiled library ---------------------------------------------------------------------------------


def test_without_the_library_auto_falls_back_to_float32_and_q_is_an_error(monkeypatch, capsys, tmp_path):
    """A machine that could not build the kernels: `--dtype auto` loads float32 weights and says why (once, on
    stderr); an explicit `--dtype q` is a clear error."""
    from spec_cli.errors import SpecCliError
    from spec_cli.model import loader

    path = write_tiny_gguf(tmp_path / "tiny-q8.gguf", arch="llama", seed=1, qtype=T.Q8_0)
    monkeypatch.setattr(kernels, "_lib", None)
    monkeypatch.setattr(kernels, "_why", "the C++ kernels were not built (test)")
    loader._warn_once.cache_clear()
    loaded = load_model(path, device="cpu")
    assert loaded.weights == "f32" and not any(isinstance(m, QLinear) for m in loaded.model.modules())
    assert "the C++ kernels were not built (test)" in capsys.readouterr().err
    batch = Batch()
    for i, tok in enumerate([1, 2, 3]):
        batch.add(tok, i, 0, i == 2)
    assert torch.isfinite(Context(loaded, n_ctx=16).decode(batch).logits).all()
    with pytest.raises(SpecCliError, match="--dtype q needs"):
        load_model(path, device="cpu", dtype="q")
