"""`spec-cli mtp-train`: distill a NextN (MTP) head for a model that has none and write MODEL + head as one GGUF.

Examples:
  spec-cli mtp-train -m qwen2.5-coder-0.5b -o qwen2.5-coder-0.5b-mtp.gguf
  spec-cli mtp-train -m model.gguf -o out.gguf --steps 600 --seq-len 256 --batch 8 --resume
  spec-cli run -m out.gguf --spec-type mtp -p "def quicksort(xs):" --temp 0
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from spec_cli.cli.options import with_options
from spec_cli.cli.output import print_json, stderr
from spec_cli.errors import UsageError
from spec_cli.options import MTP_TRAIN

if TYPE_CHECKING:
    from spec_cli.model.loader import LoadedModel
    from spec_cli.train.data import Progress as TrainProgress
    from spec_cli.train.mtp import TrainResult


@with_options(MTP_TRAIN)
def mtp_train(opts: dict) -> None:
    """Train an MTP (NextN) draft head on a frozen model (`--spec-type mtp` then drafts with it)."""
    import torch

    from spec_cli.train.mtp import TrainConfig, train

    if opts["gen_tokens"] > opts["data_tokens"]:
        raise UsageError(f"--gen-tokens ({opts['gen_tokens']}) must be at most --data-tokens ({opts['data_tokens']})")
    if opts["threads"]:
        torch.set_num_threads(opts["threads"])
    cfg = TrainConfig(**{f: opts[f] for f in TrainConfig.__dataclass_fields__ if f in opts})
    loaded = load_target(opts["model"], opts["device"])
    with Progress(TextColumn("{task.description:<13}"), BarColumn(bar_width=24), MofNCompleteColumn(),
                  TimeElapsedColumn(), TimeRemainingColumn(), TextColumn("{task.fields[info]}"), console=stderr,
                  disable=not stderr.is_terminal) as bars:
        tasks: dict[str, int] = {}
        lines = LogLines()

        def progress(p: TrainProgress) -> None:
            if p.stage not in tasks:
                tasks[p.stage] = bars.add_task(p.stage, total=p.total, info="")
            info = "  ".join(f"{k} {v:.3f}" for k, v in p.info.items())
            bars.update(tasks[p.stage], completed=p.done, total=p.total, info=info)
            if not stderr.is_terminal:
                lines.report(p, info)

        result = train(loaded, opts["output"], cfg, progress, resume=opts["resume"])
    if opts["json_output"]:
        print_json(result.to_dict())
    else:
        stderr.print(summary(result), soft_wrap=True)


def load_target(model: str | None, device: str) -> LoadedModel:
    """The frozen target. It only provides features, hundreds of rows per forward: bf16 where the hardware multiplies
    it natively (CUDA, AVX512-BF16/AMX CPUs: ~4x float32's speed there), else float32 (quantized weights are slow at
    that size)."""
    from spec_cli.model.loader import cpu_bf16_is_fast, load_model, torch_device
    from spec_cli.runtime.engine import resolve

    stderr.print(f"loading {model or 'the default model'} ...")
    fast_bf16 = torch_device(device).type != "cpu" or cpu_bf16_is_fast()
    return load_model(resolve(model), device, dtype="bf16" if fast_bf16 else "f32")


class LogLines:
    """Progress where stderr is not a terminal (a log file, CI): rich draws its bars only at the end there, and a CPU
    run takes an hour, so one line per tenth of each stage, with the elapsed time and the stage's latest figures."""

    LINES_PER_STAGE = 10

    def __init__(self):
        self.t0 = time.monotonic()
        self.shown: dict[str, int] = {}  # stage -> the last part reported (of LINES_PER_STAGE)

    def report(self, p: TrainProgress, info: str) -> None:
        part = self.LINES_PER_STAGE * p.done // max(p.total, 1)
        if p.stage in self.shown and part <= self.shown[p.stage]:
            return
        self.shown[p.stage] = part
        stderr.print(f"{p.stage} {p.done}/{p.total} ({time.monotonic() - self.t0:.0f} s) {info}".rstrip(),
                     markup=False, highlight=False, soft_wrap=True)


def summary(result: TrainResult) -> str:
    loss = f"loss {result.loss_first:.3f} -> {result.loss_last:.3f}; " if result.steps else ""
    return (f"wrote {result.out_path}: {result.steps} steps in {result.seconds:.0f} s on {result.train_tokens} "
            f"tokens ({result.gen_tokens} in windows of the target's own answers); {loss}held-out first-position "
            f"acceptance {result.acc_before:.1%} -> {result.acc_after:.1%} on {result.eval_tokens} tokens")
