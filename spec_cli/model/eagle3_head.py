"""An EAGLE-3 draft head in llama.cpp's `eagle3` GGUF layout (src/models/eagle3.cpp; shared/design/hidden-state-
drafters.md): one decoder layer that reads the inputs of three target layers and the token embedding.

Keys (`eagle3.*`): target_layers INT32[3] (the PR branches' `extract_layers` accepted), target_hidden_size H_t,
norm_before_residual and norm_before_fc (optional bools), and the usual embedding_length H, feed_forward_length F,
attention.head_count / head_count_kv / key_length, layer_norm_rms_epsilon, rope.freq_base / dimension_count,
block_count 1. Tensors (torch order [out, in]): fc [H, 3 H_t]; enc.output_norm [3 H_t] (norm_before_fc);
blk.0.attn_norm [H] (on the token embedding); blk.0.attn_norm_2 [H] (on the fused feature; the PR branches'
blk.0.hidden_norm accepted); blk.0.attn_q [n_h d, 2H], attn_k / attn_v [n_kv d, 2H], attn_output [H, n_h d], Q and K
rows permuted for llama's interleaved-pair rope; blk.0.ffn_norm, ffn_gate / ffn_up [F, H], ffn_down [H, F];
output_norm [H]; optional output [V_d, H] (absent: the target's output matrix), token_embd [V, H] (absent: the
target's embedding), d2t I64 [V_d] (the target id of each draft-vocabulary row; the PR branches' offsets, target =
i + d2t[i], recognized), rope_freqs [d / 2] (llama-3 rope scaling).

Forward for a row at head position t holding (token x_{t+1}, fused feature g_t):
    e = attn_norm(embed(x)), gn = attn_norm_2(g), a = concat(e, gn) [2H]; q, k, v = W a; rope (adjacent pairs);
    causal attention over the head's KV; h1 = attn + (gn if norm_before_residual else g);
    h2 = h1 + FFN(ffn_norm(h1))  (the pre-norm state, fed back as g of the next draft position);
    logits = output(output_norm(h2)) over the V_d draft-vocabulary rows (token d2t[i] for row i).
with g_t = fc(feat_t) (fc(RMSNorm(feat_t)) with norm_before_fc), feat_t = the three tapped layers' inputs at t.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gguf
import gguf.quants
import numpy as np
import torch
from torch import nn

from spec_cli.errors import SpecCliError
from spec_cli.model.config import ModelConfig
from spec_cli.model.gguf_file import GGUFFile, copy_fields
from spec_cli.model.loader import LoadedModel
from spec_cli.model.qlinear import QLinear, fuse_attention_ffn, supports
from spec_cli.model.quants import load_tensor
from spec_cli.model import kernels
from spec_cli.model.transformer import (
    Attention,
    Embedding,
    FeedForward,
    ForwardPlan,
    Linear,
    RMSNorm,
    rope_table,
    rope_tables,
)

ARCH = "eagle3"
N_FEATURES = 3  # tapped target layers
LAYER_KEYS = (f"{ARCH}.target_layers", f"{ARCH}.extract_layers")  # llama.cpp's, then the PR branches'
HIDDEN_NORMS = ("blk.0.attn_norm_2.weight", "blk.0.hidden_norm.weight")
D2T_NAMES = ("d2t", "d2t.weight")
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


@dataclass(frozen=True)
class Eagle3Layout:
    """What an eagle3 file's metadata says, beyond the head's ModelConfig."""

    target_layers: tuple[int, ...]
    target_hidden: int
    norm_before_residual: bool
    norm_before_fc: bool
    pr_branch: bool  # written by an early PR branch (its key and tensor names): d2t holds offsets there


def is_eagle3(gf: GGUFFile) -> bool:
    return gf.architecture == ARCH


def read_layout(gf: GGUFFile, n_vocab: int) -> tuple[ModelConfig, Eagle3Layout]:
    """The head's ModelConfig (n_embd H; n_vocab = the target's: its rows take target token ids) and the eagle3
    keys, checked for presence and form."""
    name = gf.path.name

    def key(k: str, default=None):
        value = gf.get(f"{ARCH}.{k}", default)
        if value is None:
            raise SpecCliError(f"{name}: metadata key {ARCH}.{k} is missing (not an EAGLE-3 draft in llama.cpp's "
                               "layout)")
        return value

    layers = next((gf.get(k) for k in LAYER_KEYS if gf.get(k) is not None), None)
    if not isinstance(layers, list) or len(layers) != N_FEATURES:
        raise SpecCliError(f"{name}: {LAYER_KEYS[0]} must list {N_FEATURES} target layers (got {layers!r})")
    if int(key("block_count", 1)) != 1:
        raise SpecCliError(f"{name}: an EAGLE-3 draft has one decoder block, this file {key('block_count')}")
    H, n_head = int(key("embedding_length")), int(key("attention.head_count"))
    head_dim = int(key("attention.key_length", H // n_head))
    scaling = gf.get(f"{ARCH}.rope.scaling.type", "none")
    cfg = ModelConfig(
        arch=ARCH, n_layer=1, n_embd=H, n_ff=int(key("feed_forward_length")), n_head=n_head,
        n_head_kv=int(key("attention.head_count_kv", n_head)), head_dim=head_dim, n_vocab=n_vocab,
        n_ctx_train=int(key("context_length", 4096)), rms_eps=float(key("attention.layer_norm_rms_epsilon")),
        rope_type="norm", rope_dim=int(key("rope.dimension_count", head_dim)),
        rope_base=float(key("rope.freq_base", 10000.0)), rope_base_swa=float(key("rope.freq_base", 10000.0)),
        rope_scale=float(key("rope.scaling.factor", 1.0)) if scaling == "linear" else 1.0,
        attn_scale=head_dim ** -0.5, sliding_window=0, swa_layers=[False])
    layout = Eagle3Layout(
        target_layers=tuple(int(v) for v in layers), target_hidden=int(key("target_hidden_size")),
        norm_before_residual=bool(gf.get(f"{ARCH}.norm_before_residual", False)),
        norm_before_fc=bool(gf.get(f"{ARCH}.norm_before_fc", False)) or "enc.output_norm.weight" in gf.tensors,
        pr_branch=gf.get(LAYER_KEYS[0]) is None or HIDDEN_NORMS[1] in gf.tensors)
    return cfg, layout


class Eagle3Head(nn.Module):
    """The head's own parameters; the target's embedding and output matrix (where the file has none) are used
    through a reference that is not a submodule (parameters() and state_dict() are the head's own)."""

    def __init__(self, cfg: ModelConfig, layout: Eagle3Layout, target, own: set[str] = frozenset(),
                 n_draft: int | None = None):
        super().__init__()
        H, Ht = cfg.n_embd, layout.target_hidden
        self.cfg, self.layout = cfg, layout
        self.fc = Linear(N_FEATURES * Ht, H)
        self.fc_norm = RMSNorm(N_FEATURES * Ht, cfg.rms_eps) if layout.norm_before_fc else None
        self.attn_norm = RMSNorm(H, cfg.rms_eps)
        self.hidden_norm = RMSNorm(H, cfg.rms_eps)
        self.attn = Attention(cfg, swa=False)
        for proj in (self.attn.wq, self.attn.wk, self.attn.wv):  # q, k, v read [embedding; feature]: 2H
            proj.weight = nn.Parameter(torch.empty(proj.weight.shape[0], 2 * H), requires_grad=False)
        self.ffn_norm = RMSNorm(H, cfg.rms_eps)
        self.ffn = FeedForward(cfg)
        self.out_norm = RMSNorm(H, cfg.rms_eps)
        self.output = Linear(H, n_draft or cfg.n_vocab) if "output" in own else None
        self.embed = Embedding(cfg.n_vocab, H) if "embed" in own else None
        self.rope_freqs: torch.Tensor | None = None  # [rope_dim / 2] llama-3 rope scaling factors
        self.draft_vocab: torch.Tensor | None = None  # [V_d] target id of each output row (d2t), None = row i is id i
        object.__setattr__(self, "target", target)  # a model.Transformer: shared, frozen, not a submodule
        self.device = target.layer_devices[-1] if target.layer_devices else torch.device("cpu")
        self.dtype = target.dtype
        self._rope_table: tuple[torch.Tensor, torch.Tensor] | None = None

    # --- forward -------------------------------------------------------------------------------------------

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """features [..., 3, H_t] (the tapped layers' inputs) -> g [..., H] = fc(feat) (fc(norm(feat)))."""
        x = features.reshape(*features.shape[:-2], -1).to(self.device, self.dtype)
        if self.fc_norm is not None:
            x = self.fc_norm(x)
        return self.fc(x)

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        embd = self.embed if self.embed is not None else self.target.tok_embd
        table = embd.weight if embd.weight is not None else embd.raw
        return embd(tokens.to(table.device)).to(self.device, self.dtype)

    def forward(self, tokens: torch.Tensor, g: torch.Tensor, plan: ForwardPlan, rope, k_cache, v_cache):
        """tokens [G, T], g [G, T, H] (fused features, or the pre-norm states of the draft positions before) ->
        the pre-norm states h2 [G, T, H]; keys and values written to the caches by the plan."""
        g = g.to(self.device, self.dtype)
        gn = self.hidden_norm(g)
        x = torch.cat((self.attn_norm(self.embed_tokens(tokens)), gn), dim=-1)  # [G, T, 2H]
        if rope is None:  # a decode on the kernels (step): rope and attention there
            a = self._attend_kernels(x, plan, k_cache, v_cache)
        else:
            a = self.attn(x, plan, rope, k_cache, v_cache)
        h = a + (gn if self.layout.norm_before_residual else g)
        return h + self.ffn(self.ffn_norm(h))

    def step(self, tokens: torch.Tensor, g: torch.Tensor, plan: ForwardPlan, k_cache, v_cache) -> torch.Tensor:
        """`forward` at the plan's positions with the head's rope (a HeadContext's decode): on the CPU kernels where
        the head's projections are (float32 activations and cache, fused quantized q|k|v), else torch's ops."""
        if isinstance(self.attn.qkv, QLinear) and kernels.usable(g) and k_cache.dtype == torch.float32:
            return self(tokens, g, plan, None, k_cache, v_cache)
        return self(tokens, g, plan, self.rope(plan.positions, plan.n_kv), k_cache, v_cache)

    def _attend_kernels(self, x: torch.Tensor, plan: ForwardPlan, k_cache, v_cache) -> torch.Tensor:
        """The attention of rows x [G, T, 2H] as the decoder blocks' kernels compute it (kernels.qkv_prep: rope and
        the cache writes; kernels.attention over the cache), one call each: torch's SDPA on one row cost most of a
        draft token (14 ms of 23 on the 0.5b's head)."""
        cfg, attn = self.cfg, self.attn
        G, T, _ = x.shape
        qkv = attn.qkv(x).reshape(G * T, -1)
        q = kernels.qkv_prep(qkv, cfg.n_head, cfg.n_head_kv, cfg.head_dim, None, None, cfg.rms_eps,
                             self.rope_table(plan.n_kv), cfg.rope_dim, False, plan.row_seq, plan.row_pos,
                             plan.row_write, k_cache, v_cache)
        out = kernels.attention(q, k_cache, v_cache, plan.row_seq, plan.row_pos, 0, cfg.attn_scale)
        return attn.wo(out).view(G, T, -1)

    def rope_table(self, n_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [>= n_pos, rope_dim / 2] float32 on the CPU: the shared table, or with rope_freqs the head's own
        (each frequency divided by its factor)."""
        cfg = self.cfg
        if self.rope_freqs is None:
            return rope_table(cfg.rope_dim, cfg.rope_base, cfg.rope_scale, n_pos)
        if self._rope_table is None or self._rope_table[0].shape[0] < n_pos:
            n = 1 << max(n_pos - 1, 1023).bit_length()
            inv = 1.0 / (cfg.rope_base ** (torch.arange(0, cfg.rope_dim, 2, dtype=torch.float64) / cfg.rope_dim))
            angles = (torch.arange(n, dtype=torch.float64) / cfg.rope_scale)[:, None] * inv / self.rope_freqs.double()
            self._rope_table = (angles.cos().float(), angles.sin().float())
        return self._rope_table

    def rope(self, positions: torch.Tensor, n_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [G, 1, T, rope_dim / 2] of positions [G, T] (each < n_pos), on their device."""
        cfg = self.cfg
        if self.rope_freqs is None:
            return rope_tables(positions, n_pos, cfg.rope_dim, cfg.rope_base, cfg.rope_scale)
        cos, sin = (t.to(positions.device)[positions].unsqueeze(1) for t in self.rope_table(n_pos))
        return cos, sin

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] (pre-norm) -> logits [..., V_d] float32; row i is token draft_vocab[i] (i without one)."""
        normed = self.out_norm(hidden.to(self.device))
        out = self.output if self.output is not None else self.target.output
        device = self.device if self.output is not None else self.target.output_device
        return out(normed.to(device)).float()

    @property
    def target_layers(self) -> tuple[int, ...]:
        return self.layout.target_layers


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
    d2t = read_d2t(gf, layout, tcfg.n_vocab)
    n_draft = gf.tensors["output.weight"].shape[0] if "output.weight" in names else None
    with torch.device("meta"):
        head = Eagle3Head(cfg, layout, target.model, own, n_draft)
    if device is not None:
        head.device = device
    quantize = target.weights == "q" and head.device.type == "cpu"
    for gguf_name, path_in_head in names.items():
        _load_into(head, gf, gguf_name, path_in_head, quantize)
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
    bad = [layer for layer in layout.target_layers if not 0 <= layer <= tcfg.n_layer_main]
    if bad:
        raise SpecCliError(f"{name}: reads target layers {list(layout.target_layers)}; this target has "
                           f"{tcfg.n_layer_main} layers")
    shared = [t for t, own in (("embedding", "token_embd.weight"), ("output matrix", "output.weight"))
              if own not in gf.tensors]
    if shared and cfg.n_embd != tcfg.n_embd:
        raise SpecCliError(f"{name}: uses the target's {' and '.join(shared)} but its hidden size {cfg.n_embd} is "
                           f"not the target's {tcfg.n_embd}")
    vocab = gf.get(f"{ARCH}.vocab_size")
    if vocab is not None and int(vocab) != tcfg.n_vocab:
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


def read_d2t(gf: GGUFFile, layout: Eagle3Layout, n_vocab: int) -> list[int] | None:
    """The target id of each draft-vocabulary row. llama.cpp's converter stores absolute ids; files of the PR
    branches stored offsets (target = i + d2t[i]); a table only one reading makes valid (distinct ids in the
    vocabulary) is read that way, the PR-branch names decide where both do."""
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
    chosen = "offsets" if layout.pr_branch and "offsets" in valid else valid[0]
    return readings[chosen].tolist()


def _load_into(head: Eagle3Head, gf: GGUFFile, name: str, path: str, quantize: bool) -> None:
    """One tensor into the head: norms and rope factors float32, linear weights in the head's dtype, or as QLinear
    blocks (`quantize`: the file's quantized blocks, float matrices quantized to Q8_0)."""
    info = gf.tensors[name]
    if path == "rope_freqs":
        head.rope_freqs = load_tensor(gf, name)
        return
    if path == "embed.weight":
        head.embed.weight = load_tensor(gf, name, head.device).to(head.dtype)
        return
    module_path = path.rpartition(".")[0]
    parent, _, attr = module_path.rpartition(".")
    owner = head.get_submodule(parent)
    module = getattr(owner, attr)
    if isinstance(module, Linear) and quantize and supports(info.qtype, info.shape):
        float_type = info.qtype.name in ("F32", "F16", "BF16")
        linear = (QLinear.from_float(load_tensor(gf, name)) if float_type
                  else QLinear.from_gguf(gf.tensor_bytes(name), info.qtype, info.shape))
        setattr(owner, attr, linear)
        return
    t = load_tensor(gf, name, head.device)
    module.weight = nn.Parameter(t if isinstance(module, RMSNorm) else t.to(head.dtype), requires_grad=False)


def _check_shapes(head: Eagle3Head, name: str, d2t: list[int] | None) -> None:
    """Every tensor the layout requires is there, with the shape the keys imply."""
    missing = [n for n, p in head.named_parameters() if p.is_meta]
    if missing:
        raise SpecCliError(f"{name}: missing tensors for {', '.join(missing)}")
    cfg, H, Ht = head.cfg, head.cfg.n_embd, head.layout.target_hidden
    n_q, n_kv = cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim
    expected = {"fc": (H, N_FEATURES * Ht), "attn.wq": (n_q, 2 * H), "attn.wk": (n_kv, 2 * H),
                "attn.wv": (n_kv, 2 * H), "attn.wo": (H, n_q), "ffn.w_gate": (cfg.n_ff, H), "ffn.w_up": (cfg.n_ff, H),
                "ffn.w_down": (H, cfg.n_ff)}
    if head.output is not None:
        expected["output"] = (len(d2t) if d2t is not None else cfg.n_vocab, H)
    for path, shape in expected.items():
        module = head.get_submodule(path)
        got = (module.n_out, module.n_in) if isinstance(module, QLinear) else tuple(module.weight.shape)
        if got != shape:
            raise SpecCliError(f"{name}: {path} has shape {list(got)}, {list(shape)} expected from the file's keys")
    norms = {"attn_norm": H, "hidden_norm": H, "ffn_norm": H, "out_norm": H}
    if head.fc_norm is not None:
        norms["fc_norm"] = N_FEATURES * Ht
    for path, n in norms.items():
        weight = head.get_submodule(path).weight
        if tuple(weight.shape) != (n,):
            raise SpecCliError(f"{name}: norm {path} has {weight.shape[0]} weights, {n} expected")
    if head.embed is not None and tuple(head.embed.weight.shape) != (cfg.n_vocab, H):
        raise SpecCliError(f"{name}: token_embd must be [{cfg.n_vocab}, {H}] (the target's vocabulary)")
    if head.output is None and d2t is not None and len(d2t) != cfg.n_vocab:
        raise SpecCliError(f"{name}: d2t has {len(d2t)} rows but the head uses the target's output matrix")


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
        arr = owner.weight.detach().float().cpu().numpy()
        block = gguf.GGML_QUANT_SIZES[qtype][0]
        if arr.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float32))
        elif qtype == gguf.GGMLQuantizationType.F16 or arr.shape[1] % block:
            writer.add_tensor(name, arr.astype(np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
    if head.draft_vocab is not None:
        writer.add_tensor(D2T_NAMES[0], head.draft_vocab.cpu().numpy().astype(np.int64),
                          raw_dtype=gguf.GGMLQuantizationType.I64)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(dst)
