"""Tiny DFlash drafters in llama.cpp's dflash layout, written here with gguf.GGUFWriter from weights in the Hugging Face
layout (z-lab's DFlashDraftModel: fc, hidden_norm, Qwen3 layers, norm; independent of spec-cli's exporter), plus a
plain-torch reference of a block's logits on those weights: the context's keys and values from the fused target
features, the block [id_last, MASK...] attending to them and to itself without a mask (rotate-half rope on the
unpermuted q/k).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType, GGUFWriter

from spec_cli.model.head_file import finish
from tests.tiny_eagle3 import EPS, ROPE_BASE, _rms, _rope_half
from tests.tiny_gguf import add_metadata, target_matrices
from tests.tiny_vocab import tiny_bpe_metadata

H, N_HEAD, N_KV, HEAD_DIM, N_FF = 64, 4, 2, 16, 96
RANK = 32  # a tiny DSpark drafter's Markov rank
MASK = 300  # a token of the tiny vocabulary the prompts never use


@dataclass
class TinyDFlash:
    path: Path
    layers: tuple[int, ...]  # target layer inputs read (the file's dflash.target_layers)
    block_size: int
    hf: dict[str, np.ndarray]  # HF-layout weights; per layer "layers.{i}.<name>"
    n_layer: int
    d2t: list[int] | None
    target_embd: np.ndarray
    target_out: np.ndarray


def hf_weights(rng: np.random.Generator, V: int, n_layer: int, n_features: int, target_hidden: int,
               n_draft: int | None) -> tuple[dict[str, np.ndarray], list[int] | None]:
    """Random HF-layout weights of a drafter and its d2t (a random sorted subset of the vocabulary)."""
    w = lambda *shape: (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)  # noqa: E731
    norm = lambda n: (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)  # noqa: E731
    hf = {"fc": w(H, n_features * target_hidden), "hidden_norm": norm(H), "norm": norm(H)}
    for i in range(n_layer):
        hf.update({f"layers.{i}.{k}": v for k, v in {
            "input_layernorm": norm(H), "q_proj": w(N_HEAD * HEAD_DIM, H), "k_proj": w(N_KV * HEAD_DIM, H),
            "v_proj": w(N_KV * HEAD_DIM, H), "o_proj": w(H, N_HEAD * HEAD_DIM), "q_norm": norm(HEAD_DIM),
            "k_norm": norm(HEAD_DIM), "post_attention_layernorm": norm(H), "gate_proj": w(N_FF, H),
            "up_proj": w(N_FF, H), "down_proj": w(H, N_FF)}.items()})
    d2t = None
    if n_draft is not None:
        d2t = sorted(rng.choice(V, n_draft, replace=False).tolist())
        hf["lm_head"] = 4.0 * w(n_draft, H)
    return hf, d2t


LAYER_NAMES = {"attn_norm": "input_layernorm", "attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj",
               "attn_output": "o_proj", "attn_q_norm": "q_norm", "attn_k_norm": "k_norm",
               "ffn_norm": "post_attention_layernorm", "ffn_gate": "gate_proj", "ffn_up": "up_proj",
               "ffn_down": "down_proj"}


def write_tiny_dflash(path: Path, target_path: Path, layers=(1, 2, 4), block_size: int = 8, n_layer: int = 2,
                      seed: int = 0, n_draft: int | None = None, pr_branch: bool = False, target_hidden: int = H,
                      qtype=GGMLQuantizationType.F32, extra_keys: dict | None = None,
                      extra_tensors: dict[str, np.ndarray] | None = None, arch: str = "dflash") -> TinyDFlash:
    """A random drafter for the tiny target at `target_path`. `n_draft`: an own output over that many draft tokens
    (d2t), None = the target's output matrix. `pr_branch`: the early PR branches' names (dflash.target_layer_ids as
    Hugging Face ids, dflash.mask_token_id, hidden_norm.weight)."""

    vocab = tiny_bpe_metadata()
    hf, d2t = hf_weights(np.random.default_rng(seed), len(vocab["tokenizer.ggml.tokens"]), n_layer, len(layers),
                         target_hidden, n_draft)
    writer = GGUFWriter(str(path), arch)
    for key, value in (("block_count", n_layer), ("context_length", 512), ("embedding_length", H),
                       ("feed_forward_length", N_FF), ("attention.head_count", N_HEAD),
                       ("attention.head_count_kv", N_KV), ("attention.key_length", HEAD_DIM),
                       ("attention.value_length", HEAD_DIM), ("block_size", block_size)):
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", EPS)
    writer.add_float32(f"{arch}.rope.freq_base", ROPE_BASE)
    if pr_branch:
        writer.add_array(f"{arch}.target_layer_ids", [v - 1 for v in layers])
        writer.add_uint32(f"{arch}.mask_token_id", MASK)
    else:
        writer.add_array(f"{arch}.target_layers", list(layers))
        vocab = {**vocab, "tokenizer.ggml.mask_token_id": MASK}
    add_metadata(writer, {**vocab, **(extra_keys or {})})
    _add_tensors(writer, hf, n_layer, d2t, pr_branch, qtype, extra_tensors or {})
    finish(writer)
    embd, out = target_matrices(target_path)
    return TinyDFlash(Path(path), tuple(layers), block_size, hf, n_layer, d2t, embd, out)


def write_tiny_dspark(path, target, anchor_first: bool | None = True, confidence: bool = True, seed: int = 5,
                      n_draft: int | None = 150, scale: float = 0.5):
    """A random DSpark drafter (anchor_first None: no dflash.sample_from_anchor key) and its Markov weights
    (w1 [V, R], w2 [rows, R], conf [1, H + R] and its bias, the w2 scale)."""
    rng = np.random.default_rng(seed + 100)
    V, rows = 307, n_draft or 307
    markov = {"markov_w1.weight": rng.standard_normal((V, RANK)).astype(np.float32),
              "markov_w2.weight": (3.0 * rng.standard_normal((rows, RANK)) / np.sqrt(RANK)).astype(np.float32),
              "markov_w2.scale": np.array([scale], dtype=np.float32)}
    if confidence:
        markov["conf_proj.weight"] = (rng.standard_normal((1, H + RANK)) / np.sqrt(H + RANK)).astype(np.float32)
        markov["conf_proj.bias"] = np.array([0.3], dtype=np.float32)
    keys = {} if anchor_first is None else {"dflash.sample_from_anchor": anchor_first}
    tiny = write_tiny_dflash(path, target, seed=seed, n_draft=n_draft, extra_keys=keys, extra_tensors=markov)
    return tiny, {k: torch.tensor(v) for k, v in markov.items()}


def _add_tensors(writer: GGUFWriter, hf: dict[str, np.ndarray], n_layer: int, d2t: list[int] | None,
                 pr_branch: bool, qtype, extra: dict[str, np.ndarray]) -> None:
    def add(name: str, arr: np.ndarray) -> None:
        if qtype != GGMLQuantizationType.F32 and arr.ndim == 2:
            from gguf import quants

            writer.add_tensor(name, quants.quantize(arr, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float32))

    add("fc.weight", hf["fc"])
    add("hidden_norm.weight" if pr_branch else "enc.output_norm.weight", hf["hidden_norm"])
    for i in range(n_layer):
        for name, key in LAYER_NAMES.items():
            add(f"blk.{i}.{name}.weight", hf[f"layers.{i}.{key}"])
    add("output_norm.weight", hf["norm"])
    if d2t is not None:
        add("output.weight", hf["lm_head"])
        writer.add_tensor("d2t", np.array(d2t, dtype=np.int64), raw_dtype=GGMLQuantizationType.I64)
    for name, arr in extra.items():
        writer.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float32))


def reference_fuse(tiny: TinyDFlash, features: torch.Tensor) -> torch.Tensor:
    """features [P, K, H_t] -> g [P, H] = hidden_norm(fc(concat)) from the HF weights."""
    return _rms(features.reshape(features.shape[0], -1) @ torch.tensor(tiny.hf["fc"]).T, tiny.hf["hidden_norm"])


def _heads(x: torch.Tensor, n: int, norm: np.ndarray, positions: torch.Tensor) -> torch.Tensor:
    """[T, n * d] -> per-head RMS-normed, rope-rotated [n, T, d]."""
    return _rope_half(_rms(x.view(x.shape[0], n, HEAD_DIM), norm), positions).transpose(0, 1)


def reference_block_logits(tiny: TinyDFlash, g: torch.Tensor, block: list[int], causal: bool = False) -> torch.Tensor:
    """The logits [len(block), V] (-inf outside the draft vocabulary) of a block at positions P.. after a context of
    P = len(g) fused features, cache-free, from the HF weights."""
    return reference_block(tiny, g, block, causal)[1]


def reference_block(tiny: TinyDFlash, g: torch.Tensor, block: list[int],
                    causal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """reference_block_logits, with the rows' states after the final norm [len(block), H] first."""
    hf, P, n = tiny.hf, g.shape[0], len(block)
    t = lambda k: torch.tensor(hf[k])  # noqa: E731
    ctx_pos, blk_pos = torch.arange(P), torch.arange(P, P + n)
    x = torch.tensor(tiny.target_embd)[block]
    mask = torch.ones(n, P + n, dtype=torch.bool)
    if causal:
        mask[:, P:] = torch.ones(n, n, dtype=torch.bool).tril()
    for i in range(tiny.n_layer):
        L = lambda k: f"layers.{i}.{k}"  # noqa: E731
        h = _rms(x, hf[L("input_layernorm")])
        q = _heads(h @ t(L("q_proj")).T, N_HEAD, hf[L("q_norm")], blk_pos)
        k = torch.cat((_heads(g @ t(L("k_proj")).T, N_KV, hf[L("k_norm")], ctx_pos),
                       _heads(h @ t(L("k_proj")).T, N_KV, hf[L("k_norm")], blk_pos)), 1)
        v = torch.cat((g @ t(L("v_proj")).T, h @ t(L("v_proj")).T)).view(P + n, N_KV, HEAD_DIM).transpose(0, 1)
        k, v = k.repeat_interleave(N_HEAD // N_KV, 0), v.repeat_interleave(N_HEAD // N_KV, 0)
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(0, 1).reshape(n, -1)
        x = x + att @ t(L("o_proj")).T
        y = _rms(x, hf[L("post_attention_layernorm")])
        x = x + (F.silu(y @ t(L("gate_proj")).T) * (y @ t(L("up_proj")).T)) @ t(L("down_proj")).T
    normed = _rms(x, hf["norm"])
    if tiny.d2t is None:
        return normed, normed @ torch.tensor(tiny.target_out).T
    logits = torch.full((n, tiny.target_out.shape[0]), float("-inf"))
    logits[:, tiny.d2t] = normed @ t("lm_head").T
    return normed, logits
