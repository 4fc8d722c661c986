"""`draft-eagle3`: drafting with an EAGLE-3 head (`-md FILE` in llama.cpp's eagle3 layout, model/eagle3_head.py;
llama.cpp common/speculative.cpp, its eagle3 implementation).

The head reads the inputs of three target layers for every target row (target features on request), fused by its fc
into g_t; its row at head position t holds (token x_{t+1}, g_t), so the pair of the last committed token is held
back until the next token is known: the draft's seed row is (id_last, g of the last committed position), each later
step (the previous draft token, the head's pre-norm state of the step before). The rows, their deferral and the
loop are head_drafter.HeadDrafter's (lead 1: the head has no row for the first token). After a verify the target's
new features overwrite the draft's rows by position (`reeval`): the accepted tokens' rows are decoded again from the
target's features with the next draft, as llama.cpp re-encodes them.

Drafts are greedy (top-1; stop below --draft-p-min), or, where verification is by rejection (T > 0), drawn from the
head's distribution under the target's sampler settings, q over the draft vocabulary (d2t) mapped to target ids.
The length cap is --draft-max (llama.cpp defaults draft-eagle3 to 3); with --draft-max auto the planner caps each
draft to what pays.
"""

from __future__ import annotations

import torch

from spec_cli.model.context import Context
from spec_cli.model.head_context import HeadContext
from spec_cli.speculative.base import SpecParams
from spec_cli.speculative.head_drafter import HeadDrafter


class Eagle3Drafter(HeadDrafter):
    name = "draft-eagle3"
    lead = 1
    samples = True

    def __init__(self, ctx: HeadContext, target: Context, params: SpecParams, n_seq: int):
        super().__init__(ctx, target, params, n_seq, params.draft_max, params.draft_p_min)

    def target_layers(self) -> tuple[int, ...]:
        return self.ctx.head.target_layers

    def feed_rows(self, features: torch.Tensor) -> torch.Tensor:
        return self.ctx.head.fuse(features)

    @property
    def rollback(self) -> str:
        return "reeval"
