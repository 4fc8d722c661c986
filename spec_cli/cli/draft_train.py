"""`spec-cli draft-train`: train a draft head on a frozen model; `mtp-train` is `draft-train --type mtp`.

  --type eagle3  an EAGLE-3 head in llama.cpp's eagle3 layout, a file of its own: `-md FILE` drafts with it
  --type mtp     a NextN (MTP) head for a model that has none, written as MODEL + head: `--spec-type mtp` drafts

Examples:
  spec-cli draft-train --type eagle3 -m qwen2.5-coder-0.5b -o qwen05-eagle3.gguf
  spec-cli speculative-simple -m qwen2.5-coder-0.5b -md qwen05-eagle3.gguf -p "Write a haiku about rain." --temp 0
  spec-cli draft-train --type mtp -m model.gguf -o out.gguf --steps 600 --resume
"""

from __future__ import annotations

import inspect
import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Optional

import torch
import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from spec_cli.cli.output import print_json, stderr
from spec_cli.errors import UsageError
from spec_cli.model.loader import cpu_bf16_is_fast, load_model, parse_device
from spec_cli.options import default
from spec_cli.runtime.engine import resolve
from spec_cli.train import eagle3 as eagle3_train
from spec_cli.train import mtp as mtp_train_module
from spec_cli.train.data import Progress as TrainProgress
from spec_cli.train.loop import TrainResult

TYPES = {"eagle3": eagle3_train.Eagle3TrainConfig(), "mtp": mtp_train_module.TrainConfig()}  # each type's defaults
SHARED = ("steps", "lr", "seq_len", "batch", "data_tokens", "gen_tokens", "eval_tokens", "checkpoint_every",
          "draft_vocab", "seed")
EAGLE3_ONLY = ("ttt_steps", "layers")


def _defaults(name: str) -> str:
    return ", ".join(f"{kind} {getattr(cfg, name)}" for kind, cfg in TYPES.items())


def draft_train(
    kind: str = typer.Option("eagle3", "--type", help="the head to train: eagle3 | mtp"),
    model: Optional[str] = typer.Option(None, "-m", "--model",
                                        help="GGUF file or models.toml name (the frozen target)"),
    output: Path = typer.Option(..., "-o", "--output", help="GGUF to write (eagle3: the head; mtp: the model + head)"),
    steps: Optional[int] = typer.Option(None, "--steps", help=f"optimizer steps ({_defaults('steps')})"),
    lr: Optional[float] = typer.Option(None, "--lr", help=f"peak learning rate, AdamW, warmup then cosine decay "
                                                          f"({_defaults('lr')})"),
    seq_len: Optional[int] = typer.Option(None, "--seq-len",
                                          help=f"tokens per training window ({_defaults('seq_len')})"),
    batch: Optional[int] = typer.Option(None, "--batch", help=f"windows per step ({_defaults('batch')})"),
    data_tokens: Optional[int] = typer.Option(None, "--data-tokens", help="training tokens the target is run over: "
                                              f"its own answers + standard-library text ({_defaults('data_tokens')})"),
    gen_tokens: Optional[int] = typer.Option(None, "--gen-tokens", help="of which windows of the target's own "
                                             f"answers ({_defaults('gen_tokens')})"),
    eval_tokens: Optional[int] = typer.Option(None, "--eval-tokens", help="held-out tokens for the acceptance "
                                              f"estimate ({_defaults('eval_tokens')})"),
    checkpoint_every: Optional[int] = typer.Option(None, "--checkpoint-every", help="steps between checkpoints "
                                                   "(OUTPUT's name with .ckpt.pt)"),
    draft_vocab: Optional[int] = typer.Option(None, "--draft-vocab", help="tokens the head drafts among, those the "
                                              f"target emits most in the data; 0 = all ({_defaults('draft_vocab')})"),
    ttt_steps: Optional[int] = typer.Option(None, "--ttt-steps", help="eagle3: draft steps unrolled in training "
                                            f"(training-time test; {TYPES['eagle3'].ttt_steps})"),
    layers: Optional[str] = typer.Option(None, "--layers", help="eagle3: the three target layers read, comma list "
                                         "(default: 2, N/2, N-3 of the target's N, as llama.cpp's converter)"),
    resume: bool = typer.Option(False, "--resume", help="continue from OUTPUT's checkpoint and cached features"),
    seed: Optional[int] = typer.Option(None, "-s", "--seed", help="data order and initialisation seed"),
    device: str = typer.Option(default("device"), "-dev", "--device",
                               help="auto (CUDA when present) | cpu | cuda | cuda:N"),
    threads: Optional[int] = typer.Option(None, "-t", "--threads", help="CPU threads (default: torch's)"),
    json_output: bool = typer.Option(False, "--json", help="print the result as JSON on stdout"),
) -> None:
    """Train a draft head on a frozen model: an EAGLE-3 head (-md FILE drafts with it) or an MTP head."""
    values = locals()
    cfg = _config(kind, {k: values[k] for k in SHARED + EAGLE3_ONLY if values[k] is not None})
    if threads:
        torch.set_num_threads(threads)
    stderr.print(f"loading {model or 'the default model'} ...")
    fast_bf16 = parse_device(device).type != "cpu" or cpu_bf16_is_fast()
    # MTP: the target provides features, hundreds of rows per forward: bf16 where the hardware multiplies it natively
    # (CUDA, AVX512-BF16/AMX CPUs: ~4x float32's speed there), else float32. EAGLE-3: the target mostly generates
    # its answers, a few dozen rows per decode, where its quantized weights run 2-5x faster than bf16 on the CPU
    # (and give the features and choices of the target as it runs); bf16 on CUDA
    dtype = "auto" if kind == "eagle3" else "bf16" if fast_bf16 else "f32"
    loaded = load_model(resolve(model), device, dtype=dtype)
    with progress_bars() as report:
        if kind == "eagle3":
            result = eagle3_train.train(loaded, output, cfg, report, resume=resume, bf16=fast_bf16)
        else:
            result = mtp_train_module.train(loaded, output, cfg, report, resume=resume)
    if json_output:
        print_json(result.to_dict())
    else:
        stderr.print(summary(result), soft_wrap=True)


