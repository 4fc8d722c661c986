"""How `--dtype` holds the weights for a placement (loader.weight_format), CUDA placements included: the decision needs
no GPU. Partial offload (-ngl N < blocks on CUDA) used to give the CPU blocks dequantized bf16 weights."""

from __future__ import annotations

import pytest
import torch

from spec_cli.errors import UsageError
from spec_cli.model.loader import layer_devices, weight_format
from spec_cli.options import OPTIONS

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def placement(n_gpu_layers: int, device: torch.device = CUDA, n_layer: int = 4) -> list[torch.device]:
    devices, output = layer_devices(n_layer, device, n_gpu_layers)
    return devices + [output]


@pytest.mark.parametrize("dtype, devices, expected", [
    ("auto", placement(-1), (False, torch.bfloat16)),  # all on CUDA: bf16
    ("auto", placement(2), (True, torch.float32)),  # partial offload: the CPU blocks stay quantized
    ("auto", placement(4), (True, torch.float32)),  # every block on CUDA, the output layer on the CPU
    ("auto", placement(-1, CPU), (True, torch.float32)),
    ("q", placement(2), (True, torch.float32)),
    ("q", placement(-1), (False, torch.bfloat16)),  # nothing on the CPU to keep quantized
    ("bf16", placement(2), (False, torch.bfloat16)),  # an explicit float dtype is honoured everywhere
    ("f32", placement(-1, CPU), (False, torch.float32)),
    ("f16", placement(-1), (False, torch.float16)),
])
def test_cpu_resident_layers_stay_quantized(dtype, devices, expected):
    assert weight_format(dtype, devices) == expected


def test_unknown_dtype_is_a_usage_error():
    with pytest.raises(UsageError, match="--dtype"):
        OPTIONS["dtype"].value("int3")
    assert OPTIONS["dtype"].value("BFloat16") == "bf16"  # llama.cpp's long names, in any case
