"""Torch dequantization (`spec_cli.model.quants`) equals the `gguf` package's numpy reference bit for bit."""

from __future__ import annotations

import gguf.quants
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGUFWriter
from gguf import GGMLQuantizationType as T

from spec_cli.errors import SpecCliError
from spec_cli.model import quants
from spec_cli.model.gguf_file import GGUFFile
from spec_cli.model.quants import SUPPORTED, dequantize, load_tensor
from tests.real_models import real_model

REQUIRED = {T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K}
# types `gguf.quants.quantize` can produce, so test data can come from real values
QUANTIZABLE = {T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0}
# byte offsets of the fp16 fields (d, m, dmin) in each block struct of ggml-common.h: random bits there can be
# NaN or inf, whose payloads the two implementations need not agree on, so random-byte blocks get finite ones
FP16_FIELDS = {
    T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,),
    T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,),
    T.IQ4_NL: (0,),
}
BLOCK_TYPES = sorted((SUPPORTED & FP16_FIELDS.keys()), key=lambda t: t.value)


def _shapes(qtype: T) -> list[tuple[int, int]]:
    block = GGML_QUANT_SIZES[qtype][0]
    return [(1, block), (3, 4 * block), (7, 2 * block)]


def _quantized_bytes(qtype: T, shape: tuple[int, int], rng: np.random.Generator) -> np.ndarray:
    values = (rng.standard_normal(shape) * rng.uniform(0.01, 10, (shape[0], 1))).astype(np.float32)
    return np.ascontiguousarray(gguf.quants.quantize(values, qtype)).view(np.uint8).reshape(-1)


def _random_blocks(qtype: T, shape: tuple[int, int], rng: np.random.Generator) -> np.ndarray:
    block, type_size = GGML_QUANT_SIZES[qtype]
    n_blocks = shape[0] * shape[1] // block
    blocks = rng.integers(0, 256, (n_blocks, type_size), dtype=np.uint8)
    for start in FP16_FIELDS[qtype]:
        scales = rng.uniform(-2, 2, n_blocks).astype(np.float16)
        scales[::5] = 0  # all-zero scales occur in real files (pruned rows)
        blocks[:, start : start + 2] = scales.view(np.uint8).reshape(n_blocks, 2)
    return blocks.reshape(-1)


