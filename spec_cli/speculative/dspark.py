"""`draft-dspark`: DFlash's block drafting with DSpark's Markov head (`-md FILE`: a dflash file with markov_w1,
model/dspark_head.py; llama.cpp common/speculative.cpp, its dflash implementation in DSpark mode).

Everything but the reading of a block is draft-dflash's (dflash.py): the injected features, one forward per draft,
the block dropped, the cache following the target. Anchor-first files (dflash.sample_from_anchor, the default) decode
[id_last, MASK x (n - 1)] and read all n rows, up to block_size tokens a draft; others decode DFlash's block. The rows
read are biased by the Markov chain (each by the greedy token before it), then drafted as DFlash drafts them, except
that --draft-p-min stops at the first row whose confidence (the confidence head) is below it, as llama.cpp does: a
file without a confidence head drafts only with --draft-p-min 0.
"""

from __future__ import annotations

import torch

from spec_cli.errors import UsageError
from spec_cli.model.context import Context
from spec_cli.model.dflash_head import DFlashContext
from spec_cli.options import p_min_floor
from spec_cli.speculative.base import DraftParams, SpecParams
from spec_cli.speculative.dflash import DFlashDrafter


class DSparkDrafter(DFlashDrafter):
    name = "draft-dspark"

    def __init__(self, ctx: DFlashContext, target: Context, params: SpecParams, n_seq: int):
        markov = ctx.head.markov
        if markov is None:
            raise UsageError("--spec-type draft-dspark needs a DSpark draft (a dflash file with markov_w1.weight)")
        if markov.conf is None and p_min_floor(params.draft_p_min, gated=False) > 0:
            raise UsageError("this DSpark draft has no confidence head: --draft-p-min must be 0 with it")
        self.first_row = 0 if markov.anchor_first else 1
        super().__init__(ctx, target, params, n_seq)

    def block_capacity(self) -> int:
        return self.head.layout.block_size - self.first_row

    def block_tokens(self, p: DraftParams, n: int) -> list[int]:
        return [p.id_last] + [self.head.layout.mask_token] * (n - 1 + self.first_row)

    def read_blocks(self, blocks: list[tuple[DraftParams, int, int]], logits: torch.Tensor,
                    hidden: torch.Tensor) -> None:
        """The Markov chain over each block's read rows, then DFlash's reading of the biased rows, stopped by the
        confidences instead of the top-1 probability."""
        markov, start = self.head.markov, 0
        for p, row, n in blocks:
            rows = range(start + self.first_row, start + self.first_row + n)  # the read rows in the decode's batch
            start += n + self.first_row
            normed = self.head.out_norm(hidden[list(rows)]) if markov.conf is not None else None
            biased, conf = markov.chain(logits[row : row + n], normed, p.id_last, self.head.draft_vocab)
            p_min = p.p_floor(self.params.draft_p_min)
            if conf is not None and p_min > 0:
                below = (conf < p_min).nonzero()
                biased = biased[: int(below[0]) if below.numel() else n]
            self.read_rows(p, biased, stop_below=0.0)
