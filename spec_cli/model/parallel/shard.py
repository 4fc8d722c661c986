"""One rank's shard of a loaded Transformer, Megatron-style (as gpt-fast's tp.py and vLLM's parallel linears).

Per block: q/k/v keep the rows of this rank's heads (whole KV-head groups) and gate/up the rows of its FFN columns
(column parallel); wo and w_down keep the matching input columns, and their partial products are summed over the
ranks (`RowParallel`: the one all-reduce after attention, the one after the MLP). The output layer keeps a range
of vocabulary rows and gathers the logits of the rows the context asks logits for (`VocabParallel`). Embedding,
norms and the residual stream stay whole (float32) on every rank; the KV cache follows the local head counts.

GGUF blocks: cutting output rows is free; input columns are cut on block boundaries of the matrix's type (32
values for Q4_0..Q8_0, 256 for the K-quants). The FFN columns are split by whole blocks of w_down (an uneven split
where the blocks do not divide); wo's columns follow the heads, and where a head boundary falls inside a block wo stays
whole on every rank, which gathers the heads' outputs instead of summing partial products (a note on stderr says
so).
"""

from __future__ import annotations

import dataclasses
import functools
import sys

import torch
from gguf import GGML_QUANT_SIZES
from torch import nn

from spec_cli.errors import SpecCliError
from spec_cli.model.config import ModelConfig
from spec_cli.model.loader import LoadedModel
from spec_cli.model.parallel import comm as tp_comm
from spec_cli.model.qlinear import QLinear
from spec_cli.model.transformer import Block, Linear


class RowParallel(nn.Module):
    """A layer holding some input columns: y = all-reduce over the ranks of (x[..., columns] W[:, columns]^T)."""

    def __init__(self, local: nn.Module):
        super().__init__()
        self.local = local

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tp_comm.all_reduce(self.local(x).contiguous())


class GatheredInput(nn.Module):
    """A layer kept whole on every rank, where its input columns cannot be cut on block boundaries: the ranks'
    input slices are gathered (in rank order: the whole input) and every rank computes the whole product."""

    def __init__(self, whole: nn.Module):
        super().__init__()
        self.whole = whole

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.whole(torch.cat(tp_comm.all_gather(x.contiguous()), dim=-1))


class VocabParallel(nn.Module):
    """The output layer holding vocabulary rows [start, stop) of `sizes`: logits of all rows, gathered."""

    def __init__(self, local: nn.Module, sizes: list[int]):
        super().__init__()
        self.local, self.sizes = local, sizes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        part = self.local(x)  # [*, V_local]; padded to the largest shard for the gather
        pad = max(self.sizes) - part.shape[-1]
        if pad:
            part = torch.nn.functional.pad(part, (0, pad))
        parts = tp_comm.all_gather(part.contiguous())
        return torch.cat([p[..., :n] for p, n in zip(parts, self.sizes)], dim=-1)  # [*, V]


