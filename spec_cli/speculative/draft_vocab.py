"""A draft model's output matrix cut to a draft vocabulary (`--draft-vocab`): the tokens its vocabulary ranks most
common plus every token the draft model has been shown (each request's prompt and history).

Why: a small draft model's output matrix is a large share of its step. qwen2.5-coder-0.5b reads 392 MB of weights per
token, 145 of them the 151,936 x 896 Q8_0 output; 32,768 rows of it are 31 MB, so a drafted token costs ~0.3 of a
1.5b forward instead of 0.43. The tokens a request copies from its prompt (identifiers, names) are often rare ones,
hence the seen tokens: on the reference continuations 4.3 % of the 1.5b's tokens lie outside the 32,768 most common
ids, 0.7 % outside them and the prompt and history (FR-Spec drafts among frequent tokens for the same reason).

Exactness does not depend on the set: a token outside it is never drafted, and the target verifies every draft; a
sampled draft's q is the distribution it was drawn from (zero outside the set), which is what rejection sampling needs.
"""

from __future__ import annotations

from collections.abc import Iterable
from weakref import WeakKeyDictionary

import torch
from torch import nn

from spec_cli.model.loader import LoadedModel
from spec_cli.model.transformer import Transformer
from spec_cli.text.tokenizer import common_tokens

# Seen tokens are a second, small output layer rebuilt whenever new ones arrive (a request's prompt, a novel token);
# past this many they join the fixed rows, so a long-running server does not rebuild a large layer per new token.
MERGE_AT = 4096
# draft model -> {n: (the output rows of its n most common tokens, their ids)}: built (~45 ms for the 0.5b, and ~25 ms
# of packing at the first logits) once per model, not per drafter: a session's drafters are renewed per
# configuration, and compare_peers renews them per prompt
_COMMON_ROWS: WeakKeyDictionary[Transformer, dict[int, tuple[nn.Module, torch.Tensor]]] = WeakKeyDictionary()


class DraftVocab:
    """The output rows a draft model computes logits for; `ids[i]` is the token of logit column i."""

    def __init__(self, loaded: LoadedModel, n_common: int):
        self.model = loaded.model
        by_n = _COMMON_ROWS.setdefault(self.model, {})
        if n_common not in by_n:
            by_n[n_common] = self._rows(common_tokens(loaded.gguf.metadata, n_common))
        self._fixed, self._fixed_ids = by_n[n_common]
        self.known = set(self._fixed_ids.tolist())  # the ids plus those waiting for the next logits
        self._common = frozenset(self.known)
        self._pending: list[int] = []
        self._seen: nn.Module | None = None
        self.ids = self._fixed_ids

    @staticmethod
    def supported(model: Transformer) -> bool:
        """Whether the model's output rows can be selected (float weights or GGUF blocks; not a -tp shard)."""
        return hasattr(model.output, "select_rows")

    def see(self, tokens: Iterable[int]) -> None:
        """Tokens the draft model was shown: from the next logits on, it may draft them."""
        new = set(tokens) - self.known
        if new:
            self.known |= new
            self._pending.extend(sorted(new))

    def layers(self) -> list[nn.Module]:
        """The output layers of its rows (what it holds in memory beside the model)."""
        return [layer for layer in (self._fixed, self._seen) if layer is not None]

    def seen(self) -> list[int]:
        """The tokens `see` added to the common ones (what a slot file keeps: they are shared by every sequence)."""
        return sorted(self.known - self._common)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, D] (pre-norm) -> logits [n, len(ids)] float32, column i for token ids[i]."""
        if self._pending:
            self._rebuild()
        normed = self.model.normed(hidden)
        logits = self._fixed(normed)
        if self._seen is not None:
            logits = torch.cat((logits, self._seen(normed)), dim=-1)
        return logits.float()

    def _rebuild(self) -> None:
        seen = (self.ids[len(self._fixed_ids):].tolist() if self._seen is not None else []) + self._pending
        self._pending = []
        if len(seen) > MERGE_AT:  # this drafter's own fixed rows from now on; the shared ones stay as they are
            self._fixed, self._fixed_ids = self._rows(sorted(self._fixed_ids.tolist() + seen))
            self._seen, self.ids = None, self._fixed_ids
            return
        self._seen, seen_ids = self._rows(seen)
        self.ids = torch.cat((self._fixed_ids, seen_ids))

    def _rows(self, ids: list[int]) -> tuple[nn.Module, torch.Tensor]:
        index = torch.tensor(ids, dtype=torch.long, device=self.model.output_device)
        return self.model.output.select_rows(index), index
