"""Distilling a NextN (MTP) head for a model that has none: `spec-cli mtp-train`.

The target is frozen; the head learns to produce, at row p from (token_p, h_{p-1}), what the target produces at p:
  - a KL term between the target's and the head's next-token distributions (softmax over a candidate set: the
    target's top-K tokens at every position of the batch; the full vocabulary is 150k rows of matmul per token),
  - a cosine term pulling the head's pre-norm output towards the target's h_p, because that output is fed back as
    the hidden input of the next draft position (so deeper draft positions see inputs like the ones trained on).
Init: the block is a copy of the target's last block, shared_head_norm a copy of output_norm, and eh_proj the
ridge-regression map from [enorm(embedding_p); hnorm(h_{p-1})] to the input of the target's last block at p -- so
from step 0 the head is "the target's last block applied to a linear guess of its input".
Embeddings and the output matrix stay the target's (frozen, shared, not written).

Data (mtp_data.py): standard-library text and the target's own greedy continuations of standard-library snippets;
the acceptance estimate (first-position top-1 agreement with the target's argmax) is measured on held-out files.
The target runs once over all the data (mtp_features.py: h, the last block's input, top-K ids), cached next to
the checkpoint; training steps then only run the head.
"""

from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from spec_cli.errors import SpecCliError
from spec_cli.model.config import ModelConfig
from spec_cli.model.head_file import out_type
from spec_cli.model.loader import LoadedModel
from spec_cli.model.mtp_head import MTPHead, write_gguf_with_head
from spec_cli.options import MTP_TRAIN_OPTIONS
from spec_cli.text.tokenizer import Tokenizer
from spec_cli.train.data import (
    GEN_REQUESTS,
    Progress,
    ProgressFn,
    cached,
    generation_prompts,
    greedy_continuations,
    is_held_out,
    sources_fingerprint,
    stdlib_documents,
    token_windows,
)
from spec_cli.train.loop import Loop, TrainResult, window_batches
from spec_cli.train.mtp_features import Features, head_forward, shifted, target_features


def _default(name: str):
    """A training setting's default: its mtp-train flag's (spec_cli/options.py MTP_TRAIN)."""
    return MTP_TRAIN_OPTIONS[name].default


@dataclass
class TrainConfig:
    steps: int = _default("steps")
    lr: float = _default("lr")
    seq_len: int = _default("seq_len")
    batch: int = _default("batch")
    data_tokens: int = _default("data_tokens")  # training tokens run through the target (text + generations)
    gen_tokens: int = _default("gen_tokens")  # of which: windows of the target's own chat answers (they matter most)
    eval_tokens: int = _default("eval_tokens")  # held-out tokens for the acceptance estimate
    cos_weight: float = 1.0
    ridge: float = 1e-2  # relative L2 regularisation of the eh_proj least-squares init
    checkpoint_every: int = _default("checkpoint_every")
    draft_vocab: int = _default("draft_vocab")  # tokens the head drafts among (most frequent in the training data)
    outtype: str = _default("outtype")  # the written head's matrices' type (options.HEAD_OUT_TYPES)
    seed: int = _default("seed")


# --- the head -----------------------------------------------------------------------------------------------


class _WithHead:
    """ModelConfig.from_gguf's view of the source file with one NextN block added (same layer rules)."""

    def __init__(self, loaded: LoadedModel):
        gf, arch = loaded.gguf, loaded.config.arch
        self.path, self.tensors, self.architecture = gf.path, gf.tensors, gf.architecture
        self.metadata = {**gf.metadata, f"{arch}.block_count": loaded.config.n_layer + 1,
                         f"{arch}.nextn_predict_layers": 1}

    def get(self, key: str, default=None):
        return self.metadata.get(key, default)


def init_head(loaded: LoadedModel, feats: Features, ridge: float, device: torch.device) -> MTPHead:
    """A trainable float32 head: last block copied, eh_proj fitted by ridge regression on `feats`."""
    if loaded.config.n_nextn:
        raise SpecCliError(f"{loaded.gguf.path.name} already has an MTP head")
    cfg = ModelConfig.from_gguf(_WithHead(loaded))
    target = loaded.model
    head = MTPHead(cfg, cfg.n_layer_main, target, own={"head_norm"})
    last = target.layers[-1]
    for name, p in head.block.named_parameters():
        p.data = last.get_parameter(name).detach().float().clone()
    head.head_norm.weight.data = target.norm.weight.detach().float().clone()
    head.eh_proj.weight.data = fit_eh_proj(head, feats, ridge)
    head.to(device)
    head.device, head.dtype = device, torch.float32
    for p in head.parameters():
        p.requires_grad_(True)
    return head


