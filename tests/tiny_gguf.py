"""Writes tiny random GGUF models (llama / qwen2 / gemma3 layouts) with gguf.GGUFWriter, for fast CPU tests.

The output projection is scaled up so the logits are well separated: greedy decoding then has no near ties,
and batched verification (k rows) picks the same argmax as one-row decoding.

Weights of the block types gguf.quants can quantize (F16, Q4_0 ... Q8_0) are quantized from the float draw; the
K types it cannot (Q2_K ... Q6_K) get random codes and sub-block scales with the fp16 super-block scales set so
the weights have the float draw's standard deviation (`random_blocks`). K types need rows of a multiple of 256
values: pass larger `dims` (e.g. K_DIMS).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, quants

from tests.tiny_vocab import tiny_bpe_metadata

T = GGMLQuantizationType
DIMS = dict(n_embd=64, n_ff=128, n_head=4, n_head_kv=2, head_dim=16)
K_DIMS = dict(n_embd=256, n_ff=512, n_head=4, n_head_kv=2, head_dim=64)  # every row a multiple of 256 values
N_VOCAB = len(tiny_bpe_metadata()["tokenizer.ggml.tokens"])
# another vocabulary for the tiny model's weights (write_other_vocab): every token at another id, and two tokens
# without a counterpart in the tiny vocabulary: 119 ('w'), the tiny target's most frequent output token, and 281 ('Ġb')
REVERSED = list(reversed(range(N_VOCAB)))
RENAMED = [119, 281]

# block types gguf.quants cannot quantize: byte offsets of a block's fp16 scales (d, then dmin where there is
# one) and the dmin / d ratio that centres random codes (E[scale * code] / E[min] for uniform random bytes)
_RANDOM_K = {T.Q2_K: ((80, 82), 1.5), T.Q3_K: ((108,), 0.0), T.Q4_K: ((0, 2), 7.5), T.Q5_K: ((0, 2), 15.5),
             T.Q6_K: ((208,), 0.0)}


def quantizable(qtype: GGMLQuantizationType) -> bool:
    """Whether gguf.quants.quantize handles this block type (else random_blocks makes its weights)."""
    return qtype not in _RANDOM_K


def random_blocks(qtype: GGMLQuantizationType, shape: tuple[int, int], std: float,
                  rng: np.random.Generator) -> np.ndarray:
    """[N, K] weights of a K block type as raw blocks [N, row_bytes] uint8: random codes and sub-block scales,
    fp16 super-block scales chosen so the dequantized weights' standard deviation is about `std` (each row's
    scale also varies by up to 2x)."""
    block, type_size = GGML_QUANT_SIZES[qtype]
    N, K = shape
    blocks = rng.integers(0, 256, (N, K // block, type_size), dtype=np.uint8)
    offsets, ratio = _RANDOM_K[qtype]
    row_scale = rng.uniform(0.5, 1.0, (N, 1)).astype(np.float32)

    def set_scales(d: float) -> None:
        for off, value in zip(offsets, (d, d * ratio)):
            field = np.broadcast_to(row_scale * value, (N, K // block)).astype(np.float16)
            blocks[:, :, off : off + 2] = field.view(np.uint8).reshape(N, K // block, 2)

    set_scales(1.0)
    measured = float(quants.dequantize(blocks.reshape(N, -1), qtype).std())
    set_scales(std / measured)
    return blocks.reshape(N, -1)


def target_matrices(target_path) -> tuple[np.ndarray, np.ndarray]:
    """A target GGUF's embedding and output matrices as float arrays [n_vocab, n_embd] (the heads' tests share them
    with the target)."""
    from spec_cli.model.gguf_file import GGUFFile
    from spec_cli.model.quants import load_tensor

    target = GGUFFile(target_path)
    return load_tensor(target, "token_embd.weight").numpy(), load_tensor(target, "output.weight").numpy()


def add_metadata(w: GGUFWriter, meta: dict) -> None:
    for key, value in meta.items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, list):
            w.add_array(key, value)
        else:
            raise TypeError(f"{key}: {type(value)}")


def write_tiny_gguf(
    path: Path,
    arch: str = "llama",
    seed: int = 0,
    n_layer: int = 2,
    n_ctx_train: int = 512,
    qtype: GGMLQuantizationType = GGMLQuantizationType.F32,
    output_scale: float = 4.0,
    sliding_window: int = 8,
    perturb: float = 0.0,
    with_tokenizer: bool = True,
    vocab_changes: dict | None = None,
    dims: dict | None = None,
    qtype_overrides: dict[str, GGMLQuantizationType] | None = None,
    token_order: list[int] | None = None,
) -> Path:
    """`perturb` > 0 adds that much relative noise (from another seed) to every weight: a draft model that
    agrees with the unperturbed target most of the time, not always (not for K block types: random blocks).
    `token_order` (a permutation of the vocabulary) gives token id j to the token that had id token_order[j], its
    embedding and output rows with it: the same model over a reordered vocabulary (another vocabulary, to a check
    that compares ids).
    `dims` overrides entries of DIMS; `qtype_overrides` maps a tensor name suffix ("attn_v.weight",
    "output.weight", ...) to the block type of those matrices (as a Q4_K_M file mixes Q4_K and Q6_K)."""
    rng = np.random.default_rng(seed)
    noise = np.random.default_rng(seed + 1000)
    vocab = tiny_bpe_metadata()
    for key, value in (vocab_changes or {}).items():
        if key == "rename_tokens":  # other token texts at these ids: another vocabulary
            vocab["tokenizer.ggml.tokens"] = list(vocab["tokenizer.ggml.tokens"])
            for i in value:
                vocab["tokenizer.ggml.tokens"][i] += "x"
        else:
            vocab[key] = value
    if token_order is not None:
        for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type"):
            vocab[key] = [vocab[key][i] for i in token_order]
        for key in ("bos", "eos", "padding"):
            vocab[f"tokenizer.ggml.{key}_token_id"] = token_order.index(vocab[f"tokenizer.ggml.{key}_token_id"])
    n_vocab = len(vocab["tokenizer.ggml.tokens"])
    dims = {**DIMS, **(dims or {})}
    d, ff, nh, nkv, hd = (dims[k] for k in ("n_embd", "n_ff", "n_head", "n_head_kv", "head_dim"))
    w = GGUFWriter(str(path), arch)
    meta = {
        f"{arch}.block_count": n_layer,
        f"{arch}.context_length": n_ctx_train,
        f"{arch}.embedding_length": d,
        f"{arch}.feed_forward_length": ff,
        f"{arch}.attention.head_count": nh,
        f"{arch}.attention.head_count_kv": nkv,
        f"{arch}.attention.key_length": hd,
        f"{arch}.attention.value_length": hd,
        f"{arch}.rope.freq_base": 10000.0,
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-6,
    }
    if arch == "gemma3":
        meta[f"{arch}.attention.sliding_window"] = sliding_window
    add_metadata(w, meta)
    if with_tokenizer:
        add_metadata(w, vocab)

    def add(name: str, shape: tuple[int, ...], scale: float, quantize: bool = True, offset: float = 0.0):
        arr = rng.standard_normal(shape) * scale + offset
        if perturb:
            arr = arr + noise.standard_normal(shape) * scale * perturb
        if token_order is not None and name in ("token_embd.weight", "output.weight"):
            arr = arr[token_order]
        arr = arr.astype(np.float32)
        qt = next((t for suffix, t in (qtype_overrides or {}).items()
                   if name == suffix or name.endswith("." + suffix)), qtype)
        if quantize and qt != GGMLQuantizationType.F32 and len(shape) == 2:
            blocks = quants.quantize(arr, qt) if quantizable(qt) else random_blocks(qt, shape, scale, rng)
            w.add_tensor(name, blocks, raw_dtype=qt)  # gguf infers the shape from the bytes
        else:
            w.add_tensor(name, arr)

    add("token_embd.weight", (n_vocab, d), 1.0)
    add("output_norm.weight", (d,), 0.1, offset=1.0)
    if arch != "gemma3":
        add("output.weight", (n_vocab, d), output_scale / np.sqrt(d))
    for il in range(n_layer):
        p = f"blk.{il}."
        add(p + "attn_norm.weight", (d,), 0.1, offset=1.0)
        add(p + "attn_q.weight", (nh * hd, d), 1.0 / np.sqrt(d))
        add(p + "attn_k.weight", (nkv * hd, d), 1.0 / np.sqrt(d))
        add(p + "attn_v.weight", (nkv * hd, d), 1.0 / np.sqrt(d))
        add(p + "attn_output.weight", (d, nh * hd), 1.0 / np.sqrt(nh * hd))
        add(p + "ffn_norm.weight", (d,), 0.1, offset=1.0)
        add(p + "ffn_gate.weight", (ff, d), 1.0 / np.sqrt(d))
        add(p + "ffn_up.weight", (ff, d), 1.0 / np.sqrt(d))
        add(p + "ffn_down.weight", (d, ff), 1.0 / np.sqrt(ff))
        if arch == "qwen2":
            add(p + "attn_q.bias", (nh * hd,), 0.1)
            add(p + "attn_k.bias", (nkv * hd,), 0.1)
            add(p + "attn_v.bias", (nkv * hd,), 0.1)
        if arch == "gemma3":
            add(p + "attn_q_norm.weight", (hd,), 0.1, offset=1.0)
            add(p + "attn_k_norm.weight", (hd,), 0.1, offset=1.0)
            add(p + "post_attention_norm.weight", (d,), 0.1, offset=1.0)
            add(p + "post_ffw_norm.weight", (d,), 0.1, offset=1.0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


def write_other_vocab(path: Path, **kwargs) -> Path:
    """The tiny model (seed 0, `kwargs` as write_tiny_gguf's) over another vocabulary, REVERSED with RENAMED renamed:
    as a draft model, its drafts through the shared tokens are right until a renamed token ends them."""
    return write_tiny_gguf(path, seed=0, token_order=REVERSED, vocab_changes={"rename_tokens": RENAMED}, **kwargs)
