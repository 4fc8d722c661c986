"""Training an EAGLE-3 head on a frozen target: `spec-cli draft-train --type eagle3` (EAGLE-3 paper; SafeAILab/EAGLE
`traineagle3`; SpecForge), written in llama.cpp's eagle3 layout (model/eagle3_head.py).

Data (eagle3_data.py): the target's own greedy answers to requests plus standard-library code, with the inputs of
three target layers (default [2, N // 2, N - 3], llama.cpp's converter's), the target's final pre-norm state and its
greedy next token at every position.

Training-time test: the head runs `ttt_steps` times over a batch. Step 0's row at anchor position a holds
(x_{a+1}, g_a = fc(feat_a)); step j's row for the same anchor sits at position a + j and holds (x_{a+j+1}, the
pre-norm state of step j - 1's row): what drafting feeds it. Each row attends to the real rows of positions <= a
(step 0's keys, causal) and to its own anchor's rows of the steps before (the diagonal), never to another anchor's
drafts. Row (a, j) predicts x_{a+j+2}; its loss is the cross-entropy against the target's distribution at a + j + 1
restricted to the draft vocabulary (soft targets), where the target chose that token and its choice is in the draft
vocabulary, weighted 0.8^j.

Init: the head's token embedding and output matrix are the target's (the output's rows of the draft vocabulary,
trained; the embedding frozen and not written); q/k/v read [embedding; feature] through halves of the target's last
block's projections, its FFN's gate and up too, with the attention output and FFN down projections zero (the head
starts as `h2 = g`); fc is the ridge regression from feat_a to the target's final state at a + 1 (what predicts
x_{a+2}), so step 0 predicts from the context alone before it learns to read the token.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from spec_cli.errors import SpecCliError
from spec_cli.model.config import ModelConfig
from spec_cli.model.eagle3_file import write_eagle3_gguf
from spec_cli.model.eagle3_head import Eagle3Head, Eagle3Layout
from spec_cli.model.head_file import out_type
from spec_cli.model.loader import LoadedModel
from spec_cli.model.quants import load_tensor
from spec_cli.model.transformer import apply_rope
from spec_cli.options import train_default
from spec_cli.train.data import ProgressFn
from spec_cli.train.eagle3_data import (
    UNKNOWN,
    Windows,
    cached_windows,
    draft_row_index,
    draft_rows,
    draft_vocabulary,
    held_out_windows,
    path_targets,
)
from spec_cli.train.loop import Loop, TrainResult, acceptance, settled_lengths, train_and_estimate, window_batches

STEP_DECAY = 0.8  # weight of training-time-test step j: 0.8^j
RIDGE_ROWS = 16384  # positions the fc init is fitted on


def _default(name: str):
    return train_default("eagle3", name)


@dataclass
class Eagle3TrainConfig:
    steps: int = _default("steps")
    lr: float = _default("lr")
    seq_len: int = _default("seq_len")
    batch: int = _default("batch")
    data_tokens: int = _default("data_tokens")  # training tokens the target is run over (answers + code)
    gen_tokens: int = _default("gen_tokens")  # of which: windows of the target's own answers to requests
    eval_tokens: int = _default("eval_tokens")  # held-out tokens for the acceptance estimate
    ttt_steps: int = _default("ttt_steps")  # training-time-test unroll
    draft_vocab: int = _default("draft_vocab")  # tokens the head drafts among (d2t): those the target chose most
    layers: tuple[int, ...] | None = _default("layers")  # tapped target layers; None = [2, N // 2, N - 3]
    n_ff: int = 0  # the head's FFN width; 0 = the target's
    ridge: float = 1e-2  # relative L2 regularisation of the fc init
    checkpoint_every: int = _default("checkpoint_every")
    eval_draft: int = 3  # draft length of the held-out mean acceptance length (llama.cpp's eagle3 default)
    outtype: str = _default("outtype")  # the written matrices' type (options.HEAD_OUT_TYPES)
    seed: int = _default("seed")


def default_layers(n_layer: int) -> tuple[int, int, int]:
    """llama.cpp's converter's default target layers: low, middle, high."""
    return (min(2, n_layer - 1), n_layer // 2, max(n_layer - 3, 0))


def head_config(tcfg: ModelConfig, n_ff: int) -> ModelConfig:
    """The head's shapes: the target's hidden size, heads and rope base; llama's interleaved-pair rope."""
    return ModelConfig(arch="eagle3", n_layer=1, n_embd=tcfg.n_embd, n_ff=n_ff or tcfg.n_ff, n_head=tcfg.n_head,
                       n_head_kv=tcfg.n_head_kv, head_dim=tcfg.head_dim, n_vocab=tcfg.n_vocab,
                       n_ctx_train=tcfg.n_ctx_train, rms_eps=tcfg.rms_eps, rope_type="norm", rope_dim=tcfg.rope_dim,
                       rope_base=tcfg.rope_base, rope_base_swa=tcfg.rope_base, rope_scale=tcfg.rope_scale,
                       attn_scale=tcfg.head_dim ** -0.5, sliding_window=0, swa_layers=[False])


