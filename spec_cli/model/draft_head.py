"""What the draft heads that read the target's features (EAGLE-3, eagle3_head.py; DFlash, dflash_head.py) share: the
target's token embedding and output matrix, used by reference where the head's file has none of its own; an own
output over a draft vocabulary (d2t: the target id of each row); the device and dtype the head computes in.
"""

from __future__ import annotations

import torch
from torch import nn

from spec_cli.model.config import ModelConfig
from spec_cli.model.transformer import Embedding, Linear


class TargetSharedHead(nn.Module):
    """A head's parameters are its own (parameters(), state_dict()); the target is held through a reference that is
    not a submodule. A subclass defines `out_norm` (the norm before the output matrix)."""

    out_norm: nn.Module

    def __init__(self, cfg: ModelConfig, target, own: set[str] = frozenset(), n_draft: int | None = None):
        super().__init__()
        self.cfg = cfg
        self.output = Linear(cfg.n_embd, n_draft or cfg.n_vocab) if "output" in own else None
        self.embed = Embedding(cfg.n_vocab, cfg.n_embd) if "embed" in own else None
        self.draft_vocab: torch.Tensor | None = None  # [V_d] target id of each output row (d2t), None = row i is id i
        object.__setattr__(self, "target", target)  # a model.Transformer: shared, frozen, not a submodule
        self.device = target.layer_devices[-1] if target.layer_devices else torch.device("cpu")
        self.dtype = target.dtype

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [...] -> their embeddings [..., H] in the head's dtype, on its device."""
        embd = self.embed if self.embed is not None else self.target.tok_embd
        table = embd.weight if embd.weight is not None else embd.raw
        return embd(tokens.to(table.device)).to(self.device, self.dtype)

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] (pre-norm) -> logits [..., V_d] float32; row i is token draft_vocab[i] (i without one)."""
        normed = self.out_norm(hidden.to(self.device))
        out = self.output if self.output is not None else self.target.output
        device = self.device if self.output is not None else self.target.output_device
        return out(normed.to(device)).float()
