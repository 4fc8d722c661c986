"""`draft-mtp` (alias `mtp`): drafting with the target's own NextN head (llama.cpp common/speculative.cpp, MTP impl;
llamacpp-speculative.md §2.8).

The head row at position p reads (token_p, h_{p-1}): the target's pre-norm hidden state one position back (target
features on request: the tap at layer id n_layer), as it is. The rows, their deferral, idle restarts, rollback and the
draft loop are head_drafter.HeadDrafter's; MTP's first row reads no hidden state (lead 0, as an MTP layer's position
0), the rollback is `--spec-mtp-rollback` (`partial`: llama.cpp's behaviour), and drafts are greedy (no `probs`):
exact under both verification modes.
"""

from __future__ import annotations

import torch

from spec_cli.model.context import Context
from spec_cli.model.head_context import HeadContext
from spec_cli.speculative.base import SpecParams
from spec_cli.speculative.head_drafter import HeadDrafter

MTP_DRAFT_MAX = 3  # llama.cpp #23269: MTP acceptance falls off quickly with depth, so 3 (not the global 16)
MTP_DRAFT_P_MIN = 0.0  # llama.cpp #23269 default for MTP (not the global 0.75)


class MTPDrafter(HeadDrafter):
    name = "draft-mtp"

    def __init__(self, ctx: HeadContext, target: Context, params: SpecParams, n_seq: int,
                 n_max: int = MTP_DRAFT_MAX, p_min: float = MTP_DRAFT_P_MIN):
        super().__init__(ctx, target, params, n_seq, n_max, p_min)

    def target_layers(self) -> tuple[int, ...]:
        return (self.target.config.n_layer_main,)  # the final pre-norm state

    def feed_rows(self, features: torch.Tensor) -> torch.Tensor:
        return features[:, 0]

    @property
    def rollback(self) -> str:
        return self.params.mtp_rollback