def _config(kind: str, given: dict):
    """The type's training settings with the given flags, checked."""
    if kind not in TYPES:
        raise UsageError(f"--type must be one of {', '.join(TYPES)}, got {kind!r}")
    if kind != "eagle3":
        for name in EAGLE3_ONLY:
            if name in given:
                raise UsageError(f"--{name.replace('_', '-')} applies to --type eagle3 only")
    if "layers" in given:
        try:
            given["layers"] = tuple(int(v) for v in given["layers"].split(","))
        except ValueError:
            raise UsageError(f"--layers must be a comma list of layer numbers, got {given['layers']!r}") from None
    cfg = replace(TYPES[kind], **given)
    for name in ("steps", "seq_len", "batch", "data_tokens", "eval_tokens", "checkpoint_every") + (
            ("ttt_steps",) if kind == "eagle3" else ()):
        if getattr(cfg, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1")
    if cfg.draft_vocab < 0:
        raise UsageError("--draft-vocab must be >= 0")
    if cfg.lr <= 0 or cfg.gen_tokens < 0 or cfg.gen_tokens > cfg.data_tokens:
        raise UsageError("--lr must be positive and 0 <= --gen-tokens <= --data-tokens")
    return cfg


def mtp_train(**kwargs) -> None:
    """Train an MTP (NextN) draft head on a frozen model (`--spec-type mtp` then drafts with it): draft-train --type
    mtp."""
    draft_train(kind="mtp", **dict.fromkeys(EAGLE3_ONLY), **kwargs)


# mtp-train's flags: draft-train's but --type and the eagle3 ones
_SIGNATURE = inspect.signature(draft_train, eval_str=True)  # annotations as types: typer reads them
mtp_train.__signature__ = _SIGNATURE.replace(parameters=[
    p for p in _SIGNATURE.parameters.values() if p.name not in ("kind",) + EAGLE3_ONLY])


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
    length = (f", mean acceptance length {result.mean_len_before:.2f} -> {result.mean_len_after:.2f}"
              if result.mean_len_after is not None else "")
    return (f"wrote {result.out_path}: {result.steps} steps in {result.seconds:.0f} s on {result.train_tokens} "
            f"tokens ({result.gen_tokens} in windows of the target's own answers); {loss}held-out first-position "
            f"acceptance {result.acc_before:.1%} -> {result.acc_after:.1%}{length} on {result.eval_tokens} tokens")
