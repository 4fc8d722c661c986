"""`--compile`: the decode/verify step's decoder blocks through `torch.compile` (CPU: inductor; CUDA: CUDA graphs).

What is compiled: the loop over a Transformer's decoder blocks (`Transformer.forward_tapped` with `step=`) as one
graph over the static KV cache, for decode and verify shapes only (at most ROW_BUCKETS[-1] sequences of at most
ROW_BUCKETS[-1] rows; longer prompt chunks, and a sequence's first row alone, run eager). The layers' weights are
graph inputs, so a graph serves every model of the same shapes (a target and a same-size draft share it).

- CPU: symbolic shapes (rows, sequences and the attended key range), nothing padded, so the logits are eager's bits:
  padding rows or keys would change torch's matmul and SDPA sums on the float path.
  - Quantized weights (the default): the blocks are already one C++ call (kernels.cpp `sc_blocks`), registered
    as the torch op `spec_cli::blocks` (fake implementation; it writes the caches in place) so the step compiles
    without graph breaks. The graph is that call: nothing is left to fuse, so it ties eager at best and `auto`
    leaves it eager (docs/performance.md).
  - Float weights (`--dtype f32`): inductor fuses the torch ops of `Block.forward_torch` around torch's matmuls and
    SDPA; RMS norm (the kernels' own, as on the eager path) and GELU-tanh are custom ops, the eager bits.
- CUDA: the same graph (inductor's Triton kernels), shapes padded to the ROW_BUCKETS (groups and rows) and the key
  range to a power of two, rows and key range symbolic (one compile per group bucket); cuda_graphs.StepGraphs
  captures each padded shape's whole step (embedding to logits) as a CUDA graph around it. Ran on H100 and H200
  (docs/cuda.md). Not bit-identical to eager on CUDA (inductor fuses bf16 ops in another order).

Caches: dynamo's compiled frames live in the process; inductor's FX graph cache and AOTAutograd's cache (torch's
defaults) are kept under `TORCHINDUCTOR_CACHE_DIR`, which spec-cli points at `~/.cache/spec-cli/torch-compile`
(`SPEC_CLI_CACHE` moves it) unless the environment already sets it, so a second run skips code generation and the
C++ compiler. A call that takes longer than half a second (a compile) shows a progress line on stderr.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import dataclass

import torch

from spec_cli.errors import UsageError
from spec_cli.model import kernels
from spec_cli.model.transformer import ForwardPlan, Transformer

MODES = ("auto", "on", "off")
ROW_BUCKETS = (1, 2, 4, 8, 16)  # sequences per step and rows per sequence, each padded up to one of these
MIN_KV = 64  # the attended key range is padded to a power of two, at least this (at most the cache)


def check_mode(value: str) -> str:
    if value not in MODES:
        raise UsageError(f"--compile must be one of {', '.join(MODES)}, got {value!r}")
    return value


def bucket(n: int) -> int | None:
    """The row bucket n is padded to, None when n is over the largest (that step runs eager)."""
    for b in ROW_BUCKETS:
        if n <= b:
            return b
    return None


def kv_bucket(n_kv: int, n_ctx_seq: int) -> int:
    return min(n_ctx_seq, max(MIN_KV, 1 << max(n_kv - 1, 0).bit_length()))


def wanted(mode: str, model) -> bool:
    """Whether a context compiles its model's step: `on` always (where the model is a plain Transformer); `auto`
    where it measurably wins and compiles in reasonable time: nowhere so far (README, "Compiled decode": a tie at
    best on the quantized CPU path, 1.1x on f32 for minutes of compiling; on CUDA 6-9x for plain decode, but 30-50 s
    per compile and not bit-identical to eager there: docs/cuda.md)."""
    check_mode(mode)
    if mode == "off" or not isinstance(model, Transformer):
        return False
    return mode == "on"


# --- the C++ block as a torch custom op --------------------------------------------------------------------------

_registered = False
_LIB = torch.library.Library("spec_cli", "FRAGMENT")  # kept for the process: dropping it unregisters the ops


def register_ops() -> None:
    """`torch.ops.spec_cli.blocks`: kernels.blocks_at as an op dynamo can put in a graph (writes the k/v caches in
    place; x is copied first: the op returns its result)."""
    global _registered
    if _registered:
        return

    # through the plain Library API, not torch.library.custom_op: custom_op's Python wrappers cost ~55 us per call
    # on the CPU (when the op was one block: smollm2-135m compiled 0.71x of eager with them)
    _LIB.define("blocks(Tensor stack, Tensor x, Tensor cos, Tensor sin, Tensor cos_swa, Tensor sin_swa, "
                "Tensor row_seq, Tensor row_pos, Tensor row_write, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, "
                "Tensor tap_slots, int n_taps) -> (Tensor, Tensor)")

    def blocks_op(stack, x, cos, sin, cos_swa, sin_swa, row_seq, row_pos, row_write, k_caches, v_caches, tap_slots,
                  n_taps):
        descs, swa = stack.tolist()
        out = torch.empty(x.shape[0], n_taps, x.shape[1])  # the target features (Transformer.forward_tapped)
        x = kernels.blocks_at(descs, swa, x.clone(), [(cos, sin), (cos_swa, sin_swa)], row_seq, row_pos, row_write,
                              k_caches, v_caches, (tap_slots, out) if n_taps else None)
        return x, out

    _LIB.impl("blocks", blocks_op, "CPU")

    @torch.library.register_fake("spec_cli::blocks")
    def _(stack, x, cos, sin, cos_swa, sin_swa, row_seq, row_pos, row_write, k_caches, v_caches, tap_slots, n_taps):
        return torch.empty_like(x), x.new_empty(x.shape[0], n_taps, x.shape[1])

    @torch.library.custom_op("spec_cli::rms_norm", mutates_args=(), device_types="cpu")
    def rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return kernels.rms_norm(x, weight, eps)

    @torch.library.custom_op("spec_cli::gelu_tanh", mutates_args=(), device_types="cpu")
    def gelu_op(x: torch.Tensor) -> torch.Tensor:  # aten's: inductor's own tanh differs in the last bits
        return torch.nn.functional.gelu(x, approximate="tanh")

    @gelu_op.register_fake
    def _(x):
        return torch.empty_like(x)

    @rms_norm_op.register_fake
    def _(x, weight, eps):
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    _registered = True


def _layers(model: Transformer, x, positions, write_rows, write_seq, write_pos, kv_seqs, mask_full, mask_swa,
            ropes, kv, stack, tables, row_seq, row_pos, row_write, taps, tap_slots):
    """Every decoder block of one step (Transformer.forward_tapped's loop), as one graph: on the kernels (`stack`
    given: the `spec_cli::blocks` op) or in torch ops (Block.forward_torch). -> (hidden [G, T, D], the features of
    the layers `taps` [G, T, len(taps), D] or None without taps)."""
    G, T, D = x.shape
    if stack is not None:
        (cos, sin), (cos_swa, sin_swa) = tables
        x, out = torch.ops.spec_cli.blocks(stack, x.reshape(G * T, D), cos, sin, cos_swa, sin_swa, row_seq, row_pos,
                                           row_write, [k for k, _ in kv], [v for _, v in kv], tap_slots, len(taps))
        return x.view(G, T, D), out.view(G, T, len(taps), D) if taps else None
    plan = ForwardPlan(positions, write_rows, write_seq, write_pos, kv_seqs, mask_full.shape[-1], mask_full, mask_swa)
    tapped = {}
    for i, (layer, (k_cache, v_cache)) in enumerate(zip(model.layers, kv)):
        if i in taps:
            tapped[i] = x
        x = layer.forward_torch(x, plan, ropes[int(layer.swa)], k_cache, v_cache)
    tapped[len(model.layers)] = x
    return x, torch.stack([tapped[i] for i in taps], dim=2) if taps else None


# --- the step -----------------------------------------------------------------------------------------------------

def use_cache_dir() -> str:
    """Point inductor's on-disk caches at spec-cli's cache (unless TORCHINDUCTOR_CACHE_DIR is set); returns it."""
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        from spec_cli.model.catalog import cache_dir

        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir() / "torch-compile")
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]


def _configure() -> None:
    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config

    # one graph per (row bucket, layer kind) and per key bucket on CUDA: more than dynamo's default 8 per function
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(dynamo_config, name):
            setattr(dynamo_config, name, 256)
    if hasattr(dynamo_config, "accumulated_recompile_limit"):
        dynamo_config.accumulated_recompile_limit = max(dynamo_config.accumulated_recompile_limit, 4096)
    inductor_config.fx_graph_cache = True


@dataclass
class CompileStats:
    graphs: int = 0  # compiles (dynamo frames) this step caused
    seconds: float = 0.0  # wall time of the calls that compiled
    calls: int = 0  # forwards that ran compiled


class CompiledStep:
    """Runs the decoder blocks of a step compiled (`Transformer.forward_tapped(..., step=)`); Context pads the step's
    rows to ROW_BUCKETS (`fits`, `bucket`) before it calls the model."""

    def __init__(self, name: str, cuda: bool, pad: bool | None = None):
        use_cache_dir()
        _configure()
        register_ops()
        self.name = name
        self._pad = cuda if pad is None else pad  # pad=True on the CPU: the CUDA graphs' shapes (for tests)
        self.stats = CompileStats()
        # CUDA: dims marked dynamic in __call__ (rows, key range), the CUDA graphs captured by cuda_graphs.py
        self._fn = torch.compile(_layers, fullgraph=True, dynamic=None if cuda else True)
        self._call: tuple[float, int, int] | None = None  # (start, G, T) of the block call in flight
        self._watcher: threading.Thread | None = None
        self._shown: tuple[float, int, int] | None = None  # the call the progress line is about
        self._lock = threading.Lock()

    @property
    def pads(self) -> bool:
        """Whether the step's shapes are padded to buckets: for CUDA graphs (one per shape). The CPU graphs take
        symbolic shapes, unpadded: padding rows or keys changes the float path's bits (torch's matmul and SDPA
        sum in other blocks), and would cost the quantized path work for nothing."""
        return self._pad

    @staticmethod
    def fits(n_groups: int, n_rows: int) -> bool:
        return bucket(n_groups) is not None and bucket(n_rows) is not None

    def usable(self, model: Transformer) -> bool:
        """One graph per step needs every block on one device (-ngl splits run eager)."""
        return len(set(model.layer_devices)) == 1

    def __call__(self, model: Transformer, x: torch.Tensor, plan: ForwardPlan, kv,
                 taps: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [G, T, D] after the embedding -> (after the last block, the features of `taps` or None), the caches
        written as eager writes them (Transformer.forward_tapped)."""
        G, T, _ = x.shape
        stack = model.kernel_stack(x, kv)
        ropes = tables = None
        if stack is not None:  # the kernels index whole tables by row position
            tables = model.kernel_ropes(plan.n_kv)
            row_args = (plan.row_seq, plan.row_pos, plan.row_write)
        else:  # torch's ops take the tables of the step's positions
            by_kind = model.ropes(plan.positions, plan.n_kv)
            ropes = [by_kind[False], by_kind[True]]
            row_args = (None, None, None)
        # the key range and rows are symbols from the first compile (else: one recompile on their change); on CUDA
        # too: one compiled graph, captured in a CUDA graph per padded shape (cuda_graphs.py)
        for mask in (plan.mask_full, plan.mask_swa):
            if mask is not None:
                torch._dynamo.maybe_mark_dynamic(mask, 3)
        torch._dynamo.maybe_mark_dynamic(x, 1)
        args = (model, x, plan.positions, plan.write_rows, plan.write_seq, plan.write_pos, plan.kv_seqs,
                plan.mask_full, plan.mask_swa, ropes, kv,
                None if stack is None else stack.address, tables, *row_args, taps,
                model.tap_slots(taps) if stack is not None else None)
        return self._timed(self._fn, args, G, T)

    def _timed(self, fn, args, G: int, T: int):
        from torch._dynamo.utils import counters

        before = counters["stats"]["unique_graphs"]
        t0 = time.perf_counter()
        call = (t0, G, T)
        self._call = call  # the watcher thread shows a progress line while a call lasts over half a second
        if self._watcher is None:
            self._watcher = threading.Thread(target=self._watch, daemon=True, name="spec-cli-compile-progress")
            self._watcher.start()
        self.stats.calls += 1
        try:
            return fn(*args)
        finally:
            with self._lock:
                self._call = None
                if self._shown is call:
                    what = f"\rcompiling {self.name} decode step ({G} x {T} rows):" if sys.stderr.isatty() else ""
                    sys.stderr.write(f"{what} done in {time.perf_counter() - t0:.1f} s\n")
                    sys.stderr.flush()
                self._shown = None
            graphs = counters["stats"]["unique_graphs"] - before
            if graphs:
                self.stats.graphs += graphs
                self.stats.seconds += time.perf_counter() - t0

    def _watch(self) -> None:
        """Polls the call in flight; one that lasts over half a second is compiling: a line on stderr, its seconds
        rewritten in place on a terminal (the call ends the line)."""
        while True:
            time.sleep(0.25)
            with self._lock:
                call = self._call
                if call is None or time.perf_counter() - call[0] < 0.5:
                    continue
                t0, G, T = call
                if self._shown is not call:
                    self._shown = call
                    sys.stderr.write(f"compiling {self.name} decode step ({G} x {T} rows) with torch.compile ...")
                elif sys.stderr.isatty():
                    sys.stderr.write(f"\rcompiling {self.name} decode step ({G} x {T} rows): "
                                     f"{time.perf_counter() - t0:.0f} s")
                sys.stderr.flush()
