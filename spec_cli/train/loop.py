"""The optimisation loop every draft-head trainer runs: AdamW with a linear warmup and a cosine decay to 10 % of the
peak learning rate, gradient clipping, a progress report per step, a checkpoint every `checkpoint_every` steps and at
the end (the module, the optimizer, the schedule, the step: `--resume` continues from it exactly)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from spec_cli.train.data import Progress, ProgressFn


@dataclass
class TrainResult:
    """What a training run reports (the command prints it, or writes it as JSON)."""

    out_path: Path
    steps: int
    train_tokens: int
    gen_tokens: int
    eval_tokens: int
    seconds: float
    loss_first: float | None  # None when no step ran (a resumed run that was already complete)
    loss_last: float | None
    acc_before: float  # held-out first-position acceptance before this run's steps (the init, or the checkpoint)
    acc_after: float
    mean_len_before: float | None = None  # held-out mean acceptance length, where the trainer estimates it
    mean_len_after: float | None = None
    # held-out first-position acceptance after the steps per kind of text, where the held-out set mixes kinds: the
    # target's answers to held-out requests (of the training requests' templates) and held-out code
    acc_parts: dict[str, float] | None = None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["out_path"] = str(self.out_path)
        return d


BatchLoss = Callable[[int], tuple[torch.Tensor, dict]]  # step -> (loss to minimise, figures for the progress line)


class Loop:
    def __init__(self, module: nn.Module, steps: int, lr: float, checkpoint: Path, checkpoint_every: int,
                 clip: float = 1.0, config: dict | None = None):
        self.module, self.steps, self.clip = module, steps, clip
        self.checkpoint, self.checkpoint_every, self.config = checkpoint, checkpoint_every, config or {}
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=lr, weight_decay=0.0)
        warmup = max(1, min(20, steps // 10))
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: min(1.0, (s + 1) / warmup) * (
            0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s / max(steps, 1), 1)))))
        self.step = 0

    def resume(self) -> int:
        """Load the checkpoint when there is one; -> the step the loop continues from."""
        if self.checkpoint.exists():
            state = torch.load(self.checkpoint)
            self.module.load_state_dict(state["module"])
            self.opt.load_state_dict(state["opt"])
            self.sched.load_state_dict(state["sched"])
            self.step = state["step"]
        return self.step

    def run(self, batch_loss: BatchLoss, progress: ProgressFn | None = None) -> list[float]:
        """Steps from the current one to `steps`; -> the losses of the steps run."""
        losses = []
        for step in range(self.step, self.steps):
            loss, info = batch_loss(step)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.params, self.clip)
            self.opt.step()
            self.sched.step()
            losses.append(loss.item())
            self.step = step + 1
            if progress:
                progress(Progress("train", step + 1, self.steps, {"loss": losses[-1], **info}))
            if self.step % self.checkpoint_every == 0 or self.step == self.steps:
                self.save()
        return losses

    def save(self) -> None:
        self.checkpoint.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"module": self.module.state_dict(), "opt": self.opt.state_dict(),
                    "sched": self.sched.state_dict(), "step": self.step, "config": self.config}, self.checkpoint)


def window_batches(n_windows: int, batch: int, seed: int) -> Callable[[int], torch.Tensor]:
    """step -> the indices of its `batch` windows: one shuffled order of all windows, gone through in turn."""
    order = torch.randperm(n_windows, generator=torch.Generator().manual_seed(seed))
    return lambda step: order[(torch.arange(batch) + step * batch) % n_windows]


Estimate = Callable[[], tuple[float, float]]  # -> held-out (first-position acceptance, mean acceptance length)


def acceptance(first: list[torch.Tensor], lengths: list[torch.Tensor]) -> tuple[float, float]:
    """An estimate from its parts: whether each first draft token was accepted, and how many tokens each whole
    draft had accepted -> (first-position acceptance, mean acceptance length counting the target's own token)."""
    first_t, lengths_t = torch.cat(first).float(), torch.cat(lengths).float()
    return (first_t.mean().item() if first_t.numel() else 0.0,
            1.0 + lengths_t.mean().item() if lengths_t.numel() else 1.0)


def settled_lengths(hits: torch.Tensor, labelled: torch.Tensor) -> torch.Tensor:
    """hits, labelled [..., n] of drafts (whether each draft position equals the target's token, whether the data
    says what that token is) -> the accepted lengths (leading labelled hits) of the drafts the labels settle: every
    position accepted, or the first rejected one labelled (one rejected where nothing says what the target would
    have chosen might have been accepted)."""
    accepted = (hits & labelled).long().cumprod(-1).sum(-1)
    n = labelled.shape[-1]
    rejected_is_labelled = labelled.gather(-1, accepted.clamp_max(n - 1)[..., None])[..., 0]
    return accepted[(accepted == n) | rejected_is_labelled]


def train_and_estimate(loop: Loop, batch_loss: BatchLoss, estimate: Estimate, progress: ProgressFn | None,
                       t0: float, out_path: Path, train_tokens: int, gen_tokens: int,
                       eval_tokens: int) -> TrainResult:
    """A draft-train run of a head with a held-out acceptance estimate: the estimate, the steps, the estimate again
    (reported as the `eval` stage); -> its TrainResult (seconds since t0)."""
    before = estimate()
    losses = loop.run(batch_loss, progress)
    if progress:
        progress(Progress("eval", 0, 1, {}))
    after = estimate()
    if progress:
        progress(Progress("eval", 1, 1, {"acceptance": after[0], "mean_len": after[1]}))
    return TrainResult(out_path, len(losses), train_tokens, gen_tokens, eval_tokens, time.perf_counter() - t0,
                       losses[0] if losses else None, losses[-1] if losses else None, before[0], after[0], before[1],
                       after[1])
