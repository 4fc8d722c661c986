"""DFlash files in llama.cpp's `dflash` GGUF layout (src/models/dflash.cpp, its converter): reading one for a target,
checked (keys, shapes, the target it was made for, the PR branches' names), and writing a trained drafter as the
converter writes it. The drafter itself: dflash_head.py, whose docstring lists the keys and tensors.

Early PR branches named the layers `dflash.target_layer_ids` (Hugging Face's ids: the outputs of those layers, read
here as the inputs of the next), the mask `dflash.mask_token_id` and the norm after fc `hidden_norm.weight`: read
as aliases. A DSpark file is a dflash file with a Markov head (markov_w1.weight, ...): dspark.py reads that part.
"""

from __future__ import annotations

import re
from pathlib import Path

import gguf
import torch

from spec_cli.errors import SpecCliError
from spec_cli.model.config import ModelConfig
from spec_cli.model.dflash_head import DFlashHead, DFlashLayout
from spec_cli.model.dspark_head import MarkovHead
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
from spec_cli.model.quants import load_tensor
from spec_cli.model.transformer import Linear

ARCH = "dflash"
LAYER_KEYS = (f"{ARCH}.target_layers", f"{ARCH}.target_layer_ids")  # llama.cpp's (layer inputs), the PR branches' (HF)
MASK_KEYS = ("tokenizer.ggml.mask_token_id", f"{ARCH}.mask_token_id")
FC_NORMS = ("enc.output_norm.weight", "hidden_norm.weight")
DEFAULT_BLOCK_SIZE = 16  # llama.cpp's, where the file has no dflash.block_size
TENSORS = {"fc.weight": "fc.weight", "output_norm.weight": "out_norm.weight", "output.weight": "output.weight",
           "token_embd.weight": "embed.weight"}
LAYER_TENSORS = {  # blk.{i}.<name> -> layers.{i}.<path>
    "attn_norm.weight": "attn_norm.weight", "attn_q.weight": "attn.wq.weight", "attn_k.weight": "attn.wk.weight",
    "attn_v.weight": "attn.wv.weight", "attn_output.weight": "attn.wo.weight",
    "attn_q_norm.weight": "attn.q_norm.weight", "attn_k_norm.weight": "attn.k_norm.weight",
    "ffn_norm.weight": "ffn_norm.weight", "ffn_gate.weight": "ffn.w_gate.weight", "ffn_up.weight": "ffn.w_up.weight",
    "ffn_down.weight": "ffn.w_down.weight",
}
# what a DSpark file adds (dspark.py reads them) and what no drafter here computes
DSPARK_TENSORS = ("markov_w1.weight", "markov_w2.weight", "markov_w2.scale", "conf_proj.weight", "conf_proj.bias")
UNSUPPORTED_KEYS = ("attention.sliding_window", "hyper_connection.count", "selector_rank", "rope.dimension_sections")


def is_dflash(gf: GGUFFile) -> bool:
    return gf.architecture == ARCH


def is_dspark(gf: GGUFFile) -> bool:
    """A dflash file with DSpark's Markov head (llama.cpp infers draft-dspark from it)."""
    return is_dflash(gf) and DSPARK_TENSORS[0] in gf.tensors


