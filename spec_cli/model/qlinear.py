"""Linear layers that keep GGUF weights as their blocks on the CPU (`--dtype q`, the CPU default), computed by the
compiled kernels (spec_cli/model/kernels).

A `QLinear` holds one or more weight segments, each the GGUF bytes of a [n_out, n_in] matrix as the file has them
(a view of the memory map; nothing is re-quantized, and the kernels read Q4_K rows regrouped 8 at a time,
`kernels.pack`, made when the layer is first described to them). Activations are quantized per block the way ggml
does (Q8_0 / Q8_1 / Q8_K) and multiplied with integer dot products, so the logits follow llama.cpp's closely and
each row's result is the same whatever else is in the batch. Block types the kernels do not multiply as they are
(Q2_K, Q3_K, the IQ types, BF16) are dequantized once to float32 rows.

Segments are how projections that read the same input (q|k|v, gate|up) run as one call: `fuse_projections`
concatenates them along n_out, whatever their block types.
"""

from __future__ import annotations

import gguf.quants
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from torch import nn

from spec_cli.model import kernels
from spec_cli.model.quants import dequantize

T = GGMLQuantizationType


class QLinear(nn.Module):
    """y = x W^T (+ b): [*, n_in] float32 -> [*, n_out] float32, W as GGUF block segments stacked along n_out."""

    def __init__(self, segments: list[tuple[GGMLQuantizationType, torch.Tensor]], n_in: int,
                 bias: nn.Parameter | None = None):
        super().__init__()
        self.n_in = n_in
        self.segments = segments  # [(qtype, raw [n_out_i, row_bytes] uint8)]
        self.sizes = [raw.shape[0] for _, raw in segments]  # n_out of each segment (the parts of a fused product)
        self.n_out = sum(self.sizes)
        self.bias = bias
        self._desc: tuple[nn.Parameter | None, kernels.LinearDesc] | None = None  # (the bias it points at, desc)

    @classmethod
    def from_gguf(cls, raw: torch.Tensor, qtype: GGMLQuantizationType, shape: tuple[int, int],
                  bias: nn.Parameter | None = None) -> "QLinear":
        """raw: the tensor's bytes ([n_bytes] uint8, e.g. a view of the GGUF memory map), shape [n_out, n_in]."""
        N, K = shape
        if qtype in kernels.NATIVE_TYPES:
            return cls([(qtype, raw.view(N, -1))], K, bias)
        return cls([(T.F32, dequantize(raw, qtype, (N, K)).view(torch.uint8))], K, bias)

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: nn.Parameter | None = None) -> "QLinear":
        """A float weight [N, K] quantized to Q8_0 blocks by gguf's quantizer (a distilled MTP head's block, stored as
        float32)."""
        blocks = gguf.quants.quantize(weight.detach().float().cpu().numpy(), T.Q8_0)  # [N, K / 32 * 34] uint8
        return cls([(T.Q8_0, torch.from_numpy(blocks))], weight.shape[1], bias)

    def select_rows(self, ids: torch.Tensor) -> "QLinear":
        """The layer restricted to output rows `ids` (a draft vocabulary): y[..., i] = full y[..., ids[i]]."""
        (qtype, raw), = self.segments
        bias = None if self.bias is None else nn.Parameter(self.bias[ids], requires_grad=False)
        return QLinear([(qtype, raw[ids].contiguous())], self.n_in, bias)

    @property
    def desc(self) -> kernels.LinearDesc:
        """What the kernels read (the segments packed, `kernels.pack`, on first use), rebuilt when the bias was
        replaced: the loader may set it after the weight."""
        if self._desc is None or self._desc[0] is not self.bias:
            self._desc = (self.bias, kernels.LinearDesc(self.segments, self.n_in, self.bias))
        return self._desc[1]

    @property
    def quantized(self) -> bool:
        """Whether some segment holds quantized blocks (not float rows)."""
        return any(qtype not in (T.F32, T.F16) for qtype, _ in self.segments)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.n_in)
        if rows.dtype != torch.float32 or not rows.is_contiguous():
            rows = rows.float().contiguous()
        y = kernels.linear(self.desc, rows)
        return y.view(*x.shape[:-1], self.n_out)


def supports(qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> bool:
    """Whether a weight of this type and [N, K] shape gets a QLinear (else it stays a float `Linear`): the kernels
    need K a multiple of 32 and whole blocks per row."""
    if not kernels.available() or len(shape) != 2 or shape[1] % 32 or qtype not in GGML_QUANT_SIZES:
        return False
    return qtype not in kernels.NATIVE_TYPES or shape[1] % GGML_QUANT_SIZES[qtype][0] == 0


def _concat(parts: list[QLinear]) -> QLinear:
    biases = [m.bias if m.bias is not None else torch.zeros(m.n_out) for m in parts]
    has_bias = any(m.bias is not None for m in parts)
    bias = nn.Parameter(torch.cat(biases), requires_grad=False) if has_bias else None
    return QLinear([seg for m in parts for seg in m.segments], parts[0].n_in, bias)


def fuse_projections(model: nn.Module) -> None:
    """Give every block's attention a fused q|k|v and its FFN a fused gate|up (model.Attention.qkv,
    model.FeedForward.gate_up): one kernel call each; the parts are dropped (their weights live on in the product)."""
    for block in model.layers:
        fuse_block_projections(block)


def fuse_block_projections(block: nn.Module) -> None:
    """fuse_projections for one block (model.Block); its kernel descriptor is rebuilt on next use."""
    block.kernel = None
    fuse_attention_ffn(block.attn, block.ffn)


def fuse_attention_ffn(attn: nn.Module, ffn: nn.Module) -> None:
    """q|k|v of an attention (model.Attention.qkv) and gate|up of an FFN (model.FeedForward.gate_up) as one product
    each, where every part is a QLinear."""
    for owner, names, attr in ((attn, ("wq", "wk", "wv"), "qkv"), (ffn, ("w_gate", "w_up"), "gate_up")):
        parts = [getattr(owner, n) for n in names]
        if not all(isinstance(m, QLinear) for m in parts):
            continue
        setattr(owner, attr, _concat(parts))
        for n in names:
            setattr(owner, n, None)
