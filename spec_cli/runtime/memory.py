"""The memory an engine's weights and KV caches take: estimated per device before anything is loaded, so that a -c /
-np / draft combination that cannot fit is refused with the numbers (llama.cpp #23472: a draft model's memory that
nobody counted crashed servers), and measured once loaded, for the run summary, --json and the server's /props.

Estimate, per GGUF tensor as model/loader.py holds it: on a CPU layer whose weights stay quantized (weight_format), a
matrix of a block type the kernels multiply takes its file bytes (packed once for them), one of another block type
float32 rows; any other matrix its elements times the float dtype's size (bf16 on CUDA, float32 on the CPU); the token
embedding stays as stored wherever it lives; norms are float32. A head's matrices become Q8_0 on a CPU that
keeps target weights in quantized blocks (as mtp_head.py, eagle3_file.py and dflash_file.py do); a head's own
embedding tables (token_embd, DSpark's markov_w1) are float rows. The draft model's draft vocabulary (--draft-vocab)
adds its share of the output rows, twice (the rows copied out and the kernels' packed copy of them). KV caches are
exact (Context: [layers] x K and V of kv_shape, in the activations' dtype; a one-layer head's plus its feed of one
n_embd row per cell; a DFlash drafter's layers, no feed). The suffix drafter's token store (`store`, host memory):
its buffers at their bounds (suffix_store_estimate). Free memory: MemAvailable of /proc/meminfo on the CPU, the
driver's free bytes on a CUDA device.

Measured: every tensor the loaded modules hold, once (QLinear's packed copies, not the memory map they were made
from; the embedding rows, which are read from it; a draft vocabulary's rows and their packed copy), and the contexts'
KV (and feed) tensors; the suffix drafter's buffers as they are when asked (they grow as requests run).
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field
from math import prod

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from torch import nn

from spec_cli.errors import SpecCliError
from spec_cli.model import kernels
from spec_cli.model.config import ModelConfig
from spec_cli.model.context import Context, kv_shape
from spec_cli.model.dflash_file import read_layout as dflash_layout
from spec_cli.model.eagle3_file import read_layout as eagle3_layout
from spec_cli.model.gguf_file import GGUFFile, TensorInfo
from spec_cli.model.head_context import HeadContext
from spec_cli.model.loader import layer_devices, torch_device, weight_format
from spec_cli.model.qlinear import QLinear, supports
from spec_cli.runtime.draft_files import head_device
from spec_cli.speculative.draft_model import DraftModelDrafter
from spec_cli.speculative.suffix import SuffixDrafter

GIB = 1 << 30
MIB = 1 << 20
Q8_0_BYTES = GGML_QUANT_SIZES[GGMLQuantizationType.Q8_0][1] / GGML_QUANT_SIZES[GGMLQuantizationType.Q8_0][0]
_BLOCK = re.compile(r"^blk\.(\d+)\.")
INT_TYPES = (GGMLQuantizationType.I32, GGMLQuantizationType.I64)
EMBEDDINGS = ("token_embd.weight", "markov_w1.weight")  # a head's own tables: float rows
# the part of each head: the one-layer heads (HeadContext) and the DFlash drafter of either type (DFlashContext)
HEAD_PARTS = {"draft-mtp": "mtp head", "draft-eagle3": "eagle3 head", "draft-dflash": "dflash head",
              "draft-dspark": "dflash head"}
SUFFIX_PART = "suffix drafter"  # the suffix drafter's token store (host memory), a part of its own
KINDS = {"weights": "weights", "kv": "KV cache", "store": "store"}  # a part's figures and how messages name them


@dataclass
class Part:
    """One model, head or drafter of an engine: bytes of its weights, of its KV cache and of a drafter's token store,
    per device name."""

    name: str  # target | draft | mtp head | eagle3 head | dflash head | suffix drafter
    weights: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    kv: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    store: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def as_dict(self) -> dict:
        return {"devices": sorted({*self.weights, *self.kv, *self.store}),
                **{kind: sum(getattr(self, kind).values()) for kind in KINDS}}


# --- the estimate ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Placement:
    """Where a model's blocks and output live and how their weights are held (loader.layer_devices, weight_format)."""

    devices: list[torch.device]
    output: torch.device
    quantize: bool
    dtype: torch.dtype

    @classmethod
    def of(cls, cfg: ModelConfig, device: str | None, n_gpu_layers: int, dtype: str) -> Placement:
        devices, output = layer_devices(cfg.n_layer_main, torch_device(device), n_gpu_layers)
        quantize, torch_dtype = weight_format(dtype, devices + [output])
        return cls(devices, output, quantize and kernels.available(), torch_dtype)

    @property
    def float_size(self) -> int:
        return torch.empty(0, dtype=self.dtype).element_size()


