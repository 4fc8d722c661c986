"""`--compile`: the decode/verify step's decoder blocks through `torch.compile` (CPU: inductor; CUDA: CUDA graphs).

What is compiled: the loop over a Transformer's decoder blocks (`Transformer.forward_tapped` with `step=`) as one
graph over the static KV cache, for decode and verify shapes only (at most ROW_BUCKETS[-1] sequences of at most
ROW_BUCKETS[-1] rows; longer prompt chunks, and a sequence's first row alone, run eager). The layers' weights are
graph inputs, so a graph serves every model of the same shapes (a target and a same-size draft share it).

- CPU, float weights (`--dtype f32`): symbolic shapes (rows, sequences and the attended key range), nothing padded,
  so the logits are eager's bits: padding rows or keys would change torch's matmul and SDPA sums. Inductor fuses the
  torch ops of `Block.forward_torch` around torch's matmuls and SDPA; RMS norm (the kernels' own, as on the eager
  path) and GELU-tanh are custom ops, the eager bits.
- CPU kernels (`--dtype q`, the default where they are built): not compiled. A step's blocks are one C++ call there
  (kernels.cpp `sc_blocks`); a graph around that call has nothing to fuse and only adds dynamo's guard check and
  torch's dispatcher to every step (slower than eager before any compile time: `scripts/measure_engine.py --dtypes
  q --compile off,on` compares them), so `--compile on` says so in a line on stderr and runs eager (`wanted`).
- CUDA: the same graph (inductor's Triton kernels), shapes padded to the ROW_BUCKETS (groups and rows) and the key
  range to a power of two, rows and key range symbolic (one compile per group bucket); cuda_graphs.StepGraphs
  captures each padded shape's whole step (embedding to logits) as a CUDA graph around it. Ran on H100 and H200
  (docs/cuda.md). Not bit-identical to eager on CUDA (inductor fuses bf16 ops in another order).

Caches: dynamo's compiled frames live in the process; inductor's FX graph cache and AOTAutograd's cache (torch's
defaults) are kept under `TORCHINDUCTOR_CACHE_DIR`, which spec-cli points at `~/.cache/spec-cli/torch-compile`
(`SPEC_CLI_CACHE` moves it) unless the environment already sets it, so a second run skips code generation and the
C++ compiler. Every compile shows a line on stderr (`compiling NAME decode step (G x T rows) ... done in S s`; a
progress line while it lasts over half a second); its seconds (`compile_seconds`) are left out of the prompt and
generation timings (runtime/generate.py) and reported apart (bench's `compile_s`).
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import time
from dataclasses import dataclass

import torch

from spec_cli.model import kernels
from spec_cli.model.transformer import ForwardPlan, Transformer

ROW_BUCKETS = (1, 2, 4, 8, 16)  # sequences per step and rows per sequence, each padded up to one of these
MIN_KV = 64  # the attended key range is padded to a power of two, at least this (at most the cache)


def bucket(n: int) -> int | None:
    """The row bucket n is padded to, None when n is over the largest (that step runs eager)."""
    for b in ROW_BUCKETS:
        if n <= b:
            return b
    return None


def kv_bucket(n_kv: int, n_ctx_seq: int) -> int:
    return min(n_ctx_seq, max(MIN_KV, 1 << max(n_kv - 1, 0).bit_length()))


def wanted(mode: str, model, name: str) -> bool:
    """Whether a context compiles its model's step: `on` where the model is a plain Transformer whose blocks are not
    one kernel call (the CPU kernels' path, --dtype q: a line on stderr says why not); `auto` where it measurably wins
    and compiles in reasonable time: nowhere so far (docs/commands.md, "Compiled decode": 1.1x on f32 for minutes of
    compiling; on CUDA 6-9x for plain decode, but 30-50 s per compile and not bit-identical to eager there:
    docs/cuda.md)."""
    if mode != "on" or not isinstance(model, Transformer):
        return False
    if model.dtype == torch.float32 and model.block_stack() is not None:
        _note_eager(name)
        return False
    return True


@functools.cache  # once per model and process (a draft model of its own gets its own line)
def _note_eager(name: str) -> None:
    print(f"spec-cli: --compile on: {name}'s decoder blocks run as one C++ call on the CPU kernels (--dtype q), "
          "which compiling can only slow down; running it eager (--dtype f32 compiles)", file=sys.stderr)


def compile_seconds() -> float:
    """Seconds this process has spent compiling frames with torch.compile (dynamo's tracing, AOTAutograd, inductor,
    the C++ compiler); 0 while nothing imported dynamo. A span's run time is its wall time less this one's growth."""
    if "torch._dynamo" not in sys.modules:  # an eager process: importing dynamo here would cost seconds
        return 0.0
    from torch._dynamo.utils import calculate_time_spent

    return calculate_time_spent().get("entire_frame_compile", 0.0)


def clock() -> tuple[float, float]:
    """(wall seconds, compile_seconds()): two of them bound a span for `run_seconds`."""
    return time.perf_counter(), compile_seconds()


def run_seconds(start: tuple[float, float], end: tuple[float, float]) -> float:
    """The wall time between two `clock()`s less the compiling inside it: a step's first call of a new shape compiles
    it; that time is reported apart (the compile line, bench's compile_s), never as prompt or generation speed."""
    return (end[0] - start[0]) - (end[1] - start[1])


# --- the eager ops in a graph -------------------------------------------------------------------------------------

_registered = False


def register_ops() -> None:
    """`torch.ops.spec_cli.rms_norm` (the kernels' norm) and `torch.ops.spec_cli.gelu_tanh` (aten's GELU): the float
    path's eager bits inside a graph (transformer.RMSNorm and gelu call them while compiling)."""
    global _registered
    if _registered:
        return

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
            ropes, kv, taps):
    """Every decoder block of one step (Transformer.forward_tapped's loop) in torch ops (Block.forward_torch), as
    one graph. -> (hidden [G, T, D], the features of the layers `taps` [G, T, len(taps), D] or None without taps)."""
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
    import torch.fx.experimental._config as shapes_config

    # one graph per (row bucket, layer kind) and per key bucket on CUDA: more than dynamo's default 8 per function
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(dynamo_config, name):
            setattr(dynamo_config, name, 256)
    if hasattr(dynamo_config, "accumulated_recompile_limit"):
        dynamo_config.accumulated_recompile_limit = max(dynamo_config.accumulated_recompile_limit, 4096)
    inductor_config.fx_graph_cache = True
    # the blocks' float attributes (norm eps, attention scale) as constants: symbolic floats (dynamic=True's default)
    # made every compile trace the graph twice (tensorify_python_scalars restarts the analysis and specializes them)
    dynamo_config.specialize_float = True
    # the tapped layers (a tuple of ints) as constants: dynamic=True made them symbols, which cannot pick tensors
    dynamo_config.specialize_int = True
    # rows and key range as two symbols even where they are equal: duck sizing gave them one on a prompt's first
    # chunk (as many keys as rows), and the first step with fewer rows than keys (a verify) compiled again
    shapes_config.use_duck_shape = False


@dataclass
class CompileStats:
    graphs: int = 0  # compiles (dynamo frames) this step caused
    seconds: float = 0.0  # compile time inside this step's calls (compile_seconds: what the timings leave out)
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
        sum in other blocks)."""
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
        by_kind = model.ropes(plan.positions, plan.n_kv)  # the tables of the step's positions
        # the key range and rows are symbols from the first compile (else: one recompile on their change); on CUDA
        # too: one compiled graph, captured in a CUDA graph per padded shape (cuda_graphs.py)
        for mask in (plan.mask_full, plan.mask_swa):
            if mask is not None:
                torch._dynamo.maybe_mark_dynamic(mask, 3)
        torch._dynamo.maybe_mark_dynamic(x, 1)
        args = (model, x, plan.positions, plan.write_rows, plan.write_seq, plan.write_pos, plan.kv_seqs,
                plan.mask_full, plan.mask_swa, [by_kind[False], by_kind[True]], kv, taps)
        return self._timed(self._fn, args, G, T)

    def _timed(self, fn, args, G: int, T: int):
        from torch._dynamo.utils import counters

        before, compiling_before = counters["stats"]["unique_graphs"], compile_seconds()
        call = (time.perf_counter(), G, T)
        self._call = call  # the watcher thread shows a progress line while a call compiles for over half a second
        if self._watcher is None:
            self._watcher = threading.Thread(target=self._watch, daemon=True, name="spec-cli-compile-progress")
            self._watcher.start()
        self.stats.calls += 1
        try:
            return fn(*args)
        finally:
            graphs = counters["stats"]["unique_graphs"] - before
            seconds = compile_seconds() - compiling_before
            with self._lock:
                self._call = None
                if self._shown is call or graphs:  # every compile ends its line, a short one (cached) too
                    self._end_line(call, seconds)
                self._shown = None
            self.stats.graphs += graphs
            self.stats.seconds += seconds

    def _end_line(self, call: tuple[float, int, int], seconds: float) -> None:
        if self._shown is not call:
            sys.stderr.write(f"{self._what(call)} with torch.compile ...")
        elif sys.stderr.isatty():
            sys.stderr.write(f"\r{self._what(call)}:")
        sys.stderr.write(f" done in {seconds:.1f} s\n")
        sys.stderr.flush()

    def _watch(self) -> None:
        """Polls the call in flight; one that has compiled for over half a second gets a line on stderr, its seconds
        rewritten in place on a terminal (the call ends the line). A slow step that compiles nothing gets none."""
        while True:
            time.sleep(0.25)
            with self._lock:
                call = self._call
                if call is None or time.perf_counter() - call[0] < 0.5:
                    continue
                if self._shown is not call and not torch.compiler.is_compiling():  # dynamo's flag, process-wide
                    continue
                if self._shown is not call:
                    self._shown = call
                    sys.stderr.write(f"{self._what(call)} with torch.compile ...")
                elif sys.stderr.isatty():
                    sys.stderr.write(f"\r{self._what(call)}: {time.perf_counter() - call[0]:.0f} s")
                sys.stderr.flush()

    def _what(self, call: tuple[float, int, int]) -> str:
        return f"compiling {self.name} decode step ({call[1]} x {call[2]} rows)"
