"""GGUF file -> Transformer with weights on their devices.

Raw GGML bytes are moved to the destination device first and dequantized there (quants.py), so on CUDA the
dequantization runs on the GPU. `-ngl N` places the last N blocks on the GPU like llama.cpp (the output layer
goes with them when N > n_layer).
"""

from __future__ import annotations

import functools
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from spec_cli.errors import SpecCliError
from spec_cli.model import kernels
from spec_cli.model.config import ModelConfig
from spec_cli.model.gguf_file import GGUFFile
from spec_cli.model.qlinear import QLinear, fuse_projections, supports
from spec_cli.model.quants import load_tensor
from spec_cli.model.transformer import Linear, Transformer
from spec_cli.options import DEFAULT_GPU_LAYERS, default

# GGUF block tensor suffix -> attribute path inside model.Block
_BLOCK_NAMES = {
    "attn_norm.weight": "attn_norm.weight",
    "attn_q.weight": "attn.wq.weight",
    "attn_q.bias": "attn.wq.bias",
    "attn_k.weight": "attn.wk.weight",
    "attn_k.bias": "attn.wk.bias",
    "attn_v.weight": "attn.wv.weight",
    "attn_v.bias": "attn.wv.bias",
    "attn_output.weight": "attn.wo.weight",
    "attn_q_norm.weight": "attn.q_norm.weight",
    "attn_k_norm.weight": "attn.k_norm.weight",
    "post_attention_norm.weight": "post_attn_norm.weight",
    "ffn_norm.weight": "ffn_norm.weight",
    "ffn_gate.weight": "ffn.w_gate.weight",
    "ffn_up.weight": "ffn.w_up.weight",
    "ffn_down.weight": "ffn.w_down.weight",
    "post_ffw_norm.weight": "post_ffn_norm.weight",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


@dataclass
class LoadedModel:
    model: Transformer
    config: ModelConfig
    gguf: GGUFFile
    load_ms: float
    weights: str = "f32"  # how linear weights are held: "q" (kept quantized, qlinear.py), "f32", "bf16" or "f16"
    # -tp: the key every rank knows this rank's shard by (tensor_parallel.py); `config` then has the local head counts
    shard: str | None = None


def is_auto_device(name: str | None) -> bool:
    """`-dev auto` (also left out): CUDA where there is a GPU, else the CPU."""
    return name in (None, "", "auto")


def torch_device(name: str | None) -> torch.device:
    """`-dev`'s value (options.device: auto | cpu | none | cuda | cuda:N) as the torch device; auto (also left out)
    is CUDA where there is a GPU, none the CPU."""
    if is_auto_device(name):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device("cpu" if name == "none" else name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SpecCliError(f"device '{name}' requested but CUDA is not available on this machine")
    return device


_DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}  # --dtype's float names (options.py)
_DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


def float_dtype(name: str, device: torch.device) -> torch.dtype:
    """Float dtype of activations and of weights that are not kept quantized: `auto` = bf16 on CUDA, f32 on the CPU
    (half precision matmuls are >100x slower on this kind of CPU)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


def cpu_bf16_is_fast() -> bool:
    """Whether this CPU multiplies bf16 matrices natively (AVX512-BF16 or AMX): then a bf16 product of hundreds of
    rows runs ~4x faster than float32 (850 vs 188 GFLOPS measured on 2 cores); without them bf16 is emulated."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def layer_devices(n_layer: int, device: torch.device, n_gpu_layers: int) -> tuple[list[torch.device], torch.device]:
    """Per-block devices and the output layer's device. -1 = everything on `device`."""
    if device.type == "cpu" or n_gpu_layers < 0:
        return [device] * n_layer, device
    n_gpu = min(n_gpu_layers, n_layer)
    cpu = torch.device("cpu")
    devices = [cpu] * (n_layer - n_gpu) + [device] * n_gpu
    return devices, device if n_gpu_layers > n_layer else cpu


def _set_param(module: nn.Module, path: str, tensor: torch.Tensor) -> None:
    *parents, leaf = path.split(".")
    for p in parents:
        module = getattr(module, p)
    if getattr(module, leaf, None) is None and leaf == "bias":
        raise SpecCliError(f"unexpected bias tensor for {path}")
    setattr(module, leaf, nn.Parameter(tensor, requires_grad=False))


def _set_quantized(module: nn.Module, path: str, gf: GGUFFile, name: str) -> bool:
    """`--dtype q`: put a quantized module (qlinear.py) in place of the Linear whose weight is `path`, if the
    tensor's block type has one; its bias, loaded before or after, stays a float parameter."""
    info = gf.tensors[name]
    *parents, leaf = path.split(".")
    for p in parents[:-1]:
        module = getattr(module, p)
    old = getattr(module, parents[-1])
    if leaf != "weight" or not isinstance(old, Linear) or not supports(info.qtype, info.shape):
        return False
    setattr(module, parents[-1], QLinear.from_gguf(gf.tensor_bytes(name), info.qtype, info.shape, old.bias))
    return True


def weight_format(dtype: str, devices: list[torch.device]) -> tuple[bool, torch.dtype]:
    """`--dtype` for a model whose blocks and output layer live on `devices`: (keep the linear weights of CPU-resident
    layers quantized (qlinear.py), the float dtype of activations and of unquantized weights).

    "q" and "auto" keep every CPU-resident layer quantized, under partial offload (-ngl N < blocks on CUDA) too, where
    dequantized bf16 weights would make the CPU layers slow; the whole model then computes in float32, the CPU
    kernels' dtype, because activations cross between the devices in one dtype. With no layer on the CPU they mean
    bf16 on CUDA."""
    if dtype in ("q", "auto") and any(d.type == "cpu" for d in devices):
        return True, torch.float32
    return False, float_dtype("auto" if dtype == "q" else dtype, devices[-1])


def load_model(
    path: str | Path | GGUFFile, device: str | None = default("device"), n_gpu_layers: int = DEFAULT_GPU_LAYERS,
    dtype: str = default("dtype"),
) -> LoadedModel:
    """Weights per `weight_format`: "auto" keeps CPU-resident layers quantized (3-4x faster than f32 there, llama.cpp
    parity within tests/test_parity.py's tolerance) and is bf16 on CUDA. `path` may be the file already opened."""
    t0 = time.perf_counter()
    gf = path if isinstance(path, GGUFFile) else GGUFFile(path)
    cfg = ModelConfig.from_gguf(gf)
    devices, output_device = layer_devices(cfg.n_layer_main, torch_device(device), n_gpu_layers)
    quantize, torch_dtype = weight_format(dtype, devices + [output_device])
    quantize = quantize and _kernels_for(dtype)
    with torch.device("meta"):
        model = Transformer(cfg)
    model.dtype = torch_dtype
    model.layer_devices, model.output_device = devices, output_device
    embd_device = model.layer_devices[0]

    def fetch(name: str, dev: torch.device, keep_dtype: bool = False) -> torch.Tensor:
        t = load_tensor(gf, name, dev, torch.float32)
        return t if keep_dtype else t.to(torch_dtype)

    for name, info in gf.tensors.items():
        m = _BLOCK_RE.match(name)
        if m:
            layer, suffix = int(m.group(1)), m.group(2)
            if layer >= cfg.n_layer_main:
                continue  # NextN/MTP blocks are loaded by the MTP head
            if suffix not in _BLOCK_NAMES:
                raise SpecCliError(f"{gf.path.name}: unsupported tensor {name} for architecture {cfg.arch}")
            dev = model.layer_devices[layer]
            if quantize and dev.type == "cpu" and _set_quantized(model.layers[layer], _BLOCK_NAMES[suffix], gf, name):
                continue
            is_norm = suffix.endswith("norm.weight")  # norms stay float32 (RMSNorm computes in float32)
            _set_param(model.layers[layer], _BLOCK_NAMES[suffix], fetch(name, dev, keep_dtype=is_norm))
        elif name == "token_embd.weight":
            _load_embedding(model, gf, embd_device, torch_dtype)
        elif name == "output_norm.weight":
            _set_param(model, "norm.weight", fetch(name, model.output_device, keep_dtype=True))
        elif name == "output.weight":
            _set_output(model, gf, name, quantize, fetch)
        else:
            raise SpecCliError(f"{gf.path.name}: unsupported tensor {name} for architecture {cfg.arch}")
    if cfg.tied_output:
        _set_output(model, gf, "token_embd.weight", quantize, fetch)
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise SpecCliError(f"{gf.path.name}: missing tensors for {', '.join(missing[:5])}")
    if quantize:
        fuse_projections(model)
        for m in model.modules():  # packed for the kernels now, not during the first request
            if isinstance(m, QLinear):
                m.desc
    model.eval()
    kept_quantized = any(m.quantized for m in model.modules() if isinstance(m, QLinear))
    weights = "q" if kept_quantized else _DTYPE_NAMES[torch_dtype]
    return LoadedModel(model, cfg, gf, (time.perf_counter() - t0) * 1000, weights)


def _kernels_for(dtype: str) -> bool:
    """Whether quantized weights can be kept: the compiled kernels are there (--dtype q insists on them)."""
    if kernels.available():
        return True
    if dtype == "q":
        raise SpecCliError(f"--dtype q needs spec-cli's compiled kernels: {kernels.why_unavailable()}")
    _warn_once(f"spec-cli: {kernels.why_unavailable()}; computing with float32 weights (slower, and batch "
               "composition can change greedy output)")
    return False


@functools.cache
def _warn_once(message: str) -> None:
    print(message, file=sys.stderr)


def _set_output(model: Transformer, gf: GGUFFile, name: str, quantize: bool, fetch) -> None:
    if quantize and model.output_device.type == "cpu" and _set_quantized(model, "output.weight", gf, name):
        return
    _set_param(model, "output.weight", fetch(name, model.output_device))


def _load_embedding(model: Transformer, gf: GGUFFile, device: torch.device, dtype: torch.dtype) -> None:
    info = gf.tensors["token_embd.weight"]
    embd = model.tok_embd
    embd.dtype = dtype
    n_vocab = info.shape[0]
    raw = gf.tensor_bytes(info.name).view(n_vocab, info.n_bytes // n_vocab)
    embd.qtype = info.qtype
    embd.raw = raw.to(device)  # rows are dequantized on lookup, on this device
