"""What reading and writing the files of draft heads (EAGLE-3: eagle3_file.py, DFlash: dflash_file.py) share: a
tensor loaded into its place in a head (quantized for the CPU kernels where the target's weights are kept
quantized), the checks of the shapes the keys imply, the draft vocabulary (d2t), and the tensors written as llama.cpp's
converters write them.
"""

from __future__ import annotations

from collections.abc import Callable

import gguf
import gguf.quants
import numpy as np
import torch
from torch import nn

from spec_cli.errors import SpecCliError
from spec_cli.model.config import ModelConfig
from spec_cli.model.gguf_file import GGUFFile
from spec_cli.model.qlinear import QLinear, supports
from spec_cli.model.quants import load_tensor
from spec_cli.model.transformer import Embedding, Linear, RMSNorm

D2T_NAMES = ("d2t", "d2t.weight")


def metadata_key(gf: GGUFFile, what: str) -> Callable:
    """key(name, default=None) -> the file's `{arch}.{name}`, a clear error where one without a default is missing
    (`what`: the kind of draft the file should be, "an EAGLE-3 draft")."""
    arch = gf.architecture

    def key(name: str, default=None):
        value = gf.get(f"{arch}.{name}", default)
        if value is None:
            raise SpecCliError(f"{gf.path.name}: metadata key {arch}.{name} is missing (not {what} in llama.cpp's "
                               "layout)")
        return value

    return key