def fit_eh_proj(head: MTPHead, feats: Features, ridge: float) -> torch.Tensor:
    """eh_proj weight [D, 2D] = argmin ||X W^T - Y||^2 + ridge * tr(X^T X)/2D * ||W||^2 with
    X = [enorm(embed(token_p)); hnorm(h_{p-1})] and Y = the target's last-block input at p."""
    m, D = feats.last_in.shape[0], feats.hidden.shape[-1]
    with torch.no_grad():
        e = head.enorm(head.embed_tokens(feats.tokens[:m].reshape(-1)).float().cpu())  # [n, D]
        h = head.hnorm(shifted(feats.hidden[:m]).reshape(-1, D))  # [n, D]
        x = torch.cat((e, h), dim=-1).double()  # [n, 2D]
        y = feats.last_in.reshape(-1, D).double()  # [n, D]
        gram = x.T @ x
        reg = ridge * gram.diagonal().mean() * torch.eye(gram.shape[0], dtype=gram.dtype)
        w = torch.linalg.solve(gram + reg, x.T @ y)  # [2D, D]
    return w.T.float().contiguous()


# --- loss and evaluation ------------------------------------------------------------------------------------


def candidate_logits(head: MTPHead, out: torch.Tensor, hidden: torch.Tensor, cand: torch.Tensor):
    """Head and target logits over the candidate ids only: ([B, T, C], [B, T, C])."""
    target = head.target
    w = target.output.weight[cand.to(target.output.weight.device)].float().to(out.device)  # [C, D]
    z_head = head.normed(out).float() @ w.T
    with torch.no_grad():
        z_target = target.norm(hidden.to(target.output_device, target.norm.weight.dtype)).float().to(out.device) @ w.T
    return z_head, z_target


def batch_loss(head: MTPHead, tokens: torch.Tensor, hidden: torch.Tensor, topk: torch.Tensor, cos_weight: float):
    """Distillation loss of one batch ([B, T] tokens, [B, T, D] target hidden) and the candidate-set agreement."""
    hidden = hidden.to(head.device)
    out = head_forward(head, tokens, shifted(hidden))  # [B, T, D]
    cand = torch.unique(topk)  # [C]
    z_head, z_target = candidate_logits(head, out, hidden, cand)
    log_p = F.log_softmax(z_target, dim=-1)
    kl = (log_p.exp() * (log_p - F.log_softmax(z_head, dim=-1))).sum(-1).mean()
    cos = 1.0 - F.cosine_similarity(out.float(), hidden.float(), dim=-1).mean()
    agree = (z_head.argmax(-1) == z_target.argmax(-1)).float().mean()
    return kl + cos_weight * cos, {"kl": kl.item(), "cos": cos.item(), "agree": agree.item()}


def acceptance_estimate(head: MTPHead, feats: Features, batch: int) -> float:
    """First-position top-1 agreement between the head at p and the target at p (the target's next token), over
    every position of held-out windows: the rate at which the first drafted token would be accepted."""
    agree = total = 0
    with torch.no_grad():
        for b0 in range(0, feats.tokens.shape[0], batch):
            out = head_forward(head, feats.tokens[b0 : b0 + batch], shifted(feats.hidden[b0 : b0 + batch]))
            pred = torch.stack([head.logits(o).argmax(-1).cpu() for o in out])  # [B, T], one window at a time
            agree += (pred == feats.topk[b0 : b0 + batch, :, 0]).sum().item()
            total += pred.numel()
    return agree / max(total, 1)


# --- the whole run ------------------------------------------------------------------------------------------


