"""Writes tiny random GGUF models (llama / qwen2 / gemma3 layouts) with gguf.GGUFWriter, for fast CPU tests.

The output projection is scaled up so the logits are well separated: greedy decoding then has no near ties,
and batched verification (k rows) picks the same argmax as one-row decoding.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, quants

from tests.tiny_vocab import tiny_bpe_metadata

DIMS = dict(n_embd=64, n_ff=128, n_head=4, n_head_kv=2, head_dim=16)


def _add_metadata(w: GGUFWriter, meta: dict) -> None:
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
) -> Path:
    """`perturb` > 0 adds that much relative noise (from another seed) to every weight: a draft model that
    agrees with the unperturbed target most of the time, not always."""
    rng = np.random.default_rng(seed)
    noise = np.random.default_rng(seed + 1000)
    vocab = tiny_bpe_metadata()
    for key, value in (vocab_changes or {}).items():
        if key == "rename_token":  # a different token text at this id: an incompatible vocabulary
            vocab["tokenizer.ggml.tokens"] = list(vocab["tokenizer.ggml.tokens"])
            vocab["tokenizer.ggml.tokens"][value] += "x"
        else:
            vocab[key] = value
    n_vocab = len(vocab["tokenizer.ggml.tokens"])
    d, ff, nh, nkv, hd = (DIMS[k] for k in ("n_embd", "n_ff", "n_head", "n_head_kv", "head_dim"))
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
    _add_metadata(w, meta)
    if with_tokenizer:
        _add_metadata(w, vocab)

    def add(name: str, shape: tuple[int, ...], scale: float, quantize: bool = True, offset: float = 0.0):
        arr = rng.standard_normal(shape) * scale + offset
        if perturb:
            arr = arr + noise.standard_normal(shape) * scale * perturb
        arr = arr.astype(np.float32)
        if quantize and qtype != GGMLQuantizationType.F32 and len(shape) == 2:
            w.add_tensor(name, quants.quantize(arr, qtype), raw_dtype=qtype)  # gguf infers the shape from the bytes
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