def model_part(name: str, gf: GGUFFile, cfg: ModelConfig, where: Placement, n_ctx: int, n_seq: int,
               draft_vocab: int = 0) -> Part:
    """A model's weights (its main blocks, embedding and output) and KV cache, estimated."""
    part = Part(name)
    for tensor, info in gf.tensors.items():
        block = _BLOCK.match(tensor)
        if block and int(block[1]) >= cfg.n_layer_main:
            continue  # NextN blocks: the MTP head's, loaded only for draft-mtp
        device = where.devices[int(block[1])] if block else where.output
        if tensor == "token_embd.weight":
            part.weights[str(where.devices[0])] += info.n_bytes  # rows dequantized on lookup
            if not cfg.tied_output:
                continue
        part.weights[str(device)] += _matrix_bytes(info, device, where)
        if draft_vocab and tensor == ("token_embd.weight" if cfg.tied_output else "output.weight"):
            rows = min(draft_vocab, info.shape[0]) / info.shape[0]  # --draft-vocab: the rows, and their packed copy
            part.weights[str(device)] += int(2 * rows * _matrix_bytes(info, device, where))
    for device in where.devices:
        part.kv[str(device)] += 2 * prod(kv_shape(cfg, n_ctx, n_seq)) * where.float_size
    return part


def _matrix_bytes(info: TensorInfo, device: torch.device, where: Placement) -> int:
    if len(info.shape) < 2:  # norms stay float32 (RMSNorm computes in float32), biases take the float dtype
        return info.n_elements * (4 if info.name.endswith("norm.weight") else where.float_size)
    if where.quantize and device.type == "cpu" and supports(info.qtype, info.shape):
        return info.n_bytes if info.qtype in kernels.NATIVE_TYPES else 4 * info.n_elements
    return info.n_elements * where.float_size


def kept_quantized(gf: GGUFFile, where: Placement) -> bool:
    """Whether the loader keeps some CPU matrix of the model in a quantized block type (LoadedModel.weights "q"):
    then the heads are quantized too."""
    if not where.quantize or all(d.type != "cpu" for d in where.devices):
        return False
    return any(len(i.shape) == 2 and supports(i.qtype, i.shape) and i.qtype in kernels.NATIVE_TYPES
               and i.qtype not in (GGMLQuantizationType.F32, GGMLQuantizationType.F16) for i in gf.tensors.values())


def head_part(name: str, tensors: list[TensorInfo], cfg: ModelConfig, device: torch.device, quantize: bool,
              float_size: int, n_ctx: int, n_seq: int, feed: bool = True) -> Part:
    """A head's tensors and KV, estimated: a one-layer head (HeadContext) one layer's KV and its feed; a DFlash
    drafter (DFlashContext, `feed` False) the KV of its cfg.n_layer layers."""
    part = Part(name)
    for info in tensors:
        if len(info.shape) < 2:  # norms float32, d2t's ids int64
            size = (8 if info.qtype in INT_TYPES else 4) * info.n_elements
        elif quantize and device.type == "cpu" and info.name not in EMBEDDINGS:
            size = min(info.n_bytes, int(info.n_elements * Q8_0_BYTES))
        else:
            size = info.n_elements * float_size
        part.weights[str(device)] += size
    n_seq_, _, cells, _ = kv_shape(cfg, n_ctx, n_seq)
    layers, feed_size = (1, n_seq_ * cells * cfg.n_embd) if feed else (cfg.n_layer, 0)
    part.kv[str(device)] += (2 * layers * prod(kv_shape(cfg, n_ctx, n_seq)) + feed_size) * float_size
    return part