def read_config(gf: GGUFFile, key: Callable, n_layer: int, n_vocab: int, rope_type: str,
                qk_norm: bool = False) -> ModelConfig:
    """The ModelConfig of a head file's usual keys (embedding_length, feed_forward_length, attention.*, rope.*); its
    n_vocab is the target's (its rows take target token ids)."""
    H, n_head = int(key("embedding_length")), int(key("attention.head_count"))
    head_dim = int(key("attention.key_length", H // n_head))
    linear = gf.get(f"{gf.architecture}.rope.scaling.type", "none") == "linear"
    return ModelConfig(
        arch=gf.architecture, n_layer=n_layer, n_embd=H, n_ff=int(key("feed_forward_length")), n_head=n_head,
        n_head_kv=int(key("attention.head_count_kv", n_head)), head_dim=head_dim, n_vocab=n_vocab,
        n_ctx_train=int(key("context_length", 4096)), rms_eps=float(key("attention.layer_norm_rms_epsilon")),
        rope_type=rope_type, rope_dim=int(key("rope.dimension_count", head_dim)),
        rope_base=float(key("rope.freq_base", 10000.0)), rope_base_swa=float(key("rope.freq_base", 10000.0)),
        rope_scale=float(key("rope.scaling.factor", 1.0)) if linear else 1.0, attn_scale=head_dim ** -0.5,
        sliding_window=0, swa_layers=[False] * n_layer, qk_norm=qk_norm)


def read_d2t(gf: GGUFFile, n_vocab: int, offsets_first: bool = False) -> list[int] | None:
    """The target id of each draft-vocabulary row, None without a d2t tensor. llama.cpp's converters store absolute
    ids; early EAGLE-3 PR branches stored offsets (target = i + d2t[i]): a table only one reading makes valid
    (distinct ids in the vocabulary) is read that way, `offsets_first` decides where both do."""
    name = next((n for n in D2T_NAMES if n in gf.tensors), None)
    if name is None:
        return None
    info = gf.tensors[name]
    dtype = {27: torch.int64, 26: torch.int32}.get(int(info.qtype))  # GGML I64, I32
    if dtype is None or len(info.shape) != 1:
        raise SpecCliError(f"{gf.path.name}: {name} must be a vector of int64 ids (got {info.qtype.name} "
                           f"{list(info.shape)})")
    values = gf.tensor_bytes(name).view(dtype).long()
    readings = {"absolute": values, "offsets": values + torch.arange(len(values))}
    valid = [k for k, ids in readings.items()
             if len(ids) and int(ids.min()) >= 0 and int(ids.max()) < n_vocab and len(ids.unique()) == len(ids)]
    if not valid:
        raise SpecCliError(f"{gf.path.name}: {name} maps draft rows to ids outside the target's {n_vocab}-token "
                           "vocabulary (or to the same id twice)")
    chosen = "offsets" if offsets_first and "offsets" in valid else valid[0]
    return readings[chosen].tolist()


def load_into(head: nn.Module, gf: GGUFFile, name: str, path: str, quantize: bool) -> None:
    """Tensor `name` into the head at attribute path `path` (a module's `weight`, or a plain tensor attribute):
    norms float32, linear weights in the head's dtype, or as QLinear blocks (`quantize`: the file's quantized
    blocks, float matrices quantized to Q8_0)."""
    info = gf.tensors[name]
    module_path, _, attr_name = path.rpartition(".")
    if attr_name != "weight":  # a plain tensor (EAGLE-3's rope_freqs)
        setattr(head.get_submodule(module_path) if module_path else head, attr_name, load_tensor(gf, name))
        return
    parent, _, attr = module_path.rpartition(".")
    owner = head.get_submodule(parent)
    module = getattr(owner, attr)
    if isinstance(module, Embedding):
        module.weight = load_tensor(gf, name, head.device).to(head.dtype)
        return
    if isinstance(module, Linear) and quantize and supports(info.qtype, info.shape):
        float_type = info.qtype.name in ("F32", "F16", "BF16")
        linear = (QLinear.from_float(load_tensor(gf, name)) if float_type
                  else QLinear.from_gguf(gf.tensor_bytes(name), info.qtype, info.shape))
        setattr(owner, attr, linear)
        return
    t = load_tensor(gf, name, head.device)
    module.weight = nn.Parameter(t if isinstance(module, RMSNorm) else t.to(head.dtype), requires_grad=False)


def check_loaded(head: nn.Module, name: str, matrices: dict[str, tuple[int, int]], norms: dict[str, int]) -> None:
    """Every tensor the layout requires is there (no parameter left on the meta device), each matrix (module path ->
    [out, in]) and norm (module path -> size) with the shape the file's keys imply."""
    missing = [n for n, p in head.named_parameters() if p.is_meta]
    if missing:
        raise SpecCliError(f"{name}: missing tensors for {', '.join(missing)}")
    for path, shape in matrices.items():
        module = head.get_submodule(path)
        got = (module.n_out, module.n_in) if isinstance(module, QLinear) else tuple(module.weight.shape)
        if got != shape:
            raise SpecCliError(f"{name}: {path} has shape {list(got)}, {list(shape)} expected from the file's keys")
    for path, n in norms.items():
        weight = head.get_submodule(path).weight
        if tuple(weight.shape) != (n,):
            raise SpecCliError(f"{name}: norm {path} has {weight.shape[0]} weights, {n} expected")


def check_vocabularies(head: nn.Module, name: str, d2t: list[int] | None) -> None:
    """An own embedding covers the target's vocabulary; an own output has one row per d2t entry (or per token), and
    the target's output matrix admits no d2t."""
    cfg = head.cfg
    if head.embed is not None and tuple(head.embed.weight.shape) != (cfg.n_vocab, cfg.n_embd):
        raise SpecCliError(f"{name}: token_embd must be [{cfg.n_vocab}, {cfg.n_embd}] (the target's vocabulary)")
    if head.output is None and d2t is not None and len(d2t) != cfg.n_vocab:
        raise SpecCliError(f"{name}: d2t has {len(d2t)} rows but the head uses the target's output matrix")


def check_layers(name: str, layers: tuple[int, ...], n_layer: int) -> None:
    """The target layers a head reads (their inputs; n_layer = the final pre-norm state) exist in the target."""
    if any(not 0 <= layer <= n_layer for layer in layers):
        raise SpecCliError(f"{name}: reads target layers {list(layers)}; this target has {n_layer} layers")


def check_shared(name: str, gf: GGUFFile, n_embd: int, target_embd: int) -> None:
    """A head that uses the target's embedding or output matrix must have the target's hidden size."""
    shared = [t for t, own in (("embedding", "token_embd.weight"), ("output matrix", "output.weight"))
              if own not in gf.tensors]
    if shared and n_embd != target_embd:
        raise SpecCliError(f"{name}: uses the target's {' and '.join(shared)} but its hidden size {n_embd} is not "
                           f"the target's {target_embd}")


def out_type(name: str) -> gguf.GGMLQuantizationType:
    """A --outtype name (options.HEAD_OUT_TYPES) as gguf's type."""
    return gguf.GGMLQuantizationType[name.upper()]


def add_weight(writer: gguf.GGUFWriter, name: str, weight: torch.Tensor,
               qtype: gguf.GGMLQuantizationType) -> None:
    """One tensor as a converter writes it: vectors float32, matrices as `qtype` blocks (F16 where a row is not
    whole blocks, float32 when asked)."""
    arr = weight.detach().float().cpu().numpy()
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if arr.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32:
        writer.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float32))
    elif qtype == gguf.GGMLQuantizationType.F16 or arr.shape[1] % block:
        writer.add_tensor(name, arr.astype(np.float16))
    else:
        writer.add_tensor(name, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)


def add_d2t(writer: gguf.GGUFWriter, draft_vocab: torch.Tensor | None) -> None:
    """d2t as int64 absolute target ids, where the head has a draft vocabulary."""
    if draft_vocab is not None:
        writer.add_tensor(D2T_NAMES[0], draft_vocab.cpu().numpy().astype(np.int64),
                          raw_dtype=gguf.GGMLQuantizationType.I64)


def finish(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