def _reference(raw: np.ndarray, qtype: T, shape: tuple[int, ...]) -> torch.Tensor:
    rows = raw.reshape(-1, raw.size // int(np.prod(shape[:-1], dtype=np.int64)))
    return torch.from_numpy(np.array(gguf.quants.dequantize(rows, qtype), dtype=np.float32)).view(shape)


def assert_bitwise_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype == torch.float32
    assert got.shape == want.shape
    mismatch = got.view(torch.int32) != want.view(torch.int32)
    assert not mismatch.any(), f"{int(mismatch.sum())} of {got.numel()} values differ, first at {mismatch.nonzero()[0]}"


def test_supported_covers_required_types():
    assert REQUIRED <= SUPPORTED


@pytest.mark.parametrize("qtype", sorted(QUANTIZABLE, key=lambda t: t.value), ids=lambda t: t.name)
def test_quantized_values_match_gguf(qtype):
    rng = np.random.default_rng(qtype.value)
    for shape in _shapes(qtype) + [(5, 96)]:
        raw = _quantized_bytes(qtype, shape, rng)
        got = dequantize(torch.from_numpy(raw), qtype, shape)
        assert_bitwise_equal(got, _reference(raw, qtype, shape))


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_random_blocks_match_gguf(qtype):
    # every bit pattern of the codes and packed scales, not only those a quantizer emits
    rng = np.random.default_rng(100 + qtype.value)
    for shape in _shapes(qtype):
        raw = _random_blocks(qtype, shape, rng)
        got = dequantize(torch.from_numpy(raw), qtype, shape)
        assert_bitwise_equal(got, _reference(raw, qtype, shape))


@pytest.mark.parametrize("qtype", [T.F16, T.Q4_0, T.Q5_1, T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_chunk_boundaries_cover_every_block_once(qtype, monkeypatch):
    # a chunk of 3 super-blocks (24 small blocks) that does not divide the tensor: the last chunk is partial
    monkeypatch.setitem(quants._CHUNK_VALUES, "cpu", 3 * 256)
    rng = np.random.default_rng(7)
    shape = (7, 4 * GGML_QUANT_SIZES[qtype][0] + (64 if GGML_QUANT_SIZES[qtype][0] == 1 else 0))
    raw = _quantized_bytes(qtype, shape, rng) if qtype in QUANTIZABLE else _random_blocks(qtype, shape, rng)
    assert_bitwise_equal(dequantize(torch.from_numpy(raw), qtype, shape), _reference(raw, qtype, shape))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("qtype", [T.F32, T.Q8_0, T.Q4_K], ids=lambda t: t.name)
def test_output_dtype_is_a_cast_of_float32(qtype, dtype):
    rng = np.random.default_rng(3)
    shape = (4, 512)
    raw = torch.from_numpy(_quantized_bytes(qtype, shape, rng) if qtype in QUANTIZABLE else _random_blocks(qtype, shape, rng))
    got = dequantize(raw, qtype, shape, dtype)
    assert got.dtype == dtype and got.shape == shape and got.device == raw.device
    assert torch.equal(got, dequantize(raw, qtype, shape).to(dtype))


def test_result_is_a_new_tensor():
    raw = torch.from_numpy(np.arange(8, dtype=np.float32).view(np.uint8).copy())
    got = dequantize(raw, T.F32, (2, 4))
    got.fill_(-1)
    assert torch.equal(raw.view(torch.float32), torch.arange(8, dtype=torch.float32))


def test_misaligned_float_bytes():
    # a float view needs an aligned start; bytes at an odd offset still decode
    buf = torch.zeros(1 + 4 * 6, dtype=torch.uint8)
    buf[1:] = torch.from_numpy(np.arange(6, dtype=np.float32).view(np.uint8).copy())
    assert torch.equal(dequantize(buf[1:], T.F32, (2, 3)), torch.arange(6, dtype=torch.float32).view(2, 3))


def test_unimplemented_type_falls_back_to_gguf():
    qtype = T.IQ4_NL
    assert qtype not in SUPPORTED
    shape = (3, 64)
    raw = _random_blocks(qtype, shape, np.random.default_rng(11))
    got = dequantize(torch.from_numpy(raw), qtype, shape, torch.float32)
    assert_bitwise_equal(got, _reference(raw, qtype, shape))


@pytest.mark.parametrize("qtype", [T.Q8_K, T.Q8_1, T.I32], ids=lambda t: t.name)
def test_type_gguf_cannot_dequantize_is_an_error(qtype):
    block, type_size = GGML_QUANT_SIZES[qtype]
    raw = torch.zeros(2 * type_size, dtype=torch.uint8)
    with pytest.raises(SpecCliError, match=f"unsupported GGML block type {qtype.name}"):
        dequantize(raw, qtype, (2, block))


@pytest.mark.parametrize("qtype", [T.F32, T.Q4_0, T.Q6_K, T.IQ4_NL], ids=lambda t: t.name)
def test_wrong_byte_count_is_an_error(qtype):
    block, type_size = GGML_QUANT_SIZES[qtype]
    for n_bytes in (2 * type_size - 1, 2 * type_size + 1, type_size):
        with pytest.raises(SpecCliError, match="needs"):
            dequantize(torch.zeros(n_bytes, dtype=torch.uint8), qtype, (2, block))


def test_row_not_a_multiple_of_the_block_is_an_error():
    with pytest.raises(SpecCliError, match="multiple"):
        dequantize(torch.zeros(18 * 2, dtype=torch.uint8), T.Q4_0, (2, 16))


def test_raw_must_be_flat_bytes():
    with pytest.raises(SpecCliError, match="uint8"):
        dequantize(torch.zeros(4, dtype=torch.float32), T.F32, (4,))


def test_load_tensor_from_a_gguf_file(tmp_path):
    rng = np.random.default_rng(5)
    path = tmp_path / "types.gguf"
    writer = GGUFWriter(path, "llama")
    expected = {}
    for qtype in sorted(SUPPORTED | {T.IQ4_NL}, key=lambda t: t.value):
        shape = (3, 2 * max(GGML_QUANT_SIZES[qtype][0], 32))
        raw = _quantized_bytes(qtype, shape, rng) if qtype in QUANTIZABLE else _random_blocks(qtype, shape, rng)
        writer.add_tensor(qtype.name, raw.reshape(shape[0], -1), raw_dtype=qtype)
        expected[qtype.name] = _reference(raw, qtype, shape)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    g = GGUFFile(path)
    for name, want in expected.items():
        got = load_tensor(g, name, "cpu")
        assert_bitwise_equal(got, want)
        assert torch.equal(load_tensor(g, name, torch.device("cpu"), torch.bfloat16), want.to(torch.bfloat16))
    with pytest.raises(SpecCliError, match="no tensor named"):
        load_tensor(g, "missing.weight", "cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("qtype", sorted(SUPPORTED, key=lambda t: t.value), ids=lambda t: t.name)
def test_cuda_matches_cpu(qtype):
    rng = np.random.default_rng(13)
    shape = (9, 8 * max(GGML_QUANT_SIZES[qtype][0], 32))
    raw = torch.from_numpy(_quantized_bytes(qtype, shape, rng) if qtype in QUANTIZABLE else _random_blocks(qtype, shape, rng))
    got = dequantize(raw.cuda(), qtype, shape)
    assert got.device.type == "cuda"
    assert_bitwise_equal(got.cpu(), _reference(raw.numpy(), qtype, shape))


# --- real models -------------------------------------------------------------------------------------------


@pytest.mark.real_model
@pytest.mark.parametrize("model", ["smollm2-135m", "gemma3-270m"])
def test_real_model_tensors_match_gguf(model):
    # smollm2: Q4_1, Q8_0, F32; gemma3: Q5_0, Q8_0, Q4_K, Q6_K, F32
    g = GGUFFile(real_model(model))
    smallest: dict[T, str] = {}
    for info in sorted(g.tensors.values(), key=lambda i: i.n_bytes):
        smallest.setdefault(info.qtype, info.name)
    assert smallest.keys() <= SUPPORTED
    for qtype, name in smallest.items():
        info = g.tensors[name]
        rows = min(info.shape[0], 32) if len(info.shape) > 1 else 1
        row_bytes = info.n_bytes // (info.shape[0] if len(info.shape) > 1 else 1)
        got = load_tensor(g, name, "cpu")
        assert got.shape == info.shape
        head = g.data(name)[: rows * row_bytes]
        assert_bitwise_equal(got.reshape(-1, info.shape[-1])[:rows], _reference(head, qtype, (rows, info.shape[-1])))
