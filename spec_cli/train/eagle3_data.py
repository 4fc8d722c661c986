"""The training data of `spec-cli draft-train --type eagle3`: windows of the target's own greedy answers to chat,
writing, question, summary and code requests (train/requests.py), and windows of standard-library code, each with
what the frozen target says about every position: the inputs of the three tapped layers (the head's features), its
final pre-norm state (for the soft targets: the target's distribution over the draft vocabulary, computed per batch)
and its greedy next token. Answers carry their features from the very decodes that generated them; code windows
take one cache-free forward. Held-out requests and held-out files give the acceptance estimate's windows.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from spec_cli.model.loader import LoadedModel
from spec_cli.text.tokenizer import Tokenizer
from spec_cli.train.data import (
    Progress,
    ProgressFn,
    cached,
    greedy_answers,
    is_held_out,
    sources_fingerprint,
    stdlib_documents,
    token_windows,
)
from spec_cli.train.requests import Request, all_requests, requests
from spec_cli.train.target_pass import run_target

UNKNOWN = -1  # top1 of a position whose next token the target did not choose


@dataclass
class Windows:
    """Training windows and the target's view of them (CPU tensors)."""

    tokens: torch.Tensor  # [N, T] int64
    features: torch.Tensor  # [N, T, 3, D] the tapped layers' inputs
    final: torch.Tensor  # [N, T, D] the final pre-norm state (the target's next-token distribution)
    top1: torch.Tensor  # [N, T] int64 the target's greedy next token, UNKNOWN where it did not choose one

    @property
    def n_tokens(self) -> int:
        return self.tokens.numel()


    def select(self, index) -> Windows:
        """The windows at `index` (an index tensor, a slice)."""
        return Windows(*(getattr(self, f)[index] for f in Windows.__dataclass_fields__))


def join(parts: list[Windows]) -> Windows:
    parts = [p for p in parts if p.tokens.shape[0]]
    return Windows(*(torch.cat([getattr(p, f) for p in parts]) for f in Windows.__dataclass_fields__))


def follows_target(tokens: torch.Tensor, top1: torch.Tensor) -> torch.Tensor:
    """[N, T] bool: whether the window's next token is the target's greedy choice (tokens[p + 1] == top1[p]; False
    at the last position and where the target chose none). Always so in the target's own answers; in code windows
    the text leaves the target's path wherever the target would have written something else."""
    follows = torch.zeros_like(top1, dtype=torch.bool)
    follows[:, :-1] = (tokens[:, 1:] == top1[:, :-1]) & (top1[:, :-1] != UNKNOWN)
    return follows


def path_targets(w: Windows, starts: torch.Tensor, n: int) -> torch.Tensor:
    """starts [W, A] of windows w -> the target's greedy tokens at the n positions after each start [W, A, n]: draft
    position k (0-based) predicts its choice after s + k (top1 at s + k) while the window's tokens s + 1 .. s + k are
    its earlier choices (a drafter that sees none of them cannot follow a text that leaves the target's path); UNKNOWN
    where it chose none there, off its path, or past the window. A DFlash block anchored at s drafts these; an
    EAGLE-3 draft whose first step is fed the token at s (and the features before it) too."""
    T = w.top1.shape[1]
    at = starts[..., None] + torch.arange(n, device=w.top1.device)
    index = at.clamp_max(T - 1).view(w.top1.shape[0], -1)
    tokens = w.top1.gather(1, index).view(at.shape)
    on_path = follows_target(w.tokens, w.top1).gather(1, index).view(at.shape).long().cumprod(-1).bool()
    reached = torch.cat([torch.ones_like(on_path[..., :1]), on_path[..., :-1]], -1)  # s + 1 .. s + k on it
    return torch.where((at < T) & reached, tokens, UNKNOWN)


def request_prompts(tokenizer: Tokenizer, reqs: list[Request], limit: int) -> list[list[int]]:
    """Each request as the model's chat (its turns, then the assistant's start), at most `limit` tokens."""
    out = []
    for req in reqs:
        if tokenizer.chat_template:
            roles = ("user", "assistant")
            text = tokenizer.apply_chat_template([{"role": roles[i % 2], "content": turn}
                                                  for i, turn in enumerate(req.turns)], True)
        else:
            text = "\n\n".join(req.turns)
        out.append(tokenizer.encode(text, add_special=True, parse_special=True)[:limit])
    return out