def split(n: int, world: int, rank: int) -> range:
    """Units [start, stop) of rank `rank` when n units are split as evenly as whole units allow."""
    return range(n * rank // world, n * (rank + 1) // world)


def check_divisible(cfg: ModelConfig, world: int) -> None:
    """Heads are split by whole KV-head groups: -tp N needs N to divide the KV heads (and leave FFN blocks)."""
    if cfg.n_head_kv % world:
        raise SpecCliError(f"-tp {world}: the model's {cfg.n_head_kv} KV heads ({cfg.n_head} attention heads) do "
                           f"not divide over {world} ranks")


def shard_model(loaded: LoadedModel, rank: int, world: int) -> LoadedModel:
    """The model cut in place to rank `rank` of `world`; its config then names the local head counts."""
    cfg = loaded.config
    check_divisible(cfg, world)
    kv_heads = split(cfg.n_head_kv, world, rank)
    group = cfg.n_head // cfg.n_head_kv
    local = dataclasses.replace(cfg, n_head=len(kv_heads) * group, n_head_kv=len(kv_heads))
    for block in loaded.model.layers:
        _shard_attention(block, local, kv_heads, group, rank)
        _shard_ffn(block, world, rank)
        block.kernel = None  # the fused sc_block cannot all-reduce mid-block: per-op path (RowParallel is no QLinear)
    model = loaded.model
    vocab = [len(split(cfg.n_vocab, world, r)) for r in range(world)]
    model.output = VocabParallel(_rows(model.output, [_span(split(cfg.n_vocab, world, rank))]), vocab)
    for m in model.modules():  # packed for the kernels now, not during the first request
        if isinstance(m, QLinear):
            m.desc
    return dataclasses.replace(loaded, config=local)


def _span(r: range) -> slice:
    return slice(r.start, r.stop)


def _shard_attention(block: Block, local: ModelConfig, kv_heads: range, group: int, rank: int) -> None:
    attn, hd = block.attn, local.head_dim
    q_rows = slice(kv_heads.start * group * hd, kv_heads.stop * group * hd)
    kv_rows = slice(kv_heads.start * hd, kv_heads.stop * hd)
    if attn.qkv is not None:
        attn.qkv = _rows(attn.qkv, [q_rows, kv_rows, kv_rows])
    else:
        attn.wq, attn.wk, attn.wv = (_rows(m, [s]) for m, s in ((attn.wq, q_rows), (attn.wk, kv_rows),
                                                               (attn.wv, kv_rows)))
    attn.wo = _input_parallel(attn.wo, q_rows, rank)
    attn.cfg = local


def _shard_ffn(block: Block, world: int, rank: int) -> None:
    ffn = block.ffn
    n_ff = ffn.w_down.n_in if isinstance(ffn.w_down, QLinear) else ffn.w_down.weight.shape[1]
    unit = _block_size(ffn.w_down)
    if n_ff // unit < world:
        raise SpecCliError(f"-tp {world}: the FFN's {n_ff} columns are fewer than {world} blocks of {unit}")
    blocks = split(n_ff // unit, world, rank)
    cols = slice(blocks.start * unit, blocks.stop * unit)
    if ffn.gate_up is not None:
        ffn.gate_up = _rows(ffn.gate_up, [cols, cols])
    else:
        ffn.w_gate, ffn.w_up = _rows(ffn.w_gate, [cols]), _rows(ffn.w_up, [cols])
    ffn.w_down = _input_parallel(ffn.w_down, cols, rank)


def _block_size(layer: nn.Module) -> int:
    """Values per GGUF block along a row of the layer's weight (1 for float weights)."""
    if isinstance(layer, QLinear):
        return GGML_QUANT_SIZES[layer.segments[0][0]][0]
    return 1


def _rows(layer: nn.Module, spans: list[slice]) -> nn.Module:
    """The layer keeping the output rows spans[i] of its i-th part (a QLinear's segments; a Linear has one)."""
    if isinstance(layer, QLinear):
        starts = [sum(layer.sizes[:i]) for i in range(len(spans))]
        segments = [(qtype, raw[s].contiguous()) for (qtype, raw), s in zip(layer.segments, spans)]
        bias = None
        if layer.bias is not None:
            bias = torch.cat([layer.bias[o + s.start: o + s.stop] for o, s in zip(starts, spans)])
            bias = nn.Parameter(bias, requires_grad=False)
        return QLinear(segments, layer.n_in, bias)
    (s,) = spans
    out = Linear(0, 0)
    out.weight = nn.Parameter(layer.weight[s].contiguous(), requires_grad=False)
    out.bias = None if layer.bias is None else nn.Parameter(layer.bias[s].contiguous(), requires_grad=False)
    return out


def _input_parallel(layer: nn.Module, cols: slice, rank: int) -> nn.Module:
    """The layer for a rank that holds input columns `cols`: those columns of its weight, the partial products summed
    over the ranks (its bias added by rank 0 only); or, where `cols` cuts a GGUF block, the whole layer after a
    gather of the inputs."""
    bias = layer.bias if rank == 0 else None
    if not isinstance(layer, QLinear):
        local = Linear(0, 0)
        local.weight = nn.Parameter(layer.weight[:, cols].contiguous(), requires_grad=False)
        local.bias = bias
        return RowParallel(local)
    (qtype, raw), = layer.segments
    unit, type_size = GGML_QUANT_SIZES[qtype]
    if cols.start % unit or cols.stop % unit:
        _note(f"spec-cli: -tp: the heads' columns of a {qtype.name} matrix ({cols.start}..{cols.stop}) cut its "
              f"{unit}-value blocks; it stays whole on every rank (its inputs gathered instead)")
        return GatheredInput(layer)
    raw = raw[:, cols.start // unit * type_size: cols.stop // unit * type_size].contiguous()
    return RowParallel(QLinear([(qtype, raw)], cols.stop - cols.start, bias))


@functools.cache
def _note(message: str) -> None:
    print(message, file=sys.stderr)
