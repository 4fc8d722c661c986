"""llama.cpp's batch: rows of (token, position, sequence id, wants-logits), decoded in one forward."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Batch:
    tokens: list[int] = field(default_factory=list)
    pos: list[int] = field(default_factory=list)
    seq_ids: list[int] = field(default_factory=list)
    logits: list[bool] = field(default_factory=list)

    def add(self, token: int, pos: int, seq_id: int, want_logits: bool) -> None:
        self.tokens.append(token)
        self.pos.append(pos)
        self.seq_ids.append(seq_id)
        self.logits.append(want_logits)

    def __len__(self) -> int:
        return len(self.tokens)

    def rows_of(self, seq_id: int) -> list[int]:
        """Row indices of one sequence, in batch order."""
        return [i for i, s in enumerate(self.seq_ids) if s == seq_id]

    def split(self, n: int) -> list["Batch"]:
        """Consecutive slices of at most n rows (a context decodes at most n_batch rows at a time)."""
        return [Batch(self.tokens[i : i + n], self.pos[i : i + n], self.seq_ids[i : i + n], self.logits[i : i + n])
                for i in range(0, len(self), n)]
