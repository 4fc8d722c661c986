"""Training a DFlash drafter on a frozen target: `spec-cli draft-train --type dflash` (DFlash, arXiv 2602.06036;
z-lab/dflash; SpecForge), written in llama.cpp's dflash layout (model/dflash_head.py).

Data: the EAGLE-3 trainer's (eagle3_data.py): windows of the target's own greedy answers to requests plus
standard-library code, with the inputs of K target layers at every position (default five, spread as SpecForge
spreads Hugging Face ids over 1..N-3, read as the inputs of the next layers: [2, 7, 12, 17, 22] for a 24-layer
target) and the target's greedy next token (`top1`).

The block-diffusion recipe: per window, up to `anchors` anchor positions a drawn among those whose next token the
target chose (the answers; code windows throughout); the block [x_a, MASK x (B-1)] at positions a..a+B-1. Its rows
attend to the keys and values of the fused features of positions < a, injected exactly as at run time, and to the
whole block (non-causal), never to another block. Row k (1..B-1) is trained by cross-entropy to the target's choice
at a + k (top1 at a + k - 1), weighted exp(-(k - 1) / gamma), over the draft vocabulary (d2t: the V_d tokens the
target chose most; a label outside it counts for nothing). The held-out estimate drafts one block per anchor.

Init: draft layer i is a copy of the target's layer N - L + i (attention and FFN; per-head q/k norms 1, the target's
q/k/v biases dropped); fc is the ridge regression from the K features at p to the target's final state at p + 1
(the last context position's then predicts the first draft token, as EAGLE-3's init does), enc.output_norm the
first copied layer's attn_norm; output_norm is the target's, the output the target's rows of the draft vocabulary,
frozen like the embedding (DFlash's draft shares both with the target).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from spec_cli.errors import SpecCliError
from spec_cli.model.config import ModelConfig
from spec_cli.model.dflash_file import write_dflash_gguf
from spec_cli.model.dflash_head import DFlashHead, DFlashLayout
from spec_cli.model.head_file import out_type
from spec_cli.model.loader import LoadedModel
from spec_cli.model.quants import load_tensor
from spec_cli.model.transformer import apply_rope, rope_tables
from spec_cli.options import train_default
from spec_cli.train.data import ProgressFn
from spec_cli.train.eagle3 import fit_fc, target_rows
from spec_cli.train.eagle3_data import (
    UNKNOWN,
    Windows,
    cached_windows,
    draft_row_index,
    draft_rows,
    draft_vocabulary,
    path_targets,
)
from spec_cli.train.loop import Loop, TrainResult, acceptance, settled_lengths, train_and_estimate, window_batches

GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}  # SpecForge's loss decay per block size; others: B / 2


def _default(name: str):
    return train_default("dflash", name)


@dataclass
class DFlashTrainConfig:
    steps: int = _default("steps")
    lr: float = _default("lr")
    seq_len: int = _default("seq_len")
    batch: int = _default("batch")
    data_tokens: int = _default("data_tokens")  # training tokens the target is run over (answers + code)
    gen_tokens: int = _default("gen_tokens")  # of which: windows of the target's own answers to requests
    eval_tokens: int = _default("eval_tokens")  # held-out tokens for the acceptance estimate
    draft_vocab: int = _default("draft_vocab")  # tokens the drafter drafts among (d2t): those the target chose most
    layers: tuple[int, ...] | None = _default("layers")  # target layer inputs read; None = default_layers
    block_size: int = _default("block_size")
    draft_layers: int = _default("draft_layers")
    anchors: int = _default("anchors")  # blocks per window and step
    mask_token: int | None = None  # None: the vocabulary's last id
    checkpoint_every: int = _default("checkpoint_every")
    ridge: float = 1e-2  # relative L2 regularisation of the fc init
    outtype: str = _default("outtype")  # the written matrices' type (options.HEAD_OUT_TYPES)
    seed: int = _default("seed")


def default_layers(n_layer: int, k: int = 5) -> tuple[int, ...]:
    """K target layer inputs: SpecForge's Hugging Face ids spread evenly over 1..N-3, + 1 (the outputs of those
    layers are the inputs of the next)."""
    if n_layer < 5:
        return tuple(sorted({1, n_layer // 2, n_layer - 1}))
    return tuple(1 + round(1 + i * (n_layer - 4) / (k - 1)) for i in range(k))


def gamma(block_size: int) -> float:
    return GAMMA.get(block_size, block_size / 2)


def head_config(tcfg: ModelConfig, n_layer: int) -> ModelConfig:
    """The drafter's shapes: the target's hidden size, FFN, heads and rope base; NeoX rope with q/k norms."""
    return ModelConfig(arch="dflash", n_layer=n_layer, n_embd=tcfg.n_embd, n_ff=tcfg.n_ff, n_head=tcfg.n_head,
                       n_head_kv=tcfg.n_head_kv, head_dim=tcfg.head_dim, n_vocab=tcfg.n_vocab,
                       n_ctx_train=tcfg.n_ctx_train, rms_eps=tcfg.rms_eps, rope_type="neox", rope_dim=tcfg.rope_dim,
                       rope_base=tcfg.rope_base, rope_base_swa=tcfg.rope_base, rope_scale=tcfg.rope_scale,
                       attn_scale=tcfg.head_dim ** -0.5, sliding_window=0, swa_layers=[False] * n_layer, qk_norm=True)


def half_split(w: torch.Tensor, n_head: int, rope_type: str) -> torch.Tensor:
    """q/k rows of a target block in NeoX's half-split rope order (llama's interleaved pairs moved back)."""
    if rope_type == "neox":
        return w
    d = w.shape[0] // n_head
    order = torch.arange(d).view(d // 2, 2).T.reshape(-1)  # [0, 2, 4, ..., 1, 3, 5, ...]
    return w.view(n_head, d, -1)[:, order].reshape(w.shape)


def init_head(loaded: LoadedModel, train: Windows, layout: DFlashLayout, n_layer: int, d2t: list[int],
              cfg: DFlashTrainConfig, device: torch.device) -> DFlashHead:
    """A trainable float32 drafter (module docstring: Init), the target's weights read from its file."""
    tcfg = loaded.config
    hcfg = head_config(tcfg, n_layer)
    head = DFlashHead(hcfg, layout, loaded.model, {"output"}, len(d2t))
    param = lambda t, train=True: torch.nn.Parameter(t.float().contiguous(), requires_grad=train)  # noqa: E731
    first = tcfg.n_layer_main - n_layer
    with torch.no_grad():
        for i, layer in enumerate(head.layers):
            src = lambda name: load_tensor(loaded.gguf, f"blk.{first + i}.{name}.weight")  # noqa: E731,B023
            attn, ffn = layer.attn, layer.ffn
            attn.wq.weight = param(half_split(src("attn_q"), tcfg.n_head, tcfg.rope_type))
            attn.wk.weight = param(half_split(src("attn_k"), tcfg.n_head_kv, tcfg.rope_type))
            for module, name in ((attn.wv, "attn_v"), (attn.wo, "attn_output"), (ffn.w_gate, "ffn_gate"),
                                 (ffn.w_up, "ffn_up"), (ffn.w_down, "ffn_down"), (layer.attn_norm, "attn_norm"),
                                 (layer.ffn_norm, "ffn_norm")):
                module.weight = param(src(name))
            attn.q_norm.weight, attn.k_norm.weight = (param(torch.ones(hcfg.head_dim)) for _ in range(2))
        head.fc_norm.weight = param(head.layers[0].attn_norm.weight.detach().clone())
        head.out_norm.weight = param(loaded.model.norm.weight.detach())
        head.output.weight = param(target_rows(loaded, d2t), train=False)
        head.fc.weight = param(fit_fc(train, cfg.ridge))
    head.draft_vocab = torch.tensor(d2t, dtype=torch.long)
    head.to(device)
    head.device, head.dtype = device, torch.float32
    return head