def build_data(loaded: LoadedModel, cfg: TrainConfig, progress: ProgressFn | None) -> tuple[Features, Features]:
    """Training and held-out features (target run once over text windows + its own continuations)."""
    rng = random.Random(cfg.seed)
    tokenizer = Tokenizer.from_metadata(loaded.gguf.metadata)
    docs = stdlib_documents()
    train_docs = [d for d in docs if not is_held_out(d[0])]
    held_docs = [d for d in docs if is_held_out(d[0])]
    T = cfg.seq_len
    n_gen = cfg.gen_tokens // T
    n_text = max(cfg.data_tokens // T - n_gen, cfg.batch)
    if progress:
        progress(Progress("data", 0, 1, {}))
    text = token_windows(tokenizer, train_docs, T, n_text + n_gen, rng)
    held = token_windows(tokenizer, held_docs, T, max(1, cfg.eval_tokens // T), rng)
    if n_gen:
        prompts = generation_prompts(tokenizer, text[n_text:], T // 2)
        gen = greedy_continuations(loaded, prompts, T - T // 2, progress)
        text = torch.cat((text[:n_text], gen))
    feats = target_features(loaded.model, text, cfg.batch, progress, "features")
    held_feats = target_features(loaded.model, held, cfg.batch, progress, "eval-features")
    return feats, held_feats


def train(loaded: LoadedModel, out_path: str | Path, cfg: TrainConfig, progress: ProgressFn | None = None,
          resume: bool = False) -> TrainResult:
    """Train a NextN head on the frozen target and write out_path = the model's GGUF + the head."""
    t0 = time.perf_counter()
    out_path = Path(out_path)
    torch.manual_seed(cfg.seed)
    device = loaded.model.output_device
    data_key = {k: v for k, v in asdict(cfg).items() if k in ("seq_len", "batch", "data_tokens", "gen_tokens",
                                                               "eval_tokens", "seed")}
    data_key["sources"] = sources_fingerprint(GEN_REQUESTS)
    data = cached(out_path.with_suffix(".features.pt"), data_key, resume,
                  lambda: dict(zip(("train", "held"), (asdict(f) for f in build_data(loaded, cfg, progress)))))
    feats, held = Features(**data["train"]), Features(**data["held"])
    head = init_head(loaded, feats, cfg.ridge, device)
    loop = Loop(head, cfg.steps, cfg.lr, out_path.with_suffix(".ckpt.pt"), cfg.checkpoint_every, config=asdict(cfg))
    if resume:
        loop.resume()
    acc_before = acceptance_estimate(head, held, cfg.batch)
    windows = window_batches(feats.tokens.shape[0], cfg.batch, cfg.seed)

    def step_loss(step: int):
        idx = windows(step)
        return batch_loss(head, feats.tokens[idx], feats.hidden[idx], feats.topk[idx], cfg.cos_weight)

    losses = loop.run(step_loss, progress)
    if progress:
        progress(Progress("eval", 0, 1, {}))
    acc_after = acceptance_estimate(head, held, cfg.batch)
    if progress:
        progress(Progress("eval", 1, 1, {"acceptance": acc_after}))
    vocab = draft_vocabulary(feats.tokens, loaded.config.n_vocab, cfg.draft_vocab)
    write_gguf_with_head(loaded.gguf.path, out_path, head_arrays(head), vocab, out_type(cfg.outtype))
    return TrainResult(out_path, len(losses), feats.tokens.numel(), cfg.gen_tokens // cfg.seq_len * cfg.seq_len,
                       held.tokens.numel(), time.perf_counter() - t0, losses[0] if losses else None,
                       losses[-1] if losses else None, acc_before, acc_after)


def draft_vocabulary(tokens: torch.Tensor, n_vocab: int, size: int) -> list[int] | None:
    """The `size` most frequent token ids of the training data (ties and unseen tokens by id: BPE ids follow merge
    order, roughly frequency), or None for the whole vocabulary. Drafting among 32k of qwen2.5's 152k tokens makes
    the head's output product 4.6x cheaper; the tokens left out are rare, and a draft can only be rejected."""
    if size <= 0 or size >= n_vocab:
        return None
    counts = torch.bincount(tokens.flatten(), minlength=n_vocab)
    return torch.argsort(-counts, stable=True)[:size].tolist()


def head_arrays(head: MTPHead) -> dict[str, np.ndarray]:
    """The head's own tensors as float32 numpy arrays, keyed by GGUF suffix (llama.cpp's NextN layout)."""
    return {name: t.float().cpu().numpy() for name, t in head.own_tensors().items()}

