"""EAGLE-3 files in llama.cpp's `eagle3` GGUF layout (src/models/eagle3.cpp, its converter): reading one for a
target, checked (keys, shapes, the target it was made for, the PR branches' names and offset d2t), and writing a
trained head as the converter writes it. The head itself: eagle3_head.py, whose docstring lists the keys and
tensors.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import torch

from spec_cli.errors import SpecCliError
from spec_cli.model.config import ModelConfig
from spec_cli.model.eagle3_head import N_FEATURES, Eagle3Head, Eagle3Layout
from spec_cli.model.gguf_file import GGUFFile, copy_fields
from spec_cli.model.head_file import (
    D2T_NAMES,
    add_d2t,
    add_weight,
    check_layers,
    check_loaded,
    check_shared,
    check_vocabularies,
    finish,
    load_into,
    metadata_key,
    read_config,
    read_d2t,
)
from spec_cli.model.loader import LoadedModel
from spec_cli.model.qlinear import fuse_attention_ffn
from spec_cli.model.transformer import Embedding

ARCH = "eagle3"
LAYER_KEYS = (f"{ARCH}.target_layers", f"{ARCH}.extract_layers")  # llama.cpp's, then the PR branches'
HIDDEN_NORMS = ("blk.0.attn_norm_2.weight", "blk.0.hidden_norm.weight")
# GGUF tensor -> attribute path in Eagle3Head (the hidden norm and d2t are read under any of their names above)
TENSORS = {
    "fc.weight": "fc.weight",
    "enc.output_norm.weight": "fc_norm.weight",
    "blk.0.attn_norm.weight": "attn_norm.weight",
    "blk.0.attn_q.weight": "attn.wq.weight",
    "blk.0.attn_k.weight": "attn.wk.weight",
    "blk.0.attn_v.weight": "attn.wv.weight",
    "blk.0.attn_output.weight": "attn.wo.weight",
    "blk.0.ffn_norm.weight": "ffn_norm.weight",
    "blk.0.ffn_gate.weight": "ffn.w_gate.weight",
    "blk.0.ffn_up.weight": "ffn.w_up.weight",
    "blk.0.ffn_down.weight": "ffn.w_down.weight",
    "output_norm.weight": "out_norm.weight",
    "output.weight": "output.weight",
    "token_embd.weight": "embed.weight",
    "rope_freqs.weight": "rope_freqs",
}


def is_eagle3(gf: GGUFFile) -> bool:
    return gf.architecture == ARCH


def read_layout(gf: GGUFFile, n_vocab: int) -> tuple[ModelConfig, Eagle3Layout]:
    """The head's ModelConfig (n_embd H; n_vocab = the target's: its rows take target token ids) and the eagle3
    keys, checked for presence and form."""
    name = gf.path.name
    key = metadata_key(gf, "an EAGLE-3 draft")
    layers = next((gf.get(k) for k in LAYER_KEYS if gf.get(k) is not None), None)
    if not isinstance(layers, list) or len(layers) != N_FEATURES:
        raise SpecCliError(f"{name}: {LAYER_KEYS[0]} must list {N_FEATURES} target layers (got {layers!r})")
    if int(key("block_count", 1)) != 1:
        raise SpecCliError(f"{name}: an EAGLE-3 draft has one decoder block, this file {key('block_count')}")
    cfg = read_config(gf, key, 1, n_vocab, "norm")
    layout = Eagle3Layout(
        target_layers=tuple(int(v) for v in layers), target_hidden=int(key("target_hidden_size")),
        norm_before_residual=bool(gf.get(f"{ARCH}.norm_before_residual", False)),
        norm_before_fc=bool(gf.get(f"{ARCH}.norm_before_fc", False)) or "enc.output_norm.weight" in gf.tensors,
        pr_branch=gf.get(LAYER_KEYS[0]) is None or HIDDEN_NORMS[1] in gf.tensors)
    return cfg, layout


def load_eagle3_head(path: str | Path | GGUFFile, target: LoadedModel,
                     device: torch.device | None = None) -> Eagle3Head:
    """The head of an eagle3 file for `target` (on `device`, default the target's last-layer device), checked
    against it: hidden sizes, layers, vocabulary. Float matrices are quantized to Q8_0 for the kernels where the
    target's weights are kept quantized on the CPU (as the MTP head's are), quantized ones are kept as they are."""
    gf = path if isinstance(path, GGUFFile) else GGUFFile(path)
    if not is_eagle3(gf):
        raise SpecCliError(f"{gf.path.name} is not an EAGLE-3 draft (general.architecture is '{gf.architecture}')")
    tcfg = target.config
    cfg, layout = read_layout(gf, tcfg.n_vocab)
    check_target(gf.path.name, cfg, layout, tcfg, gf)
    names = _tensor_names(gf)
    own = {part for part, tensor in (("output", "output.weight"), ("embed", "token_embd.weight")) if tensor in names}
    d2t = read_d2t(gf, tcfg.n_vocab, offsets_first=layout.pr_branch)
    n_draft = gf.tensors["output.weight"].shape[0] if "output.weight" in names else None
    with torch.device("meta"):
        head = Eagle3Head(cfg, layout, target.model, own, n_draft)
    if device is not None:
        head.device = device
    quantize = target.weights == "q" and head.device.type == "cpu"
    for gguf_name, path_in_head in names.items():
        load_into(head, gf, gguf_name, path_in_head, quantize)
    _check_shapes(head, gf.path.name, d2t)
    if quantize:
        fuse_attention_ffn(head.attn, head.ffn)
    head.draft_vocab = None if d2t is None else torch.tensor(d2t, dtype=torch.long, device=head.device)
    return head.eval()


def check_target(name: str, cfg: ModelConfig, layout: Eagle3Layout, tcfg: ModelConfig, gf: GGUFFile) -> None:
    """A head made for another target is a clear error: its feature width, layers and sizes must fit."""
    if layout.target_hidden != tcfg.n_embd:
        raise SpecCliError(f"{name}: made for a target of hidden size {layout.target_hidden}; this target's is "
                           f"{tcfg.n_embd}")
    check_layers(name, layout.target_layers, tcfg.n_layer_main)
    check_shared(name, gf, cfg.n_embd, tcfg.n_embd)
    vocab = gf.get(f"{ARCH}.vocab_size")
    draft_rows = gf.tensors["output.weight"].shape[0] if "output.weight" in gf.tensors else None
    if vocab is not None and int(vocab) not in (tcfg.n_vocab, draft_rows):  # some converters write the draft's
        raise SpecCliError(f"{name}: made for a vocabulary of {vocab} tokens; this target has {tcfg.n_vocab}")


def _tensor_names(gf: GGUFFile) -> dict[str, str]:
    """GGUF name -> attribute path of every tensor but d2t; unknown tensors are an error."""
    names = {}
    for n in gf.tensors:
        if n in D2T_NAMES:
            continue
        path = "hidden_norm.weight" if n in HIDDEN_NORMS else TENSORS.get(n)
        if path is None:
            raise SpecCliError(f"{gf.path.name}: unexpected tensor {n} in an EAGLE-3 draft")
        names[n] = path
    return names


def _check_shapes(head: Eagle3Head, name: str, d2t: list[int] | None) -> None:
    """Every tensor the layout requires is there, with the shape the keys imply."""
    cfg, H, Ht = head.cfg, head.cfg.n_embd, head.layout.target_hidden
    n_q, n_kv = cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim
    matrices = {"fc": (H, N_FEATURES * Ht), "attn.wq": (n_q, 2 * H), "attn.wk": (n_kv, 2 * H),
                "attn.wv": (n_kv, 2 * H), "attn.wo": (H, n_q), "ffn.w_gate": (cfg.n_ff, H), "ffn.w_up": (cfg.n_ff, H),
                "ffn.w_down": (H, cfg.n_ff)}
    if head.output is not None:
        matrices["output"] = (len(d2t) if d2t is not None else cfg.n_vocab, H)
    norms = {"attn_norm": H, "hidden_norm": H, "ffn_norm": H, "out_norm": H}
    if head.fc_norm is not None:
        norms["fc_norm"] = N_FEATURES * Ht
    check_loaded(head, name, matrices, norms)
    check_vocabularies(head, name, d2t)


def write_eagle3_gguf(head: Eagle3Head, target_path: str | Path, dst: str | Path,
                      qtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.Q8_0) -> Path:
    """The head as llama.cpp's converter writes an eagle3 file: its keys, the target's tokenizer, the tensors under
    their llama.cpp names (q and k rows are already in llama's interleaved rope order: the head computes with it),
    matrices as `qtype` blocks (F16 where a row is not whole blocks), norms float32, d2t int64 target ids."""
    cfg, layout = head.cfg, head.layout
    writer = gguf.GGUFWriter(str(dst), ARCH)
    copy_fields(gguf.GGUFReader(str(target_path)), writer, lambda key: key.startswith("tokenizer."))
    for key, value in (("block_count", 1), ("context_length", cfg.n_ctx_train), ("embedding_length", cfg.n_embd),
                       ("feed_forward_length", cfg.n_ff), ("attention.head_count", cfg.n_head),
                       ("attention.head_count_kv", cfg.n_head_kv), ("attention.key_length", cfg.head_dim),
                       ("attention.value_length", cfg.head_dim), ("rope.dimension_count", cfg.rope_dim),
                       ("vocab_size", cfg.n_vocab), ("target_hidden_size", layout.target_hidden)):
        writer.add_uint32(f"{ARCH}.{key}", value)
    writer.add_float32(f"{ARCH}.attention.layer_norm_rms_epsilon", cfg.rms_eps)
    writer.add_float32(f"{ARCH}.rope.freq_base", cfg.rope_base)
    writer.add_array(LAYER_KEYS[0], [int(v) for v in layout.target_layers])
    for flag in ("norm_before_residual", "norm_before_fc"):
        if getattr(layout, flag):
            writer.add_bool(f"{ARCH}.{flag}", True)
    names = {**{path: name for name, path in TENSORS.items()}, "hidden_norm.weight": HIDDEN_NORMS[0]}
    for path, name in names.items():
        owner = head if "." in path else None
        for part in path.split(".")[:-1]:
            owner = getattr(owner, part, None)
        if owner is None or isinstance(owner, Embedding):
            continue  # rope_freqs, the parts the head has not, and the embedding (the target's)
        add_weight(writer, name, owner.weight, qtype)
    add_d2t(writer, head.draft_vocab)
    finish(writer)
    return Path(dst)