# --- the block forward of training ------------------------------------------------------------------------------


def block_states(head: DFlashHead, g: torch.Tensor, tokens: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """g [W, T, H] (fused features), tokens [W, T], anchors [W, A] -> the pre-norm states of every block's rows
    [W, A, B, H]: the block of anchor a is [x_a, MASK...] at positions a..a+B-1, attending to the injected context
    of positions < a and to its own rows."""
    cfg, B = head.cfg, head.layout.block_size
    W, T, _ = g.shape
    A = anchors.shape[1]
    blocks = torch.full((W, A, B), head.layout.mask_token, dtype=torch.long, device=g.device)
    blocks[..., 0] = tokens.gather(1, anchors)
    pos = (anchors[..., None] + torch.arange(B, device=g.device)).view(W, A * B)
    ctx_pos = torch.arange(T, device=g.device)
    row_anchor = anchors.repeat_interleave(B, dim=1)  # [W, A B]
    sees_context = ctx_pos[None, None, :] < row_anchor[..., None]  # [W, A B, T]
    block_id = torch.arange(A, device=g.device).repeat_interleave(B)
    same_block = (block_id[:, None] == block_id[None, :]).expand(W, -1, -1)
    mask = torch.cat((sees_context, same_block), dim=-1).unsqueeze(1)  # [W, 1, A B, T + A B]
    n_pos = int(pos.max()) + 1
    rope_ctx = [t.transpose(1, 2) for t in rope_tables(ctx_pos.expand(W, T), n_pos, cfg.rope_dim, cfg.rope_base,
                                                       cfg.rope_scale)]
    rope_blk = [t.transpose(1, 2) for t in rope_tables(pos, n_pos, cfg.rope_dim, cfg.rope_base, cfg.rope_scale)]
    x = head.embed_tokens(blocks.view(W, A * B))
    for layer in head.layers:
        attn = layer.attn
        heads = lambda t, n: t.view(*t.shape[:2], n, cfg.head_dim)  # noqa: E731
        _, k_ctx, v_ctx = attn.project(g)
        k_ctx = apply_rope(attn.k_norm(heads(k_ctx, cfg.n_head_kv)), *rope_ctx, cfg.rope_type, cfg.rope_dim)
        q, k, v = attn.project(layer.attn_norm(x))
        q = apply_rope(attn.q_norm(heads(q, cfg.n_head)), *rope_blk, cfg.rope_type, cfg.rope_dim)
        k = apply_rope(attn.k_norm(heads(k, cfg.n_head_kv)), *rope_blk, cfg.rope_type, cfg.rope_dim)
        keys = torch.cat((k_ctx, k), dim=1).transpose(1, 2)
        values = torch.cat((heads(v_ctx, cfg.n_head_kv), heads(v, cfg.n_head_kv)), dim=1).transpose(1, 2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask, scale=cfg.attn_scale,
                                             enable_gqa=cfg.n_head != cfg.n_head_kv)
        x = x + attn.wo(out.transpose(1, 2).reshape(W, A * B, -1))
        x = x + layer.ffn(layer.ffn_norm(x))
    return x.view(W, A, B, -1)


def block_labels(w: Windows, anchors: torch.Tensor, B: int, rows_of: torch.Tensor) -> torch.Tensor:
    """anchors [W, A] of windows w -> the draft-vocabulary row each block row 1..B-1 should predict [W, A, B-1]:
    the target's greedy continuation along its path (path_targets; a block sees none of the window's tokens after
    its anchor, so past a token the target would not have written the window's later choices are not the block's);
    -1 where there is none or it lies outside the draft vocabulary."""
    return draft_rows(path_targets(w, anchors, B - 1), rows_of)


def sample_anchors(top1: torch.Tensor, n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to n anchors per window [W, n] among positions a >= 1 whose next token the target chose, and which of
    them are real [W, n] (a window with fewer repeats its first)."""
    eligible = top1 != UNKNOWN
    eligible[:, 0] = False
    scores = torch.rand(top1.shape, generator=generator).to(top1.device).masked_fill(~eligible, -1.0)
    top = scores.topk(min(n, top1.shape[1]), dim=1)
    return top.indices, top.values >= 0


def block_loss(head: DFlashHead, w: Windows, anchors: torch.Tensor, real: torch.Tensor, rows_of: torch.Tensor,
               bf16: bool) -> tuple[torch.Tensor, dict]:
    """The decayed cross-entropy of the blocks at `anchors` ([W, A], `real` marks those that count) and the
    first row's top-1 agreement."""
    B = head.layout.block_size
    labels = block_labels(w, anchors, B, rows_of).masked_fill(~real[..., None], -1)  # [W, A, B - 1]
    with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
        states = block_states(head, head.fuse(w.features.float()), w.tokens, anchors)[:, :, 1:]
        valid = labels >= 0
        if not valid.any():
            return states.sum() * 0, {}
        logits = head.output(head.out_norm(states[valid]))  # [M, V_d]
    weights = torch.exp(-torch.arange(B - 1, dtype=torch.float32) / gamma(B)).expand_as(labels)[valid]
    ce = F.cross_entropy(logits.float(), labels[valid], reduction="none")
    first = valid.nonzero()[:, 2] == 0  # the valid rows that are their block's first draft row
    hits = (logits.argmax(-1) == labels[valid])[first]
    return (ce * weights).sum() / weights.sum(), {"acc": hits.float().mean().item() if hits.numel() else 0.0}


def estimate(head: DFlashHead, held: Windows, rows_of: torch.Tensor, batch: int, n_anchors: int,
             seed: int) -> tuple[float, float]:
    """Held-out (first-position acceptance, mean acceptance length of blocks): a block's draft token is accepted
    when it is the target's greedy continuation, as greedy verification accepts it; the length counts the target's
    own token, over blocks whose length the labels settle (every row accepted, or the first rejected row labelled:
    a block whose rows are all accepted up to the end of the labels, an answer's or the target's path, is left out)."""
    B, gen = head.layout.block_size, torch.Generator().manual_seed(seed)
    first, lengths = [], []
    with torch.no_grad():
        for b0 in range(0, held.tokens.shape[0], batch):
            w = held.select(slice(b0, b0 + batch))
            anchors, real = sample_anchors(w.top1, n_anchors, gen)
            targets = path_targets(w, anchors, B - 1).masked_fill(~real[..., None], UNKNOWN)  # [W, A, B - 1]
            states = block_states(head, head.fuse(w.features.float()), w.tokens, anchors)[:, :, 1:]
            hits = head.output(head.out_norm(states)).argmax(-1) == draft_rows(targets, rows_of)
            labelled = targets != UNKNOWN  # (a token outside the draft vocabulary is labelled, never hit)
            first.append(hits[..., 0][labelled[..., 0]])
            lengths.append(settled_lengths(hits, labelled))
    return acceptance(first, lengths)


# --- the whole run ---------------------------------------------------------------------------------------------


def train(loaded: LoadedModel, out_path: str | Path, cfg: DFlashTrainConfig, progress: ProgressFn | None = None,
          resume: bool = False, bf16: bool = False) -> TrainResult:
    """Train a DFlash drafter for the frozen target and write it to out_path in llama.cpp's dflash layout; bf16:
    the drafter's products in bfloat16 (where the CPU multiplies it natively)."""
    t0 = time.perf_counter()
    out_path = Path(out_path)
    torch.manual_seed(cfg.seed)
    tcfg = loaded.config
    n_layer = tcfg.n_layer_main
    layers = tuple(cfg.layers) if cfg.layers else default_layers(n_layer)
    if not layers or not all(0 <= layer <= n_layer for layer in layers):
        raise SpecCliError(f"--layers: target layers in 0..{n_layer} (got {list(layers)})")
    if not 1 <= cfg.draft_layers <= n_layer:
        raise SpecCliError(f"--draft-layers: 1 to the target's {n_layer}")
    mask = tcfg.n_vocab - 1 if cfg.mask_token is None else cfg.mask_token
    train_w, held = cached_windows(loaded, layers, cfg, out_path, resume, progress)
    d2t = draft_vocabulary(train_w.top1, tcfg.n_vocab, cfg.draft_vocab)
    rows_of = draft_row_index(d2t, tcfg.n_vocab)
    layout = DFlashLayout(layers, tcfg.n_embd, cfg.block_size, mask)
    head = init_head(loaded, train_w, layout, cfg.draft_layers, d2t, cfg, loaded.model.output_device)
    loop = Loop(head, cfg.steps, cfg.lr, out_path.with_suffix(".ckpt.pt"), cfg.checkpoint_every, clip=1.0,
                config={**asdict(cfg), "layers": list(layers)})
    if resume:
        loop.resume()
    windows = window_batches(train_w.tokens.shape[0], cfg.batch, cfg.seed)

    def step_loss(step: int) -> tuple[torch.Tensor, dict]:
        w = train_w.select(windows(step))
        anchors, real = sample_anchors(w.top1, cfg.anchors, torch.Generator().manual_seed(cfg.seed * 100003 + step))
        return block_loss(head, w, anchors, real, rows_of, bf16)

    result = train_and_estimate(loop, step_loss, lambda: estimate(head, held, rows_of, cfg.batch, cfg.anchors,
                                                                  cfg.seed),
                                progress, t0, out_path, train_w.n_tokens, cfg.gen_tokens // cfg.seq_len * cfg.seq_len,
                                held.n_tokens)
    write_dflash_gguf(head, loaded.gguf.path, out_path, out_type(cfg.outtype))
    return result
