"""Quantized linear layers (`--dtype q`, spec_cli/qlinear.py): what they keep of the GGUF weights, and their effect.

- the 4-bit codes and the per-32 affine factors taken from Q4_0/Q4_1/Q4_K blocks rebuild `quants.dequantize`
  bit for bit: nothing is lost before the kernel;
- our packing equals torch's own converter, so the kernel sees exactly those codes: the weight it multiplies
  with (read back through an identity input) is (q - 8) * s + z with the bfloat16 s, z we chose, and lies within
  the documented bound of the exact weight;
- int8 rows (other block types) are within half a scale of the exact weight;
- concatenated (fused) products equal the separate ones; a model loaded with dtype="q" stays close to float32.
llama.cpp parity with quantized weights (the default on the CPU) is tests/test_parity.py's, for all four models.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from spec_cli import qlinear
from spec_cli.batch import Batch
from spec_cli.context import Context
from spec_cli.loader import load_model
from spec_cli.quants import dequantize

INT4 = [T.Q4_0, T.Q4_1, T.Q4_K]
INT8 = [T.Q8_0, T.Q5_0, T.Q5_1, T.Q6_K]
F16_FIELDS = {T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q4_K: (0, 2), T.Q8_0: (0,), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q6_K: (208,)}


def random_weight(qtype: T, shape: tuple[int, int], seed: int = 0) -> torch.Tensor:
    """Raw bytes of a [N, K] tensor: random codes and scales, rows of very different magnitudes."""
    block, type_size = GGML_QUANT_SIZES[qtype]
    N, K = shape
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (N, K // block, type_size), dtype=np.uint8)
    for start in F16_FIELDS[qtype]:
        scale = (rng.uniform(-1, 1, (N, K // block)) * rng.uniform(0.001, 1, (N, 1))).astype(np.float16)
        blocks[:, :, start : start + 2] = scale[..., None].view(np.uint8)
    return torch.from_numpy(blocks.reshape(-1))


def effective_weight(module: torch.nn.Module, n_in: int) -> torch.Tensor:
    """The [N, K] matrix a module multiplies with: its output for the identity (exact in bfloat16)."""
    with torch.inference_mode():
        return module(torch.eye(n_in)).T


@pytest.mark.parametrize("qtype", INT4)
def test_int4_codes_and_factors_rebuild_the_exact_weight(qtype):
    N, K = 64, 512
    raw = random_weight(qtype, (N, K))
    block, type_size = GGML_QUANT_SIZES[qtype]
    qs, a, b = qlinear._int4_fields(qtype, raw.view(N, K // block, type_size))
    codes = qlinear._codes(qs).view(N, K // 32, 32).float()
    rebuilt = (codes * a[..., None] + b[..., None]).view(N, K)
    assert torch.equal(rebuilt, dequantize(raw, qtype, (N, K)))


def test_packing_matches_torch_converter():
    tile = qlinear._packing_tile()
    if tile is None:
        pytest.skip("this torch build packs int4 weights in a layout we do not build directly (converter used)")
    gen = torch.Generator().manual_seed(1)
    for units, L in ((1, 16), (4, 32)):  # Q4_0/Q4_1 and Q4_K blocks
        qs = torch.randint(0, 256, (4 * tile, 3, units, L), dtype=torch.uint8, generator=gen)
        want = torch.ops.aten._convert_weight_to_int4pack_for_cpu(qlinear._codes(qs).to(torch.int32), 2)
        assert torch.equal(qlinear._pack_int4(qs, tile), want)


@pytest.mark.parametrize("N", [128, 48])  # a whole number of N tiles (our packing), and not (torch's converter)
@pytest.mark.parametrize("qtype", INT4)
def test_int4_kernel_multiplies_with_the_chosen_bf16_factors(qtype, N):
    K = 256
    raw = random_weight(qtype, (N, K), seed=2)
    module = qlinear.quantized_linear(raw, qtype, (N, K))
    assert isinstance(module, qlinear.Int4Linear)
    block, type_size = GGML_QUANT_SIZES[qtype]
    qs, a, b = qlinear._int4_fields(qtype, raw.view(N, K // block, type_size))
    codes = qlinear._codes(qs).view(N, K // 32, 32).float()
    s, z = module.scale_zero.float().unbind(-1)  # [K / 32, N] each
    kernel_view = ((codes - 8) * s.T[..., None] + z.T[..., None]).view(N, K)
    got = effective_weight(module, K)
    assert torch.equal(got, kernel_view.to(torch.bfloat16).float())
    # within the documented bound of the exact weight: 7.5 |s - a| (= span * 2**-10) + the bfloat16 rounding of
    # z and of the output (each 2**-9 of about the group's largest value), here with a factor 2 of slack
    exact = dequantize(raw, qtype, (N, K)).view(N, K // 32, 32)
    span = (exact.amax(-1) - exact.amin(-1))[..., None]  # [N, K / 32, 1]
    largest = exact.abs().amax(-1, keepdim=True)
    err = (got.view(N, K // 32, 32) - exact).abs()
    assert bool((err <= span * 2**-9 + largest * 2**-7).all())


@pytest.mark.parametrize("qtype", INT8)
def test_int8_rows_are_within_half_a_scale(qtype):
    N, K = 40, 512
    raw = random_weight(qtype, (N, K), seed=3)
    module = qlinear.quantized_linear(raw, qtype, (N, K))
    assert isinstance(module, qlinear.Int8Linear)
    exact = dequantize(raw, qtype, (N, K))
    scale = module.scales.float()[:, None]
    assert bool((scale * 127 >= exact.abs().amax(1, keepdim=True)).all())  # no clipping
    assert bool((scale * 127 <= exact.abs().amax(1, keepdim=True) * (1 + 2**-7) + 1e-30).all())  # no wasted range
    got = effective_weight(module, K)
    assert bool(((got - exact).abs() <= scale * 0.5 + got.abs() * 2**-8).all())


@pytest.mark.parametrize("qtypes", [(T.Q4_K, T.Q4_K, T.Q4_K), (T.Q4_K, T.Q4_K, T.Q6_K), (T.Q8_0, T.Q5_0)])
def test_fused_products_equal_the_separate_layers(qtypes):
    K = 256
    shapes = [(128, K), (64, K), (64, K)][: len(qtypes)]
    parts = [qlinear.quantized_linear(random_weight(t, s, seed=i), t, s,
                                      torch.nn.Parameter(torch.randn(s[0]), requires_grad=False))
             for i, (t, s) in enumerate(zip(qtypes, shapes))]
    fused = qlinear.Fused(parts)
    assert len(fused.products) == len({t in qlinear.INT4_TYPES for t in qtypes})  # one per run of one kernel
    x = torch.randn(2, 3, K)
    with torch.inference_mode():
        for got, part in zip(fused(x), parts):
            assert torch.equal(got, part(x))


def test_shapes_and_bias():
    N, K = 64, 128
    bias = torch.nn.Parameter(torch.randn(N), requires_grad=False)
    for qtype in (T.Q4_0, T.Q8_0):
        module = qlinear.quantized_linear(random_weight(qtype, (N, K)), qtype, (N, K), bias)
        x = torch.randn(2, 5, K)
        with torch.inference_mode():
            y = module(x)
            assert y.shape == (2, 5, N) and y.dtype == torch.float32
            no_bias = qlinear.quantized_linear(random_weight(qtype, (N, K)), qtype, (N, K))
            assert torch.allclose(y - bias, no_bias(x), atol=1e-5)


def test_supports_and_choice():
    assert qlinear.supports(T.Q4_K, (256, 512)) and qlinear.supports(T.Q6_K, (100, 512))
    assert not qlinear.supports(T.F32, (256, 512)) and not qlinear.supports(T.F16, (256, 512))
    # the int4 kernel steps over 16 rows: other row counts of a 4-bit format go to int8
    assert isinstance(qlinear.quantized_linear(random_weight(T.Q4_0, (40, 64)), T.Q4_0, (40, 64)), qlinear.Int8Linear)


def _rows(tokens: list[int], start: int = 0) -> Batch:
    batch = Batch()
    for i, tok in enumerate(tokens):
        batch.add(tok, start + i, 0, True)
    return batch


def _teacher_forced_logits(loaded, tokens: list[int]) -> torch.Tensor:
    return Context(loaded, n_ctx=256).decode(_rows(tokens)).logits


@pytest.fixture
def quantized_tiny(tmp_path):
    """Factory: a tiny model of `arch` with its 2-D weights in `qtype`."""
    from tests.tiny_gguf import write_tiny_gguf

    return lambda arch, qtype: write_tiny_gguf(tmp_path / f"{arch}-{qtype.name}.gguf", arch=arch, seed=5, qtype=qtype,
                                               n_layer=6 if arch == "gemma3" else 2)


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q8_0])
def test_tiny_model_q_is_close_to_f32(quantized_tiny, qtype):
    path = quantized_tiny("qwen2", qtype)
    f32, q = load_model(path, device="cpu", dtype="f32"), load_model(path, device="cpu", dtype="q")
    assert isinstance(q.model.layers[0].ffn.w_down, (qlinear.Int4Linear, qlinear.Int8Linear))
    tokens = list(range(40, 72))
    want, got = _teacher_forced_logits(f32, tokens), _teacher_forced_logits(q, tokens)
    assert ((got - want).norm(dim=-1) / want.norm(dim=-1)).max() < 0.03


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q8_0])
def test_verify_batch_equals_one_row_at_a_time(quantized_tiny, arch, qtype):
    """The kernels compute each row on its own, so k rows in one forward give the logits of k single-row
    decodes (what makes greedy speculation lossless) up to float32 attention rounding, seen through bfloat16."""
    loaded = load_model(quantized_tiny(arch, qtype), device="cpu", dtype="q")
    tokens = list(range(40, 60))
    full = _teacher_forced_logits(loaded, tokens)
    ctx = Context(loaded, n_ctx=256)
    one_by_one = torch.cat([ctx.decode(_rows([tok], start=i)).logits for i, tok in enumerate(tokens)])
    torch.testing.assert_close(one_by_one, full, atol=2e-3, rtol=0)
