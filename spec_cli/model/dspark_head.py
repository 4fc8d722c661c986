"""DSpark's Markov and confidence heads on a DFlash drafter (llama.cpp #25173: src/models/dflash.cpp
`build_dspark_markov_head`, the draft-dspark branch of common/speculative.cpp). A DSpark file is a dflash file
(dflash_head.py) with these tensors (torch order [out, in]):

  markov_w1.weight [V, R]        an embedding of the token before each block position (R: the Markov rank)
  markov_w2.weight [V_d, R]      its bias over the drafter's output rows; markov_w2.scale (optional) a scalar factor
  conf_proj.weight [1, H + R]    optional confidence head, with conf_proj.bias [1]

and keys dflash.block_size, dflash.sample_from_anchor (absent: true), dflash.has_confidence_head (false: the file
has none). Only DSpark drafts on a Qwen3-style DFlash body are read (llama.cpp's DeepSeek-V4 body, with hyper
connections and experts, is not).

The chain over a block's rows i = i0..n-1, prev = id_last at first, greedy whatever the sampler then draws:
    logits_i += scale * w2 @ w1[prev];  conf_i = sigmoid(conf_proj . [output_norm(h_i); w1[prev]] + b);
    prev = the target id of argmax(logits_i).
Anchor-first (sample_from_anchor) i0 = 0 and row i predicts the token at P + i + 1: a block of n rows gives n draft
tokens, up to block_size. Otherwise row 0 is the anchor's, unread, and row i predicts P + i as in DFlash.
"""

from __future__ import annotations

import torch
from torch import nn

from spec_cli.model.transformer import Embedding, Linear


class MarkovHead(nn.Module):
    def __init__(self, n_vocab: int, n_rows: int, rank: int, n_embd: int, anchor_first: bool):
        super().__init__()
        self.w1 = Embedding(n_vocab, rank)
        self.w2 = Linear(rank, n_rows)
        self.scale = 1.0  # markov_w2.scale
        self.conf: Linear | None = None  # conf_proj: [1, n_embd + rank] with its bias, where the file has one
        self.n_embd = n_embd
        self.anchor_first = anchor_first
        self.device, self.dtype = torch.device("cpu"), torch.float32  # where and how the file's tensors load

    def chain(self, logits: torch.Tensor, normed: torch.Tensor, prev: int,
              draft_vocab: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A block's read rows: logits [n, V_d] (over the drafter's output rows), their post-norm states [n, H] and
        the token before the first -> the biased logits [n, V_d] and the confidences [n] (None without the
        head)."""
        rows, confs = [], []
        for i in range(logits.shape[0]):
            e = self.w1(torch.tensor([prev]))[0].to(logits.device, torch.float32)  # [R]
            row = logits[i] + self.scale * self.w2(e[None])[0].float()
            if self.conf is not None:
                confs.append(torch.sigmoid(self.conf(torch.cat((normed[i].float(), e))[None])[0, 0]))
            best = int(row.argmax())
            prev = best if draft_vocab is None else int(draft_vocab[best])
            rows.append(row)
        return torch.stack(rows), torch.stack(confs) if confs else None
