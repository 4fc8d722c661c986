"""`spec-cli draft-train`: train a draft head on a frozen model; `mtp-train` is `draft-train --type mtp`.

  --type eagle3  an EAGLE-3 head in llama.cpp's eagle3 layout, a file of its own: `-md FILE` drafts with it
  --type dflash  a DFlash block drafter in llama.cpp's dflash layout, a file of its own: `-md FILE` drafts with it
  --type mtp     a NextN (MTP) head for a model that has none, written as MODEL + head: `--spec-type mtp` drafts

Examples:
  spec-cli draft-train --type eagle3 -m qwen2.5-coder-0.5b -o qwen05-eagle3.gguf
  spec-cli speculative-simple -m qwen2.5-coder-0.5b -md qwen05-eagle3.gguf -p "Write a haiku about rain." --temp 0
  spec-cli draft-train --type dflash -m qwen2.5-coder-1.5b -o qwen15-dflash.gguf
  spec-cli draft-train --type mtp -m model.gguf -o out.gguf --steps 600 --resume
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import TYPE_CHECKING

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from spec_cli.cli.options import with_options
from spec_cli.cli.output import print_json, stderr
from spec_cli.errors import UsageError
from spec_cli.options import DFLASH_TRAIN, DRAFT_TRAIN, EAGLE3_TRAIN, MTP_TRAIN

if TYPE_CHECKING:
    from spec_cli.train.data import Progress as TrainProgress
    from spec_cli.train.loop import TrainResult


@with_options(DRAFT_TRAIN, EAGLE3_TRAIN, DFLASH_TRAIN)
def draft_train(opts: dict) -> None:
    """Train a draft head on a frozen model: an EAGLE-3 head or a DFlash drafter (-md FILE drafts with either), or an
    MTP head."""
    train_head(opts["kind"], opts)


@with_options(MTP_TRAIN)
def mtp_train(opts: dict) -> None:
    """Train an MTP (NextN) draft head on a frozen model (`--spec-type mtp` then drafts with it): draft-train --type
    mtp."""
    train_head("mtp", opts)


def train_head(kind: str, opts: dict) -> None:
    import torch

    from spec_cli.model.loader import cpu_bf16_is_fast, load_model, torch_device
    from spec_cli.runtime.engine import resolve
    from spec_cli.train import dflash, eagle3, mtp

    cfg = _config(kind, opts)
    if opts["threads"]:
        torch.set_num_threads(opts["threads"])
    stderr.print(f"loading {opts['model'] or 'the default model'} ...")
    fast_bf16 = torch_device(opts["device"]).type != "cpu" or cpu_bf16_is_fast()
    # MTP: the target provides features, hundreds of rows per forward: bf16 where the hardware multiplies it natively
    # (CUDA, AVX512-BF16/AMX CPUs: ~4x float32's speed there), else float32. EAGLE-3 and DFlash: the target mostly
    # generates its answers, a few dozen rows per decode, where its quantized weights run 2-5x faster than bf16 on
    # the CPU (and give the features and choices of the target as it runs); bf16 on CUDA
    dtype = "bf16" if kind == "mtp" and fast_bf16 else "f32" if kind == "mtp" else "auto"
    loaded = load_model(resolve(opts["model"]), opts["device"], dtype=dtype)
    trainer = {"eagle3": eagle3.train, "dflash": dflash.train}.get(kind)
    with progress_bars() as report:
        if trainer is not None:
            result = trainer(loaded, opts["output"], cfg, report, resume=opts["resume"], bf16=fast_bf16)
        else:
            result = mtp.train(loaded, opts["output"], cfg, report, resume=opts["resume"])
    if opts["json_output"]:
        print_json(result.to_dict())
    else:
        stderr.print(summary(result), soft_wrap=True)


def _config(kind: str, opts: dict):
    """The type's training settings: its defaults, overridden by the flags given (a flag of another type's is a
    usage error)."""
    from spec_cli.train.dflash import DFlashTrainConfig
    from spec_cli.train.eagle3 import Eagle3TrainConfig
    from spec_cli.train.mtp import TrainConfig

    configs = {"eagle3": Eagle3TrainConfig, "dflash": DFlashTrainConfig, "mtp": TrainConfig}
    cls = configs[kind]
    for o in (*DRAFT_TRAIN[1], *EAGLE3_TRAIN[1], *DFLASH_TRAIN[1]):
        if opts.get(o.name) is not None and o.name not in cls.__dataclass_fields__ and o.name != "kind":
            owners = [k for k, c in configs.items() if o.name in c.__dataclass_fields__]
            if owners:
                raise UsageError(f"{o.flags[0]} applies to --type {' and '.join(owners)} only")
    cfg = cls(**{f: opts[f] for f in cls.__dataclass_fields__ if opts.get(f) is not None})
    if cfg.gen_tokens > cfg.data_tokens:
        raise UsageError(f"--gen-tokens ({cfg.gen_tokens}) must be at most --data-tokens ({cfg.data_tokens})")
    return cfg


@contextmanager
def progress_bars():
    """The progress callback of a run: rich bars on a terminal, LogLines elsewhere."""
    with Progress(TextColumn("{task.description:<13}"), BarColumn(bar_width=24), MofNCompleteColumn(),
                  TimeElapsedColumn(), TimeRemainingColumn(), TextColumn("{task.fields[info]}"), console=stderr,
                  disable=not stderr.is_terminal) as shown:
        tasks: dict[str, int] = {}
        lines = LogLines()

        def report(p: TrainProgress) -> None:
            if p.stage not in tasks:
                tasks[p.stage] = shown.add_task(p.stage, total=p.total, info="")
            info = "  ".join(f"{k} {v:.3f}" for k, v in p.info.items())
            shown.update(tasks[p.stage], completed=p.done, total=p.total, info=info)
            if not stderr.is_terminal:
                lines.report(p, info)

        yield report


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
    parts = (" (" + ", ".join(f"{part} {acc:.1%}" for part, acc in result.acc_parts.items()) + ")"
             if result.acc_parts else "")
    length = (f", mean acceptance length {result.mean_len_before:.2f} -> {result.mean_len_after:.2f}"
              if result.mean_len_after is not None else "")
    return (f"wrote {result.out_path}: {result.steps} steps in {result.seconds:.0f} s on {result.train_tokens} "
            f"tokens ({result.gen_tokens} in windows of the target's own answers); {loss}held-out first-position "
            f"acceptance {result.acc_before:.1%} -> {result.acc_after:.1%}{parts}{length} on {result.eval_tokens} "
            "tokens")