def answer_windows(loaded: LoadedModel, tokenizer: Tokenizer, reqs: list[Request], T: int, layers: tuple[int, ...],
                   progress: ProgressFn | None) -> Windows:
    """Windows of T tokens: a request, then the target's greedy answer (positions after its end of text, and the
    request's own, are not the target's choices: UNKNOWN)."""
    n = len(loaded.model.layers)
    prompts = request_prompts(tokenizer, reqs, T // 2)
    ans = greedy_answers(loaded, prompts, T, tuple(layers) + (n,), frozenset(tokenizer.eog_ids), progress,
                         store=torch.bfloat16)
    top1 = torch.full_like(ans.tokens, UNKNOWN)
    top1[:, :-1] = torch.where(ans.answered[:, :-1], ans.tokens[:, 1:], UNKNOWN)
    return Windows(ans.tokens, ans.features[:, :, :-1], ans.features[:, :, -1], top1)


def code_windows(loaded: LoadedModel, tokens: torch.Tensor, layers: tuple[int, ...], batch: int,
                 progress: ProgressFn | None, stage: str) -> Windows:
    """Text windows [N, T] through the target (one cache-free forward per batch)."""
    n = len(loaded.model.layers)
    out = run_target(loaded.model, tokens, tuple(layers) + (n,), batch, 1, progress, stage, store=torch.bfloat16)
    top1 = out.topk[..., 0].clone()
    top1[:, -1] = UNKNOWN  # the window ends: its last position's next token is not in it
    return Windows(tokens, out.features[:, :, :-1], out.features[:, :, -1], top1)


def held_out_windows(seq_len: int, eval_tokens: int) -> tuple[int, int]:
    """(answer windows, code windows) of the held-out set, in that order (`build`)."""
    n_held = max(2, eval_tokens // seq_len)
    return n_held // 2, n_held - n_held // 2


def build(loaded: LoadedModel, layers: tuple[int, ...], seq_len: int, gen_tokens: int, code_tokens: int,
          eval_tokens: int, batch: int, seed: int, progress: ProgressFn | None) -> tuple[Windows, Windows]:
    """Training windows (answers, then code) and held-out windows (half answers to held-out requests, half held-out
    code), every answer to another request while there are requests left."""
    rng = random.Random(seed)
    tokenizer = Tokenizer.from_metadata(loaded.gguf.metadata)
    docs = stdlib_documents()
    T = seq_len
    n_held_answers, n_held_code = held_out_windows(T, eval_tokens)
    if progress:
        progress(Progress("data", 0, 1, {}))
    held_code = token_windows(tokenizer, [d for d in docs if is_held_out(d[0])], T, n_held_code, rng)
    train = [answer_windows(loaded, tokenizer, requests(gen_tokens // T, False, rng), T, layers, progress)]
    if code_tokens >= T:
        code = token_windows(tokenizer, [d for d in docs if not is_held_out(d[0])], T, code_tokens // T, rng)
        train.append(code_windows(loaded, code, layers, batch, progress, "features"))
    held = join([answer_windows(loaded, tokenizer, requests(n_held_answers, True, rng), T, layers, progress),
                 code_windows(loaded, held_code, layers, batch, progress, "eval-features")])
    return join(train), held


def draft_vocabulary(top1: torch.Tensor, n_vocab: int, size: int) -> list[int]:
    """The `size` tokens the target chose most often (ties, and tokens it never chose, by id), as sorted ids: an
    EAGLE-3 draft vocabulary (its d2t); all n_vocab where size is 0 or more."""
    if size <= 0 or size >= n_vocab:
        return list(range(n_vocab))
    counts = torch.bincount(top1[top1 != UNKNOWN], minlength=n_vocab)
    return sorted(torch.argsort(-counts, stable=True)[:size].tolist())


def draft_row_index(d2t: list[int], n_vocab: int) -> torch.Tensor:
    """[n_vocab] token -> its row in the draft vocabulary `d2t`, -1 outside it."""
    index = torch.full((n_vocab,), -1, dtype=torch.long)
    index[torch.tensor(d2t)] = torch.arange(len(d2t))
    return index


def draft_rows(tokens: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """[...] target tokens (UNKNOWN where the target chose none) -> their draft rows through `index`
    (draft_row_index), -1 where unknown or outside the draft vocabulary."""
    return torch.where(tokens == UNKNOWN, -1, index[tokens.clamp_min(0)])


def cached_windows(loaded: LoadedModel, layers: tuple[int, ...], cfg, out_path: Path, resume: bool,
                   progress: ProgressFn | None) -> tuple[Windows, Windows]:
    """The training and held-out windows of a trainer's settings (`cfg`: seq_len, batch, data_tokens, gen_tokens,
    eval_tokens, seed) and tapped `layers`, kept next to the output (its name with .features.pt) and read back from
    there on --resume with the same settings and `sources`."""
    key = {**{k: getattr(cfg, k) for k in ("seq_len", "batch", "data_tokens", "gen_tokens", "eval_tokens", "seed")},
           "layers": list(layers), "sources": sources_fingerprint(
               text for req in all_requests() for text in (*req.turns, str(req.held_out)))}
    data = cached(out_path.with_suffix(".features.pt"), key, resume, lambda: dict(zip(("train", "held"), (
        asdict(w) for w in build(loaded, layers, cfg.seq_len, cfg.gen_tokens, cfg.data_tokens - cfg.gen_tokens,
                                 cfg.eval_tokens, cfg.batch, cfg.seed, progress)))))
    return Windows(**data["train"]), Windows(**data["held"])
