"""Tiny EAGLE-3 heads in llama.cpp's eagle3 layout, written here with gguf.GGUFWriter from weights in the Hugging
Face layout (independent of spec-cli's exporter), plus a plain-torch reference of the head's forward on those HF
weights (NeoX-style rotate-half rope on the unpermuted q/k): what a converted SpecForge / EAGLE checkpoint computes.

The file permutes q and k rows for llama's interleaved-pair rope, as llama.cpp's converter does; the loader must
undo nothing and still compute what the reference computes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType, GGUFWriter

from spec_cli.model.head_file import finish
from tests.tiny_gguf import add_metadata, target_matrices
from tests.tiny_vocab import tiny_bpe_metadata

H, N_HEAD, N_KV, HEAD_DIM, N_FF = 64, 4, 2, 16, 96
EPS = 1e-6
ROPE_BASE = 10000.0


def to_interleaved(w: np.ndarray, n_head: int) -> np.ndarray:
    """q/k rows [n_head * d, n_in] in HF's half-split rope order (pairs i, i + d/2) -> llama's interleaved order
    (pairs 2i, 2i + 1): row 2i + j of a head takes the head's row j * d/2 + i."""
    d = w.shape[0] // n_head
    order = np.arange(d).reshape(2, d // 2).T.reshape(-1)  # [0, d/2, 1, d/2 + 1, ...]
    return w.reshape(n_head, d, -1)[:, order].reshape(w.shape)


@dataclass
class TinyEagle3:
    path: Path
    layers: tuple[int, ...]
    hf: dict[str, np.ndarray]  # HF-layout weights (q/k unpermuted; d2t as absolute ids, or None)
    d2t: list[int] | None
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    target_embd: np.ndarray | None = None  # the target's embedding / output matrix where the head has none
    target_out: np.ndarray | None = None


def hf_weights(rng: np.random.Generator, V: int, target_hidden: int, n_draft: int | None, own_embed: bool,
               norm_before_fc: bool) -> tuple[dict[str, np.ndarray], list[int] | None]:
    """Random Hugging Face-layout weights of a head and its d2t (a random sorted subset of the vocabulary)."""
    w = lambda *shape: (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)  # noqa: E731
    norm = lambda n: (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)  # noqa: E731
    hf = {"fc": w(H, 3 * target_hidden), "input_layernorm": norm(H), "hidden_norm": norm(H),
          "q_proj": w(N_HEAD * HEAD_DIM, 2 * H), "k_proj": w(N_KV * HEAD_DIM, 2 * H),
          "v_proj": w(N_KV * HEAD_DIM, 2 * H),
          "o_proj": w(H, N_HEAD * HEAD_DIM), "post_attention_layernorm": norm(H), "gate_proj": w(N_FF, H),
          "up_proj": w(N_FF, H), "down_proj": w(H, N_FF), "norm": norm(H)}
    if norm_before_fc:
        hf["fc_norm"] = norm(3 * target_hidden)
    d2t = None
    if n_draft is not None:
        d2t = sorted(rng.choice(V, n_draft, replace=False).tolist())
        hf["lm_head"] = 4.0 * w(n_draft, H)
    if own_embed:
        hf["embed_tokens"] = rng.standard_normal((V, H)).astype(np.float32)
    return hf, d2t


def write_tiny_eagle3(path: Path, target_path: Path, layers=(1, 2, 3), seed: int = 0, n_draft: int | None = 120,
                      own_embed: bool = False, norm_before_residual: bool = False, norm_before_fc: bool = False,
                      pr_branch: bool = False, target_hidden: int = H, qtype=GGMLQuantizationType.F32) -> TinyEagle3:
    """A random head for the tiny target at `target_path`. `n_draft`: an own output over that many draft tokens,
    None = the target's output matrix. `pr_branch`: the early PR branches' names (extract_layers,
    blk.0.hidden_norm, d2t as offsets)."""

    vocab = tiny_bpe_metadata()
    hf, d2t = hf_weights(np.random.default_rng(seed), len(vocab["tokenizer.ggml.tokens"]), target_hidden, n_draft,
                         own_embed, norm_before_fc)
    writer = GGUFWriter(str(path), "eagle3")
    for key, value in (("block_count", 1), ("context_length", 512), ("embedding_length", H),
                       ("feed_forward_length", N_FF), ("attention.head_count", N_HEAD),
                       ("attention.head_count_kv", N_KV), ("attention.key_length", HEAD_DIM),
                       ("attention.value_length", HEAD_DIM), ("vocab_size", len(vocab["tokenizer.ggml.tokens"])),
                       ("target_hidden_size", target_hidden)):
        writer.add_uint32(f"eagle3.{key}", value)
    writer.add_float32("eagle3.attention.layer_norm_rms_epsilon", EPS)
    writer.add_float32("eagle3.rope.freq_base", ROPE_BASE)
    writer.add_array("eagle3.extract_layers" if pr_branch else "eagle3.target_layers", list(layers))
    for flag, on in (("norm_before_residual", norm_before_residual), ("norm_before_fc", norm_before_fc)):
        if on:
            writer.add_bool(f"eagle3.{flag}", True)
    add_metadata(writer, vocab)
    _add_tensors(writer, hf, d2t, pr_branch, qtype)
    finish(writer)
    embd, out = target_matrices(target_path)
    return TinyEagle3(Path(path), tuple(layers), hf, d2t, norm_before_residual, norm_before_fc,
                      embd, out)


def _add_tensors(writer: GGUFWriter, hf: dict[str, np.ndarray], d2t: list[int] | None, pr_branch: bool,
                 qtype) -> None:
    """The head's tensors under llama.cpp's eagle3 names, q and k rows permuted for its interleaved rope."""
    def add(name: str, arr: np.ndarray) -> None:
        if qtype != GGMLQuantizationType.F32 and arr.ndim == 2:
            from gguf import quants

            writer.add_tensor(name, quants.quantize(arr, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float32))

    for name, key in (("fc.weight", "fc"), ("enc.output_norm.weight", "fc_norm"),
                      ("blk.0.attn_norm.weight", "input_layernorm"),
                      ("blk.0.hidden_norm.weight" if pr_branch else "blk.0.attn_norm_2.weight", "hidden_norm"),
                      ("blk.0.attn_v.weight", "v_proj"), ("blk.0.attn_output.weight", "o_proj"),
                      ("blk.0.ffn_norm.weight", "post_attention_layernorm"), ("blk.0.ffn_gate.weight", "gate_proj"),
                      ("blk.0.ffn_up.weight", "up_proj"), ("blk.0.ffn_down.weight", "down_proj"),
                      ("output_norm.weight", "norm"), ("output.weight", "lm_head"),
                      ("token_embd.weight", "embed_tokens")):
        if key in hf:
            add(name, hf[key])
    add("blk.0.attn_q.weight", to_interleaved(hf["q_proj"], N_HEAD))
    add("blk.0.attn_k.weight", to_interleaved(hf["k_proj"], N_KV))
    if d2t is not None:
        stored = np.array(d2t, dtype=np.int64) - (np.arange(len(d2t)) if pr_branch else 0)
        writer.add_tensor("d2t", stored, raw_dtype=GGMLQuantizationType.I64)


def _rms(x: torch.Tensor, w: np.ndarray) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * torch.tensor(w)


def _rope_half(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """HF's rotate-half rope: x [T, heads, d], pairs (i, i + d/2)."""
    d = x.shape[-1]
    inv = 1.0 / (ROPE_BASE ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ang = (positions.double()[:, None] * inv).float()
    cos, sin = torch.cat((ang.cos(), ang.cos()), -1)[:, None], torch.cat((ang.sin(), ang.sin()), -1)[:, None]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat((-x2, x1), -1) * sin


def reference_rows(head: TinyEagle3, tokens: list[int], g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows t = 0..T-1 holding (tokens[t], g[t]) at positions 0..T-1, cache-free, from the HF weights ->
    (pre-norm states [T, H], logits over the target vocabulary [T, V], -inf outside the draft vocabulary)."""
    hf = head.hf
    T_ = len(tokens)
    t = lambda k: torch.tensor(hf[k])  # noqa: E731
    embd = hf.get("embed_tokens", head.target_embd)
    e = _rms(torch.tensor(embd)[tokens], hf["input_layernorm"])
    gn = _rms(g, hf["hidden_norm"])
    a = torch.cat((e, gn), -1)
    pos = torch.arange(T_)
    q = _rope_half((a @ t("q_proj").T).view(T_, N_HEAD, HEAD_DIM), pos).transpose(0, 1)
    k = _rope_half((a @ t("k_proj").T).view(T_, N_KV, HEAD_DIM), pos).transpose(0, 1)
    v = (a @ t("v_proj").T).view(T_, N_KV, HEAD_DIM).transpose(0, 1)
    k, v = k.repeat_interleave(N_HEAD // N_KV, 0), v.repeat_interleave(N_HEAD // N_KV, 0)
    att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1).reshape(T_, -1)
    h1 = att @ t("o_proj").T + (gn if head.norm_before_residual else g)
    x = _rms(h1, hf["post_attention_layernorm"])
    h2 = h1 + (F.silu(x @ t("gate_proj").T) * (x @ t("up_proj").T)) @ t("down_proj").T
    normed = _rms(h2, hf["norm"])
    if head.d2t is None:
        return h2, normed @ torch.tensor(head.target_out).T
    logits = torch.full((T_, head.target_out.shape[0]), float("-inf"))
    logits[:, head.d2t] = normed @ t("lm_head").T
    return h2, logits


def reference_fuse(head: TinyEagle3, features: torch.Tensor) -> torch.Tensor:
    """features [T, 3, H_t] -> g [T, H] from the HF weights."""
    x = features.reshape(features.shape[0], -1)
    if head.norm_before_fc:
        x = _rms(x, head.hf["fc_norm"])
    return x @ torch.tensor(head.hf["fc"]).T


def rewritten(src: Path, dst: Path, drop: tuple[str, ...] = (), arrays: dict[str, np.ndarray] | None = None) -> Path:
    """A copy of a GGUF file without the tensors `drop` and with `arrays` in place of (or besides) its tensors."""
    from gguf import GGUFReader

    from spec_cli.model.gguf_file import copy_fields

    reader, arrays = GGUFReader(str(src)), arrays or {}
    writer = GGUFWriter(str(dst), reader.fields["general.architecture"].contents())
    copy_fields(reader, writer, lambda key: True)
    for t in reader.tensors:
        if t.name not in drop and t.name not in arrays:
            writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    for name, arr in arrays.items():
        writer.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float32))
    finish(writer)
    return Path(dst)