def read_layout(gf: GGUFFile, n_vocab: int) -> tuple[ModelConfig, DFlashLayout]:
    """The drafter's ModelConfig (n_embd H; n_vocab = the target's: its rows take target token ids) and the dflash
    keys, checked for presence and form."""
    name = gf.path.name
    key = metadata_key(gf, "a DFlash draft")
    for k in UNSUPPORTED_KEYS:
        if gf.get(f"{ARCH}.{k}") not in (None, 0):
            raise SpecCliError(f"{name}: {ARCH}.{k} is set: this DFlash variant (sliding-window, DeepSeek-V4 or "
                               "DFlash2 drafts) is not supported")
    layers = _target_layers(gf)
    mask = next((gf.get(k) for k in MASK_KEYS if gf.get(k) is not None), None)
    if mask is None or not 0 <= int(mask) < n_vocab:
        raise SpecCliError(f"{name}: {MASK_KEYS[0]} must name a token of the target's {n_vocab}-token vocabulary "
                           f"(got {mask!r})")
    fc = gf.tensors.get("fc.weight")
    if fc is None or fc.shape[1] % len(layers):
        raise SpecCliError(f"{name}: fc.weight must read {len(layers)} target layers' features")
    causal = gf.get(f"{ARCH}.attention.causal", False) in (True, "true") or gf.get(f"{ARCH}.decoder_arch") == "laguna"
    cfg = read_config(gf, key, int(key("block_count")), n_vocab, "neox", qk_norm=True)
    block = int(key("block_size", DEFAULT_BLOCK_SIZE))
    if block < 2:
        raise SpecCliError(f"{name}: {ARCH}.block_size must be at least 2 (got {block})")
    layout = DFlashLayout(layers, fc.shape[1] // len(layers), block, int(mask), bool(causal))
    return cfg, layout


def _target_layers(gf: GGUFFile) -> tuple[int, ...]:
    """dflash.target_layers as they are (layer inputs), or the PR branches' dflash.target_layer_ids + 1."""
    for k, shift in zip(LAYER_KEYS, (0, 1)):
        layers = gf.get(k)
        if layers is not None:
            if not isinstance(layers, list) or not layers:
                raise SpecCliError(f"{gf.path.name}: {k} must list the target layers read (got {layers!r})")
            return tuple(int(v) + shift for v in layers)
    raise SpecCliError(f"{gf.path.name}: metadata key {LAYER_KEYS[0]} is missing (not a DFlash draft in llama.cpp's "
                       "layout)")


def load_dflash_head(path: str | Path | GGUFFile, target: LoadedModel,
                     device: torch.device | None = None) -> DFlashHead:
    """The drafter of a dflash file for `target` (on `device`, default the target's last-layer device), checked
    against it. Float matrices are quantized to Q8_0 for the kernels where the target's weights are kept quantized
    on the CPU, quantized ones are kept as they are."""
    gf = path if isinstance(path, GGUFFile) else GGUFFile(path)
    if not is_dflash(gf):
        raise SpecCliError(f"{gf.path.name} is not a DFlash draft (general.architecture is '{gf.architecture}')")
    tcfg = target.config
    cfg, layout = read_layout(gf, tcfg.n_vocab)
    check_target(gf.path.name, cfg, layout, tcfg, gf)
    names = _tensor_names(gf, cfg.n_layer)
    own = {part for part, tensor in (("output", "output.weight"), ("embed", "token_embd.weight")) if tensor in names}
    d2t = read_d2t(gf, tcfg.n_vocab)
    n_draft = gf.tensors["output.weight"].shape[0] if "output.weight" in names else None
    with torch.device("meta"):
        head = DFlashHead(cfg, layout, target.model, own, n_draft)
    if device is not None:
        head.device = device
    quantize = target.weights == "q" and head.device.type == "cpu"
    for gguf_name, path_in_head in names.items():
        load_into(head, gf, gguf_name, path_in_head, quantize)
    if "fc.scale" in gf.tensors:
        head.fc_scale = float(load_tensor(gf, "fc.scale").reshape(-1)[0])
    _check_shapes(head, gf.path.name, d2t)
    if is_dspark(gf):
        head.markov = _load_markov(gf, head, len(d2t) if d2t is not None else cfg.n_vocab, quantize)
    if quantize:
        for layer in head.layers:
            fuse_attention_ffn(layer.attn, layer.ffn)
    head.draft_vocab = None if d2t is None else torch.tensor(d2t, dtype=torch.long, device=head.device)
    return head.eval()


def _load_markov(gf: GGUFFile, head: DFlashHead, n_rows: int, quantize: bool) -> MarkovHead:
    """DSpark's Markov head (and confidence head, where the file has one), checked against the drafter's shapes."""
    name, cfg = gf.path.name, head.cfg
    if gf.get(f"{ARCH}.block_size") is None:
        raise SpecCliError(f"{name}: a DSpark draft needs {ARCH}.block_size")
    rank = gf.tensors[DSPARK_TENSORS[0]].shape[1]
    anchor_first = gf.get(f"{ARCH}.sample_from_anchor", True) in (True, "true")
    markov = MarkovHead(cfg.n_vocab, n_rows, rank, cfg.n_embd, anchor_first)
    markov.device = head.device
    markov.w1.weight = load_tensor(gf, DSPARK_TENSORS[0], head.device).to(head.dtype)
    load_into(markov, gf, DSPARK_TENSORS[1], "w2.weight", quantize)
    if DSPARK_TENSORS[2] in gf.tensors:
        markov.scale = float(load_tensor(gf, DSPARK_TENSORS[2]).reshape(-1)[0])
    declared = gf.get(f"{ARCH}.has_confidence_head")
    if DSPARK_TENSORS[3] in gf.tensors and declared not in (False, "false"):
        markov.conf = Linear(cfg.n_embd + rank, 1, bias=True)
        markov.conf.weight = torch.nn.Parameter(load_tensor(gf, DSPARK_TENSORS[3], head.device), requires_grad=False)
        if DSPARK_TENSORS[4] in gf.tensors:
            markov.conf.bias = torch.nn.Parameter(load_tensor(gf, DSPARK_TENSORS[4], head.device).reshape(1),
                                                  requires_grad=False)
    check_loaded(markov, name, {"w2": (n_rows, rank), **({"conf": (1, cfg.n_embd + rank)} if markov.conf else {})},
                 {})
    if tuple(markov.w1.weight.shape) != (cfg.n_vocab, rank):
        raise SpecCliError(f"{name}: markov_w1 must be [{cfg.n_vocab}, {rank}] (the target's vocabulary)")
    return markov


def check_target(name: str, cfg: ModelConfig, layout: DFlashLayout, tcfg: ModelConfig, gf: GGUFFile) -> None:
    """A drafter made for another target is a clear error: its feature width, layers and sizes must fit."""
    if layout.target_hidden != tcfg.n_embd:
        raise SpecCliError(f"{name}: fc reads {len(layout.target_layers)} features of width {layout.target_hidden}; "
                           f"this target's hidden size is {tcfg.n_embd}")
    check_layers(name, layout.target_layers, tcfg.n_layer_main)
    check_shared(name, gf, cfg.n_embd, tcfg.n_embd)


def _tensor_names(gf: GGUFFile, n_layer: int) -> dict[str, str]:
    """GGUF name -> attribute path of every tensor the drafter loads; unknown tensors are an error (DSpark's are
    dspark.py's)."""
    names = {}
    for n in gf.tensors:
        if n in D2T_NAMES or n in DSPARK_TENSORS or n == "fc.scale":
            continue
        path = "fc_norm.weight" if n in FC_NORMS else TENSORS.get(n)
        block = re.fullmatch(r"blk\.(\d+)\.(.+)", n)
        if block and int(block[1]) < n_layer and block[2] in LAYER_TENSORS:
            path = f"layers.{block[1]}.{LAYER_TENSORS[block[2]]}"
        if path is None:
            raise SpecCliError(f"{gf.path.name}: unexpected tensor {n} in a DFlash draft")
        names[n] = path
    return names


def _check_shapes(head: DFlashHead, name: str, d2t: list[int] | None) -> None:
    """Every tensor the layout requires is there, with the shape the keys imply."""
    cfg, H = head.cfg, head.cfg.n_embd
    n_q, n_kv = cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim
    matrices = {"fc": (H, len(head.layout.target_layers) * head.layout.target_hidden)}
    norms = {"fc_norm": H, "out_norm": H}
    for i in range(cfg.n_layer):
        matrices.update({f"layers.{i}.attn.wq": (n_q, H), f"layers.{i}.attn.wk": (n_kv, H),
                         f"layers.{i}.attn.wv": (n_kv, H), f"layers.{i}.attn.wo": (H, n_q),
                         f"layers.{i}.ffn.w_gate": (cfg.n_ff, H), f"layers.{i}.ffn.w_up": (cfg.n_ff, H),
                         f"layers.{i}.ffn.w_down": (H, cfg.n_ff)})
        norms.update({f"layers.{i}.attn_norm": H, f"layers.{i}.ffn_norm": H, f"layers.{i}.attn.q_norm": cfg.head_dim,
                      f"layers.{i}.attn.k_norm": cfg.head_dim})
    if head.output is not None:
        matrices["output"] = (len(d2t) if d2t is not None else cfg.n_vocab, H)
    check_loaded(head, name, matrices, norms)
    check_vocabularies(head, name, d2t)


def write_dflash_gguf(head: DFlashHead, target_path: str | Path, dst: str | Path,
                      qtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.Q8_0) -> Path:
    """The drafter as llama.cpp's converter writes a dflash file: its keys, the target's tokenizer with the mask
    token, the tensors under their llama.cpp names, matrices as `qtype` blocks (F16 where a row is not whole blocks),
    norms float32, d2t int64 target ids; never the target's embedding."""
    cfg, layout = head.cfg, head.layout
    writer = gguf.GGUFWriter(str(dst), ARCH)
    copy_fields(gguf.GGUFReader(str(target_path)), writer,
                lambda key: key.startswith("tokenizer.") and key != MASK_KEYS[0])
    writer.add_uint32(MASK_KEYS[0], layout.mask_token)
    for key, value in (("block_count", cfg.n_layer), ("context_length", cfg.n_ctx_train),
                       ("embedding_length", cfg.n_embd), ("feed_forward_length", cfg.n_ff),
                       ("attention.head_count", cfg.n_head), ("attention.head_count_kv", cfg.n_head_kv),
                       ("attention.key_length", cfg.head_dim), ("attention.value_length", cfg.head_dim),
                       ("rope.dimension_count", cfg.rope_dim), ("block_size", layout.block_size)):
        writer.add_uint32(f"{ARCH}.{key}", value)
    writer.add_float32(f"{ARCH}.attention.layer_norm_rms_epsilon", cfg.rms_eps)
    writer.add_float32(f"{ARCH}.rope.freq_base", cfg.rope_base)
    writer.add_array(LAYER_KEYS[0], [int(v) for v in layout.target_layers])
    named = {**{name: path for name, path in TENSORS.items() if name != "token_embd.weight"},
             FC_NORMS[0]: "fc_norm.weight",
             **{f"blk.{i}.{name}": f"layers.{i}.{path}" for i in range(cfg.n_layer)
                for name, path in LAYER_TENSORS.items()}}
    for name, path in named.items():
        module = head.get_submodule(path.rpartition(".")[0]) if path != "output.weight" else head.output
        if module is not None:
            add_weight(writer, name, module.weight, qtype)
    add_d2t(writer, head.draft_vocab)
    finish(writer)
    return Path(dst)
