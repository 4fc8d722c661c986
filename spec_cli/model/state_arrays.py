"""A state as named numpy arrays, what a slot file holds (runtime/slot_file.py): tensors to arrays and back, and the
checked reads a restore makes, so that a missing, mistyped or misshapen entry is a StateError naming it, never a crash.

Only plain numeric arrays: a slot file may come from anywhere, so it is read without pickle (numpy's .npz, no objects).
bfloat16, which numpy lacks, travels as its raw 16-bit patterns (int16); the tensor it is restored into says what they
are.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np
import torch

from spec_cli.errors import StateError

State = dict[str, np.ndarray]


def array_of(t: torch.Tensor) -> np.ndarray:
    """A tensor's values as a host array (a view where the tensor is already on the host)."""
    t = t.detach().cpu()
    return t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy()


def ints(values: Iterable[int]) -> np.ndarray:
    return np.asarray(list(values), dtype=np.int64)


def entry(state: Mapping[str, np.ndarray], key: str, kind: str | None = "i", ndim: int = 1) -> np.ndarray:
    """state[key], which must be an array of `ndim` dimensions and numpy kind `kind` ('i' integers, 'f' floats;
    None: a tensor's values, checked by `fits`)."""
    a = state.get(key)
    if a is None:
        raise StateError(f"'{key}' is missing")
    if (kind is not None and a.dtype.kind != kind) or a.ndim != ndim:
        wanted = {"i": "integer ", "f": "float "}.get(kind, "")
        raise StateError(f"'{key}' is a {a.ndim}-d {a.dtype} array, not a {ndim}-d {wanted}array")
    return a


def scalar(state: Mapping[str, np.ndarray], key: str, low: int = 0, high: int | None = None) -> int:
    """An integer entry within [low, high]."""
    value = int(entry(state, key, "i", 0))
    if value < low or (high is not None and value > high):
        raise StateError(f"'{key}' is {value}, outside [{low}, {high if high is not None else 'inf'}]")
    return value


def counters(state: Mapping[str, np.ndarray], key: str, n: int) -> list[int]:
    """An entry of n non-negative integers."""
    a = entry(state, key)
    if a.shape != (n,) or (n and a.min() < 0):
        raise StateError(f"'{key}' is not {n} non-negative integers")
    return a.tolist()


def token_ids(state: Mapping[str, np.ndarray], key: str, n_vocab: int) -> np.ndarray:
    """A 1-d entry of token ids, every one within the vocabulary."""
    a = entry(state, key)
    if a.size and (a.min() < 0 or a.max() >= n_vocab):
        raise StateError(f"'{key}' holds token ids outside [0, {n_vocab})")
    return a


def fits(dst: torch.Tensor, a: np.ndarray, what: str) -> None:
    """Whether `a` can be copied into dst: its shape, and the numpy dtype of dst's values (StateError otherwise)."""
    expected = torch.empty(0, dtype=torch.int16 if dst.dtype == torch.bfloat16 else dst.dtype).numpy().dtype
    if a.shape != tuple(dst.shape) or a.dtype != expected:
        raise StateError(f"'{what}' is a {a.dtype} array of shape {list(a.shape)}; this server holds a "
                         f"{str(dst.dtype).removeprefix('torch.')} tensor of shape {list(dst.shape)} there")


def copy_into(dst: torch.Tensor, a: np.ndarray) -> None:
    """dst[...] = a, checked by `fits` before."""
    src = torch.from_numpy(np.ascontiguousarray(a))
    dst.copy_(src.view(torch.bfloat16) if dst.dtype == torch.bfloat16 else src)


def within(state: Mapping[str, np.ndarray], prefix: str) -> State:
    """The entries under `prefix` ('name/'), without it."""
    return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}


def prefixed(prefix: str, state: Mapping[str, np.ndarray]) -> State:
    return {prefix + k: v for k, v in state.items()}