def interleaved(w: torch.Tensor, n_head: int, rope_type: str) -> torch.Tensor:
    """q/k rows of a target block in llama's interleaved-pair rope order (NeoX targets' half-split pairs moved)."""
    if rope_type != "neox":
        return w
    d = w.shape[0] // n_head
    order = torch.arange(d).view(2, d // 2).T.reshape(-1)
    return w.view(n_head, d, -1)[:, order].reshape(w.shape)


def init_head(loaded: LoadedModel, train: Windows, layers: tuple[int, ...], d2t: list[int], cfg: Eagle3TrainConfig,
              device: torch.device) -> Eagle3Head:
    """A trainable float32 head (module docstring: Init), the target's weights read from its file (whatever form
    the loaded target keeps them in)."""
    tcfg, target = loaded.config, loaded.model
    hcfg = head_config(tcfg, cfg.n_ff)
    head = Eagle3Head(hcfg, Eagle3Layout(layers, tcfg.n_embd, False, False, False), target, {"output"}, len(d2t))
    last = lambda name: load_tensor(loaded.gguf, f"blk.{tcfg.n_layer_main - 1}.{name}.weight")  # noqa: E731
    param = lambda t: torch.nn.Parameter(t.float().contiguous())  # noqa: E731
    with torch.no_grad():
        for name, gguf_name, n_head in (("wq", "attn_q", tcfg.n_head), ("wk", "attn_k", tcfg.n_head_kv),
                                        ("wv", "attn_v", 0)):
            w = interleaved(last(gguf_name), n_head, tcfg.rope_type) if n_head else last(gguf_name)
            getattr(head.attn, name).weight = param(torch.cat((w, w), dim=1) / 2)
        head.attn.wo.weight = param(torch.zeros(hcfg.n_embd, hcfg.n_head * hcfg.head_dim))
        head.attn_norm.weight = param(last("attn_norm"))
        head.hidden_norm.weight = param(last("attn_norm"))
        head.ffn_norm.weight = param(last("ffn_norm"))
        for name, gguf_name in (("w_gate", "ffn_gate"), ("w_up", "ffn_up")):
            w = last(gguf_name)
            own = getattr(head.ffn, name).weight
            getattr(head.ffn, name).weight = param(w if w.shape == own.shape
                                                   else torch.randn(own.shape) / math.sqrt(hcfg.n_embd))
        head.ffn.w_down.weight = param(torch.zeros(hcfg.n_embd, hcfg.n_ff))
        head.out_norm.weight = param(target.norm.weight.detach())
        head.output.weight = param(target_rows(loaded, d2t))
        head.fc.weight = param(fit_fc(train, cfg.ridge))
    head.draft_vocab = torch.tensor(d2t, dtype=torch.long)
    head.to(device)
    head.device, head.dtype = device, torch.float32
    for p in head.parameters():
        p.requires_grad_(True)
    return head


def target_rows(loaded: LoadedModel, ids: list[int]) -> torch.Tensor:
    """[len(ids), D] float32: the target's output matrix rows of these tokens (its embedding where tied)."""
    name = "output.weight" if "output.weight" in loaded.gguf.tensors else "token_embd.weight"
    return load_tensor(loaded.gguf, name)[ids].contiguous()


def fit_fc(train: Windows, ridge: float, shift: int = 1) -> torch.Tensor:
    """fc weight [H, K H_t] = the ridge regression from feat_a (K tapped layers) to the target's final state at
    a + shift."""
    rows = max(1, min(train.tokens.shape[0], RIDGE_ROWS // train.tokens.shape[1]))
    T = train.tokens.shape[1]
    x = train.features[:rows, : T - shift].flatten(2).reshape(-1, train.features[0, 0].numel()).double()
    y = train.final[:rows, shift:].reshape(-1, train.final.shape[-1]).double()
    gram = x.T @ x
    reg = ridge * gram.diagonal().mean() * torch.eye(gram.shape[0], dtype=gram.dtype)
    return torch.linalg.solve(gram + reg, x.T @ y).T.float().contiguous()


# --- training-time test -----------------------------------------------------------------------------------------


class Teacher:
    """The target's side of the loss: its distribution over the draft vocabulary from its final state (its output
    norm and the draft vocabulary's rows of its output matrix, frozen copies), and each token's draft row."""

    def __init__(self, loaded: LoadedModel, d2t: list[int], device: torch.device):
        self.norm = loaded.model.norm
        self.rows = target_rows(loaded, d2t).to(device)  # [V_d, D]
        self.index = draft_row_index(d2t, loaded.config.n_vocab)

    def probs(self, final: torch.Tensor) -> torch.Tensor:
        """final [B, T, D] -> the target's next-token distribution over the draft vocabulary [B, T, V_d]."""
        with torch.no_grad():
            normed = self.norm(final.to(self.norm.weight.device, self.norm.weight.dtype)).float()
            return torch.softmax(normed.to(self.rows.device) @ self.rows.T, dim=-1)

    def rows_of(self, top1: torch.Tensor) -> torch.Tensor:
        """[...] target next tokens -> their draft rows, -1 where unknown or outside the draft vocabulary."""
        return draft_rows(top1, self.index)


def ttt_states(head: Eagle3Head, tokens: torch.Tensor, g0: torch.Tensor, n_steps: int) -> list[torch.Tensor]:
    """tokens [B, T], g0 [B, T, H] = fc(feat) -> the pre-norm states of the rows of steps 0..n_steps-1 [B, T, H]
    (row a of step j: anchor a, position a + j; module docstring)."""
    B, T = tokens.shape
    cfg, attn = head.cfg, head.attn
    causal = torch.ones(T, T, dtype=torch.bool, device=g0.device).tril()
    eye = torch.eye(T, dtype=torch.bool, device=g0.device)
    keys, values, states, g = [], [], [], g0
    for j in range(n_steps):
        e = head.attn_norm(head.embed_tokens(F.pad(tokens[:, j + 1 :], (0, j + 1))))  # x_{a+j+1}; 0 past the end
        gn = head.hidden_norm(g)
        x = torch.cat((e, gn), dim=-1)
        cos, sin = (t.transpose(1, 2) for t in head.rope((torch.arange(T) + j).expand(B, T), T + n_steps))
        q = apply_rope(attn.wq(x).view(B, T, cfg.n_head, -1), cos, sin, cfg.rope_type, cfg.rope_dim)
        keys.append(apply_rope(attn.wk(x).view(B, T, cfg.n_head_kv, -1), cos, sin, cfg.rope_type,
                               cfg.rope_dim).transpose(1, 2))
        values.append(attn.wv(x).view(B, T, cfg.n_head_kv, -1).transpose(1, 2))
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), torch.cat(keys, 2), torch.cat(values, 2), attn_mask=torch.cat([causal] + [eye] * j, 1),
            scale=cfg.attn_scale, enable_gqa=cfg.n_head != cfg.n_head_kv)  # [B, n_head, T, d]
        h = attn.wo(out.transpose(1, 2).reshape(B, T, -1)) + (gn if head.layout.norm_before_residual else g)
        g = h + head.ffn(head.ffn_norm(h))
        states.append(g)
    return states


def ttt_loss(head: Eagle3Head, teacher: Teacher, w: Windows, n_steps: int, bf16: bool) -> tuple[torch.Tensor, dict]:
    """The weighted soft cross-entropy of the unrolled steps over windows `w`, and step 0's top-1 agreement."""
    T = w.tokens.shape[1]
    target = teacher.probs(w.final)  # [B, T, V_d]
    rows = teacher.rows_of(w.top1)  # [B, T]
    with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
        states = ttt_states(head, w.tokens, head.fuse(w.features.float()), n_steps)
    total = weight = 0.0
    info = {}
    for j, h in enumerate(states):
        valid = rows[:, j + 1 :] >= 0  # anchors whose target position a + j + 1 is a chosen, draftable token
        if not valid.any():
            continue
        with torch.autocast("cpu", torch.bfloat16, enabled=bf16):  # the output product of the rows that count
            logits = head.output(head.out_norm(h[:, : T - j - 1][valid]))  # [M, V_d]
        loss_j = -(target[:, j + 1 :][valid] * F.log_softmax(logits.float(), dim=-1)).sum(-1).mean()
        total, weight = total + STEP_DECAY ** j * loss_j, weight + STEP_DECAY ** j
        if j == 0:
            info["acc"] = (logits.argmax(-1) == rows[:, 1:][valid]).float().mean().item()
    if not weight:  # nothing to learn from in these windows
        return states[0].sum() * 0, info
    return total / weight, info


def estimate(head: Eagle3Head, teacher: Teacher, held: Windows, cfg: Eagle3TrainConfig) -> tuple[float, float]:
    """Held-out (first-position acceptance, mean acceptance length at drafts of cfg.eval_draft tokens): a draft
    token is accepted when it is the target's greedy next token, as greedy verification accepts it. Step j >= 1 is
    fed the window's token where run time feeds the draft's own last one, so it counts only while the window
    follows the target's path (path_targets), over the drafts that path settles (settled_lengths)."""
    n = cfg.eval_draft
    first, lengths = [], []
    with torch.no_grad():
        for b0 in range(0, held.tokens.shape[0], cfg.batch):
            w = held.select(slice(b0, b0 + cfg.batch))
            B, T = w.tokens.shape
            states = ttt_states(head, w.tokens, head.fuse(w.features.float()), n)
            # the draft at anchor a (features of a, token a + 1) predicts top1 at a + 1 .. a + n
            targets = path_targets(w, torch.arange(1, T - n + 1).expand(B, T - n), n)  # [B, T - n, n]
            drafted = torch.stack([head.output(head.out_norm(h[:, : T - n])).argmax(-1) for h in states], dim=-1)
            hits = drafted == teacher.rows_of(targets)
            labelled = targets != UNKNOWN  # (a token outside the draft vocabulary is labelled, never hit)
            first.append(hits[..., 0][labelled[..., 0]])
            lengths.append(settled_lengths(hits, labelled))
    return acceptance(first, lengths)


# --- the whole run ---------------------------------------------------------------------------------------------


def train(loaded: LoadedModel, out_path: str | Path, cfg: Eagle3TrainConfig, progress: ProgressFn | None = None,
          resume: bool = False, bf16: bool = False) -> TrainResult:
    """Train an EAGLE-3 head for the frozen target and write it to out_path in llama.cpp's eagle3 layout; bf16:
    the head's products in bfloat16 (where the CPU multiplies it natively)."""
    t0 = time.perf_counter()
    out_path = Path(out_path)
    torch.manual_seed(cfg.seed)
    n_layer = len(loaded.model.layers)
    layers = tuple(cfg.layers) if cfg.layers else default_layers(n_layer)
    if len(layers) != 3 or not all(0 <= layer <= n_layer for layer in layers):
        raise SpecCliError(f"--layers: three target layers in 0..{n_layer} (got {list(layers)})")
    train_w, held = cached_windows(loaded, layers, cfg, out_path, resume, progress)
    d2t = draft_vocabulary(train_w.top1, loaded.config.n_vocab, cfg.draft_vocab)
    device = loaded.model.output_device
    head = init_head(loaded, train_w, layers, d2t, cfg, device)
    teacher = Teacher(loaded, d2t, device)
    loop = Loop(head, cfg.steps, cfg.lr, out_path.with_suffix(".ckpt.pt"), cfg.checkpoint_every, clip=0.5,
                config={**asdict(cfg), "layers": list(layers)})
    if resume:
        loop.resume()
    windows = window_batches(train_w.tokens.shape[0], cfg.batch, cfg.seed)
    result = train_and_estimate(
        loop, lambda step: ttt_loss(head, teacher, train_w.select(windows(step)), cfg.ttt_steps, bf16),
        lambda: estimate(head, teacher, held, cfg), progress, t0, out_path, train_w.n_tokens,
        cfg.gen_tokens // cfg.seq_len * cfg.seq_len, held.n_tokens)
    n_answers = held_out_windows(cfg.seq_len, cfg.eval_tokens)[0]
    result.acc_parts = {part: estimate(head, teacher, held.select(rows), cfg)[0]
                        for part, rows in (("answers", slice(0, n_answers)), ("code", slice(n_answers, None)))}
    write_eagle3_gguf(head, loaded.gguf.path, out_path, out_type(cfg.outtype))
    return result