def estimate(opts, target: GGUFFile, draft: GGUFFile | None, head: tuple[str, GGUFFile] | None) -> list[Part]:
    """The parts an engine of `opts` (runtime/engine.py EngineOptions) will hold: the target, the draft model
    (`draft`, for draft-simple), a head (`head`: draft-mtp and the file holding its NextN layers, or draft-eagle3,
    draft-dflash or draft-dspark and its -md file)."""
    cfg = ModelConfig.from_gguf(target)
    n_ctx = opts.n_ctx if opts.n_ctx > 0 else cfg.n_ctx_train
    where = Placement.of(cfg, opts.device, opts.n_gpu_layers, opts.dtype)
    parts = [model_part("target", target, cfg, where, n_ctx, opts.n_seq)]
    if draft is not None:
        dcfg = ModelConfig.from_gguf(draft)
        dwhere = Placement.of(dcfg, opts.device_draft or opts.device, opts.n_gpu_layers_draft, opts.dtype)
        parts.append(model_part("draft", draft, dcfg, dwhere, n_ctx, opts.n_seq, opts.spec.draft_vocab))
    if head is not None:
        kind, gf = head
        if kind == "draft-mtp":
            prefix = f"blk.{cfg.n_layer_main}."
            tensors, hcfg, device = [i for n, i in gf.tensors.items() if n.startswith(prefix)], cfg, where.devices[-1]
        else:
            layout = eagle3_layout if kind == "draft-eagle3" else dflash_layout
            tensors, hcfg = list(gf.tensors.values()), layout(gf, cfg.n_vocab)[0]
            device = head_device(opts.device, opts.device_draft, opts.n_gpu_layers_draft)
        parts.append(head_part(HEAD_PARTS[kind], tensors, hcfg, device, kept_quantized(target, where),
                               where.float_size, n_ctx, opts.n_seq, feed=kind in ("draft-mtp", "draft-eagle3")))
    if SuffixDrafter.name in opts.spec.types:
        store = Part(SUFFIX_PART)
        store.store["cpu"] = suffix_store_estimate(opts.spec.suffix_cache_tokens, opts.n_seq, n_ctx // opts.n_seq)
        parts.append(store)
    return parts


def suffix_store_estimate(cache_tokens: int, n_seq: int, n_ctx_seq: int) -> int:
    """The suffix drafter's buffers at their bounds (speculative/suffix.py), int32 token ids, 4 bytes each: the
    earlier outputs shared by every sequence, [cache_tokens] (--spec-suffix-cache-tokens), and each sequence's own
    prompt and output with id_last's slot, [n_seq][n_ctx_seq + 1]. Left out: the SEPARATOR after each stored output
    (one int32 per finished request, under 1 % for outputs of 100 tokens or more), the buffer's copy while an output
    is added (TokenStore._keep builds the new buffer before dropping the old) and a draft's scan temporaries."""
    return np.dtype(np.int32).itemsize * (cache_tokens + n_seq * (n_ctx_seq + 1))


def check_fits(parts: list[Part], opts) -> None:
    """Refuse (SpecCliError, before anything is allocated) a combination whose parts need more than a device has
    free, naming every part's figures on that device."""
    need: dict[str, list[tuple[str, int]]] = defaultdict(list)
    for p in parts:
        for kind, label in KINDS.items():
            for device, n in getattr(p, kind).items():
                need[device].append((f"{p.name} {label}", n))
    for device, items in need.items():
        free = available(device)
        total = sum(n for _, n in items)
        if free is not None and total > free:
            suffix = ", --spec-suffix-cache-tokens" if any(p.name == SUFFIX_PART for p in parts) else ""
            draft = " or leave out the draft" if any(p.name != SUFFIX_PART for p in parts[1:]) else ""
            raise SpecCliError(
                f"not enough memory on {device}: -c {opts.n_ctx} -np {opts.n_seq} needs {size(total)} "
                f"({', '.join(f'{what} {size(n)}' for what, n in items)}) and {size(free)} is free: lower -c"
                f"{suffix} or -np{draft}")


def available(device: str) -> int | None:
    """Bytes free for a new allocation on a device (None: unknown, nothing is refused)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.mem_get_info(dev)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def size(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / MIB:.1f} MiB"


# --- measured -------------------------------------------------------------------------------------------------------


def measured(engine, drafters=()) -> dict[str, dict]:
    """Each part of a loaded engine: {"devices", "weights", "kv", "store"} in bytes, plus their "total". `drafters`:
    the session's, whose own tensors (a draft vocabulary's output rows) count with the draft model and whose token
    store (the suffix drafter's) is a part of its own."""
    seen = held(engine.target.model)
    parts = {"target": (seen, [engine.ctx])}
    if engine.draft is not None:
        own = held(engine.draft.model)
        for d in drafters:
            if isinstance(d, DraftModelDrafter) and d.vocab is not None:
                for layer in d.vocab.layers():
                    own.update(held(layer, copies=True))
        parts["draft"] = (own, [engine.draft_ctx])
    heads = (("mtp head", engine.mtp_ctx), ("eagle3 head", engine.eagle3_ctx), ("dflash head", engine.dflash_ctx))
    for name, ctx in heads:
        if ctx is not None:
            parts[name] = ({k: v for k, v in held(ctx.head).items() if k not in seen}, [ctx])
    out = {name: {"devices": sorted({d for d, _ in tensors} | {str(c.device) for c in ctxs}),
                  "weights": sum(tensors.values()), "kv": sum(context_bytes(c) for c in ctxs), "store": 0}
           for name, (tensors, ctxs) in parts.items()}
    return with_stores(out, drafters)


def with_stores(memory: dict[str, dict], drafters) -> dict[str, dict]:
    """`memory` (measured's) with the drafters' token stores as they are now, and the total again: the server
    measures its models once and the suffix drafter's store, which grows as requests finish, at each /props."""
    out = {name: part for name, part in memory.items() if name not in ("total", SUFFIX_PART)}
    for d in drafters:
        if isinstance(d, SuffixDrafter):
            out[SUFFIX_PART] = {"devices": ["cpu"], "weights": 0, "kv": 0, "store": d.store_bytes()}
    out["total"] = {kind: sum(p[kind] for p in out.values()) for kind in KINDS}
    return out


def held(module: nn.Module, copies: bool = False) -> dict[tuple[str, int], int]:
    """(device, data pointer) -> bytes of every tensor a module and its children hold: parameters, buffers, tensor
    attributes (an embedding's rows) and a QLinear's packed weights; `copies`: its weights as given too (rows copied
    out of the memory map, a draft vocabulary's, rather than views of it)."""
    out = {}
    for m in module.modules():
        tensors = [*m.parameters(recurse=False), *m.buffers(recurse=False),
                   *(v for v in vars(m).values() if isinstance(v, torch.Tensor))]
        if isinstance(m, QLinear):
            tensors += [raw for _, raw in m.desc.packed]
            tensors += [raw for _, raw in m.segments] if copies else []
        for t in tensors:
            if t.device.type != "meta":
                out[(str(t.device), t.data_ptr())] = t.numel() * t.element_size()
    return out


def context_bytes(ctx: Context) -> int:
    """The KV cache of a context, with a head's feed."""
    n = sum(t.numel() * t.element_size() for kv in ctx.kv for t in kv)
    return n + (ctx.feed.numel() * ctx.feed.element_size() if isinstance(ctx, HeadContext) else 0)
