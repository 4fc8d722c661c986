"""NextN / MTP head: one extra decoder block that predicts the token after next from (token, target hidden state).

Mirrors llama.cpp's NextN layout and graph (src/llama-arch.cpp tensor names, the MTP graphs of src/models/glm4-moe,
qwen3.5, deepseek2): a GGUF with `{arch}.nextn_predict_layers = n` carries n trailing blocks, counted in
`{arch}.block_count`. Block `blk.{il}` (il >= n_layer - n) holds the usual attention/FFN tensors plus
  nextn.eh_proj            [2*n_embd -> n_embd]
  nextn.enorm, nextn.hnorm RMS norms of the token embedding and of the target's hidden state
  nextn.embed_tokens       optional own embedding (else the target's token_embd)
  nextn.shared_head_norm   optional own final norm (else the target's output_norm)
  nextn.shared_head_head   optional own output matrix (else the target's output)
Graph for a row at position p: x = eh_proj(concat(enorm(embed(token_p)), hnorm(h_{p-1}))) -- embedding FIRST,
hidden second, as llama.cpp's `ggml_concat(ctx0, e_norm, h_norm, 0)` and vLLM's DeepSeek MTP
`torch.cat([inputs_embeds, previous_hidden_states])`; then the block (own KV, rope at p); its output is the head's
pre-norm hidden state (fed back as h for the next draft position) and shared_head_norm + head give the logits that
predict token_{p+1}.

The head drafts in a head_context.HeadContext: its own KV plus a feed of the hidden input each row reads (the
target's pre-norm hidden state for decoded target positions, the head's own output for positions being drafted).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch
from torch import nn

from spec_cli.errors import SpecCliError
from spec_cli.model.config import ModelConfig
from spec_cli.model.gguf_file import GGUFFile, copy_fields
from spec_cli.model.head_file import add_weight
from spec_cli.model.loader import _BLOCK_NAMES, LoadedModel, _set_param
from spec_cli.model.qlinear import QLinear, fuse_block_projections
from spec_cli.model.quants import load_tensor
from spec_cli.model.transformer import (
    Block,
    Embedding,
    ForwardPlan,
    Linear,
    RMSNorm,
    Transformer,
    rope_tables,
)

# GGUF suffix (after "blk.{il}.") -> attribute path inside MTPHead
NEXTN_NAMES = {
    "nextn.eh_proj.weight": "eh_proj.weight",
    "nextn.enorm.weight": "enorm.weight",
    "nextn.hnorm.weight": "hnorm.weight",
    "nextn.embed_tokens.weight": "embed.weight",
    "nextn.shared_head_norm.weight": "head_norm.weight",
    "nextn.shared_head_head.weight": "head.weight",
}
_OPTIONAL = {"embed", "head_norm", "head"}
# spec-cli's own key (llama.cpp ignores it): the token ids the head drafts among, most frequent first (mtp-train)
DRAFT_VOCAB_KEY = "spec_cli.nextn_draft_vocab"  # NextN parts that fall back to the target's when absent


class MTPHead(nn.Module):
    """One NextN layer. Own parameters only; the target's embedding / final norm / output are used through a
    reference that is not registered as a submodule (so `parameters()` and `state_dict()` are the head's own)."""

    def __init__(self, cfg: ModelConfig, layer: int, target: Transformer, own: set[str] = frozenset()):
        super().__init__()
        d = cfg.n_embd
        self.cfg, self.layer = cfg, layer
        self.eh_proj = Linear(2 * d, d)
        self.enorm = RMSNorm(d, cfg.rms_eps)
        self.hnorm = RMSNorm(d, cfg.rms_eps)
        self.block = Block(cfg, layer)
        self.embed = Embedding(cfg.n_vocab, d) if "embed" in own else None
        self.head_norm = RMSNorm(d, cfg.rms_eps) if "head_norm" in own else None
        self.head = Linear(d, cfg.n_vocab) if "head" in own else None
        object.__setattr__(self, "target", target)  # shared, frozen: not a submodule
        object.__setattr__(self, "draft_out", None)  # the output rows of the draft vocabulary (set_draft_vocab)
        self.draft_vocab: torch.Tensor | None = None  # [n] token ids, or None = the whole vocabulary
        self.device = target.layer_devices[-1] if target.layer_devices else torch.device("cpu")
        self.dtype = target.dtype

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        # no embed_scale (gemma): enorm is an RMS norm, so a constant factor on the embedding cancels
        embd = self.embed if self.embed is not None else self.target.tok_embd
        table = embd.weight if embd.weight is not None else embd.raw
        return embd(tokens.to(table.device)).to(self.device)

    def forward(self, tokens: torch.Tensor, prev: torch.Tensor, plan: ForwardPlan, rope, k_cache, v_cache):
        """tokens [G, T], prev [G, T, D] (target hidden at p-1) -> head pre-norm hidden [G, T, D]."""
        e = self.enorm(self.embed_tokens(tokens).to(self.dtype))  # [G, T, D]
        h = self.hnorm(prev.to(self.dtype))  # [G, T, D]
        x = self.eh_proj(torch.cat((e, h), dim=-1).to(self.dtype))  # [G, T, D] (norms compute in float32)
        return self.block(x, plan, rope, k_cache, v_cache)

    def step(self, tokens: torch.Tensor, prev: torch.Tensor, plan: ForwardPlan, k_cache, v_cache) -> torch.Tensor:
        """`forward` at the plan's positions with the head's rope (a HeadContext's decode)."""
        cfg = self.cfg
        base = cfg.rope_base_swa if self.block.swa else cfg.rope_base
        rope = rope_tables(plan.positions, plan.n_kv, cfg.rope_dim, base, cfg.rope_scale)
        return self(tokens, prev, plan, rope, k_cache, v_cache)

    def normed(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., D] -> final-normed [..., D] (what the output matrix reads)."""
        if self.head_norm is not None:
            return self.head_norm(hidden)
        return self.target.norm(hidden.to(self.target.output_device))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., D] (pre-norm) -> logits [..., V] float32."""
        return self._project(*self._output(), hidden)

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., D] -> logits over the draft vocabulary [..., len(draft_vocab)] (all V rows without one);
        row i of the result is token draft_vocab[i]."""
        if self.draft_out is None:
            return self.logits(hidden)
        return self._project(self.draft_out, *self._output()[1:], hidden)  # draft_out lives where its source does

    def set_draft_vocab(self, ids: torch.Tensor | None) -> None:
        """Draft only among `ids` (the most frequent tokens): the output matrix is most of a head's cost per drafted
        token (151,936 rows for qwen2.5), and a draft outside the set is merely rejected. Needs an output layer whose
        rows can be selected (float weights or GGUF blocks)."""
        out, device, _ = self._output()
        draft_out = None
        if ids is not None and hasattr(out, "select_rows"):
            draft_out = out.select_rows(ids.to(device, torch.long))
        object.__setattr__(self, "draft_out", draft_out)  # derived from shared weights: not the head's own
        self.draft_vocab = None if draft_out is None else ids.to(self.device, torch.long)

    def _output(self) -> tuple[nn.Module, torch.device, torch.dtype]:
        """The output matrix the head projects with (its own, else the target's), the device it is on and the
        activation dtype it takes (they differ in training: a float32 head on a bf16 target)."""
        if self.head is not None:
            return self.head, self.device, self.dtype
        return self.target.output, self.target.output_device, self.target.dtype

    def _project(self, out: nn.Module, device: torch.device, dtype: torch.dtype, hidden: torch.Tensor) -> torch.Tensor:
        return out(self.normed(hidden).to(device, dtype)).float()

    def own_tensors(self) -> dict[str, torch.Tensor]:
        """GGUF suffix (after blk.{il}.) -> tensor, for every parameter the head owns."""
        to_gguf = {v: k for k, v in NEXTN_NAMES.items()}
        to_gguf.update({"block." + v: k for k, v in _BLOCK_NAMES.items()})
        return {to_gguf[name]: p.detach() for name, p in self.named_parameters()}


def load_mtp_head(loaded: LoadedModel) -> MTPHead | None:
    """The first NextN layer of a loaded model (None when the GGUF has none), on the target's last-layer device.

    With several NextN layers llama.cpp's single-head mode applies the first one recursively; so do we."""
    cfg, gf = loaded.config, loaded.gguf
    if cfg.n_nextn <= 0:
        return None
    layer = cfg.n_layer_main
    prefix = f"blk.{layer}."
    names = {n[len(prefix):]: n for n in gf.tensors if n.startswith(prefix)}
    if "nextn.eh_proj.weight" not in names:
        raise SpecCliError(f"{gf.path.name}: nextn_predict_layers is set but {prefix}nextn.eh_proj.weight is missing")
    own = {NEXTN_NAMES[s].split(".")[0] for s in names if s in NEXTN_NAMES} & _OPTIONAL
    target = loaded.model
    with torch.device("meta"):
        head = MTPHead(cfg, layer, target, own)
    for suffix, name in names.items():
        if suffix in NEXTN_NAMES:
            path = NEXTN_NAMES[suffix]
        elif suffix in _BLOCK_NAMES:
            path = "block." + _BLOCK_NAMES[suffix]
        else:
            raise SpecCliError(f"{gf.path.name}: unsupported NextN tensor {name}")
        if path == "embed.weight":
            head.embed.weight = load_tensor(gf, name, head.device, torch.float32).to(head.dtype)
            continue
        is_norm = suffix.endswith(("norm.weight", ".bias"))  # norms stay float32, as the loader does
        t = load_tensor(gf, name, head.device, torch.float32)
        _set_param(head, path, t if is_norm else t.to(head.dtype))
    missing = [n for n, p in head.named_parameters() if p.is_meta]
    if missing:
        raise SpecCliError(f"{gf.path.name}: NextN layer {layer} is missing tensors for {', '.join(missing[:5])}")
    if loaded.weights == "q" and head.device.type == "cpu":
        _quantize(head)
    draft_vocab = gf.get(DRAFT_VOCAB_KEY)
    if draft_vocab:
        if min(draft_vocab) < 0 or max(draft_vocab) >= cfg.n_vocab:
            raise SpecCliError(f"{gf.path.name}: {DRAFT_VOCAB_KEY} holds token ids outside the vocabulary")
        head.set_draft_vocab(torch.tensor(draft_vocab, dtype=torch.long))
    return head.eval()


def _quantize(head: MTPHead) -> None:
    """With the target's weights kept quantized (`--dtype q`), the head's float linears become int8 too (its block
    and eh_proj are ~17M float32 weights for qwen2.5-coder-0.5b: 66 MB read per drafted token, as much as the
    rest of the head)."""
    for name, module in list(head.named_modules()):
        if isinstance(module, Linear):
            parent, _, leaf = name.rpartition(".")
            setattr(head.get_submodule(parent), leaf, QLinear.from_float(module.weight, module.bias))
    fuse_block_projections(head.block)


def write_gguf_with_head(src: str | Path, dst: str | Path, head_tensors: dict[str, np.ndarray],
                         draft_vocab: list[int] | None = None,
                         qtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32) -> Path:
    """dst = src (every metadata key with its GGUF type, every tensor's raw bytes as they are) + one NextN block.

    `head_tensors` maps the suffix after "blk.{il}." (e.g. "nextn.eh_proj.weight", "attn_q.weight") to float32
    arrays in torch order, written as head_file.add_weight writes them (matrices as `qtype`); il = the source's
    block_count, which is incremented, and nextn_predict_layers = 1.
    `draft_vocab`: the token ids the head drafts among (DRAFT_VOCAB_KEY), None = the whole vocabulary.
    """
    arch = GGUFFile(src).architecture
    reader = gguf.GGUFReader(str(src))
    block_key, nextn_key = f"{arch}.block_count", f"{arch}.nextn_predict_layers"
    if int(reader.fields[nextn_key].contents()) if nextn_key in reader.fields else 0:
        raise SpecCliError(f"{Path(src).name} already has NextN layers")
    il = int(reader.fields[block_key].contents())
    writer = gguf.GGUFWriter(str(dst), arch)
    copy_fields(reader, writer, lambda key: True, {block_key: il + 1})
    writer.add_uint32(nextn_key, 1)
    if draft_vocab:
        writer.add_array(DRAFT_VOCAB_KEY, [int(t) for t in draft_vocab])
    for t in reader.tensors:
        writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    for suffix, arr in head_tensors.items():
        add_weight(writer, f"blk.{il}.{suffix}", torch.from_numpy(np.asarray(arr)), qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(dst)
