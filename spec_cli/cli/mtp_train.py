"""`spec-cli mtp-train`: distill a NextN (MTP) head for a model that has none and write MODEL + head as one GGUF.

Examples:
  spec-cli mtp-train -m qwen2.5-coder-0.5b -o qwen2.5-coder-0.5b-mtp.gguf
  spec-cli mtp-train -m model.gguf -o out.gguf --steps 600 --seq-len 256 --batch 8 --resume
  spec-cli run -m out.gguf --spec-type mtp -p "def quicksort(xs):" --temp 0
"""

from __future__ import annotations

import time
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
from spec_cli.train.data import Progress as TrainProgress
from spec_cli.train.mtp import TrainConfig, TrainResult, train

_DEFAULTS = TrainConfig()


def mtp_train(
    model: Optional[str] = typer.Option(None, "-m", "--model", help="GGUF file or models.toml name (the frozen target)"),
    output: Path = typer.Option(..., "-o", "--output", help="GGUF to write: the model plus the trained NextN head"),
    steps: int = typer.Option(_DEFAULTS.steps, "--steps", help="optimizer steps"),
    lr: float = typer.Option(_DEFAULTS.lr, "--lr", help="peak learning rate (AdamW, warmup then cosine decay)"),
    seq_len: int = typer.Option(_DEFAULTS.seq_len, "--seq-len", help="tokens per training window"),
    batch: int = typer.Option(_DEFAULTS.batch, "--batch", help="windows per step"),
    data_tokens: int = typer.Option(_DEFAULTS.data_tokens, "--data-tokens",
                                    help="training tokens the target is run over (standard-library text + generations)"),
    gen_tokens: int = typer.Option(_DEFAULTS.gen_tokens, "--gen-tokens",
                                   help="of which windows of the target's own chat answers (request half, greedy answer half)"),
    eval_tokens: int = typer.Option(_DEFAULTS.eval_tokens, "--eval-tokens",
                                    help="held-out tokens for the acceptance estimate"),
    checkpoint_every: int = typer.Option(_DEFAULTS.checkpoint_every, "--checkpoint-every",
                                         help="steps between checkpoints (OUTPUT's name with .ckpt.pt)"),
    draft_vocab: int = typer.Option(_DEFAULTS.draft_vocab, "--draft-vocab",
                                    help="tokens the head drafts among, the training data's most frequent (0 = all)"),
    resume: bool = typer.Option(False, "--resume", help="continue from OUTPUT's checkpoint and cached features"),
    seed: int = typer.Option(_DEFAULTS.seed, "-s", "--seed", help="data order and initialisation seed"),
    device: str = typer.Option(default("device"), "-dev", "--device",
                               help="auto (CUDA when present) | cpu | cuda | cuda:N"),
    threads: Optional[int] = typer.Option(None, "-t", "--threads", help="CPU threads (default: torch's)"),
    json_output: bool = typer.Option(False, "--json", help="print the result as JSON on stdout"),
) -> None:
    """Train an MTP (NextN) draft head on a frozen model (`--spec-type mtp` then drafts with it)."""
    for name, value in (("--steps", steps), ("--seq-len", seq_len), ("--batch", batch), ("--data-tokens", data_tokens),
                        ("--eval-tokens", eval_tokens), ("--checkpoint-every", checkpoint_every)):
        if value < 1:
            raise UsageError(f"{name} must be at least 1")
    if draft_vocab < 0:
        raise UsageError("--draft-vocab must be >= 0")
    if lr <= 0 or gen_tokens < 0 or gen_tokens > data_tokens:
        raise UsageError("--lr must be positive and 0 <= --gen-tokens <= --data-tokens")
    if threads:
        torch.set_num_threads(threads)
    cfg = TrainConfig(steps=steps, lr=lr, seq_len=seq_len, batch=batch, data_tokens=data_tokens, gen_tokens=gen_tokens,
                      eval_tokens=eval_tokens, checkpoint_every=checkpoint_every, seed=seed,
                      draft_vocab=draft_vocab)
    stderr.print(f"loading {model or 'the default model'} ...")
    # The target only provides features, hundreds of rows per forward: bf16 where the hardware multiplies it natively
    # (CUDA, AVX512-BF16/AMX CPUs: ~4x float32's speed there), else float32 (quantized weights are slow at that size)
    fast_bf16 = parse_device(device).type != "cpu" or cpu_bf16_is_fast()
    loaded = load_model(resolve(model), device, dtype="bf16" if fast_bf16 else "f32")
    with Progress(TextColumn("{task.description:<13}"), BarColumn(bar_width=24), MofNCompleteColumn(), TimeElapsedColumn(),
                  TimeRemainingColumn(), TextColumn("{task.fields[info]}"), console=stderr,
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

        result = train(loaded, output, cfg, progress, resume=resume)
    if json_output:
        print_json(result.to_dict())
    else:
        stderr.print(summary(result), soft_wrap=True)


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
