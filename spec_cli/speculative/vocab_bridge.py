"""A draft model whose vocabulary is not the target's: drafting through the tokens the two vocabularies share.

llama.cpp refuses such a pair (`common_speculative_are_compatible`, `vocab_differences` below); here a pair that
fails that check drafts through a VocabBridge instead, and only a pair with too few shared tokens is refused.

Two directions, two rules:
- target -> draft (what the draft model reads): each target token becomes the draft token that stands for the same
  bytes (a control token: the same text) where there is one, else the draft's tokens for its bytes, longest first.
  A token's translation depends on that token alone, so the draft history of a longer target history only grows at
  its end, and the draft cache follows it with the common-prefix rollback it uses for one vocabulary
  (draft_model.py keeps each sequence's translation).
- draft -> target (what the target verifies): a draft token with a counterpart (the same bytes, one token each side)
  becomes it; a draft ends at the first token without one (the draft's top choice, decided before any sampling, so
  a sampled draft stays exact: draft_model.py samples among the tokens that have one).
Why not re-tokenize the draft's text (transformers' universal assisted generation): the target's tokens of a text
depend on the text after them, so the last tokens of every re-tokenized draft are provisional and the draft cache
would roll back across token boundaries at every step; the draft-side translation would still be needed for the
history. Lossless either way: the target verifies every token.
"""

from __future__ import annotations

import numpy as np
import torch

from spec_cli.errors import SpecCliError
from spec_cli.text.tokenizer import BYTE, CONTROL, NORMAL, UNKNOWN, USER_DEFINED, Tokenizer, common_tokens

VOCAB_MAX_SIZE_DIFFERENCE = 128  # llama.cpp SPEC_VOCAB_MAX_SIZE_DIFFERENCE
VOCAB_CHECK_START_TOKEN_ID = 5  # llama.cpp SPEC_VOCAB_CHECK_START_TOKEN_ID
COMMON_N = 4096  # the draft tokens the shared share is measured on: its vocabulary's most common ordinary tokens
MIN_SHARED = 0.5  # below this share of them a draft would end after a token or two: the pair is refused

Key = tuple[str, bytes]  # ("text", a control token's text) or ("bytes", what an ordinary token decodes to)


def vocab_differences(target_tok: Tokenizer, draft_tok: Tokenizer) -> list[str]:
    """llama.cpp `common_speculative_are_compatible`: the differences that make two vocabularies not one (empty: the
    draft's token ids are the target's)."""
    problems = []
    if target_tok.vocab_type != draft_tok.vocab_type:
        problems.append(f"vocabulary types differ ({target_tok.vocab_type} vs {draft_tok.vocab_type})")
    if target_tok.add_bos != draft_tok.add_bos or (target_tok.add_bos and target_tok.bos_id != draft_tok.bos_id):
        problems.append("BOS settings differ")
    if target_tok.add_eos != draft_tok.add_eos or (target_tok.add_eos and target_tok.eos_id != draft_tok.eos_id):
        problems.append("EOS settings differ")
    diff = abs(target_tok.n_vocab - draft_tok.n_vocab)
    if diff > VOCAB_MAX_SIZE_DIFFERENCE:
        problems.append(f"vocabulary sizes differ by {diff} ({target_tok.n_vocab} vs {draft_tok.n_vocab}, max 128)")
    if not problems:
        for i in range(VOCAB_CHECK_START_TOKEN_ID, min(target_tok.n_vocab, draft_tok.n_vocab)):
            if target_tok.token_text(i) != draft_tok.token_text(i):
                problems.append(f"token {i} differs ('{target_tok.token_text(i)}' vs '{draft_tok.token_text(i)}')")
                break
    return problems


def require_same_vocabulary(target_tok: Tokenizer, draft_tok: Tokenizer) -> None:
    """For a draft that reads the target's token ids as they are (an EAGLE-3 head): SpecCliError naming the
    differences where its vocabulary is another."""
    problems = vocab_differences(target_tok, draft_tok)
    if problems:
        raise SpecCliError("draft vocabulary is not compatible with the target: " + "; ".join(problems))


def vocab_bridge(target_tok: Tokenizer, draft_tok: Tokenizer, draft_meta) -> VocabBridge | None:
    """None where the draft model shares the target's vocabulary (llama.cpp's check), else the bridge between them;
    SpecCliError with the figures where too few of the draft's common tokens have a counterpart."""
    problems = vocab_differences(target_tok, draft_tok)
    if not problems:
        return None
    bridge = VocabBridge(target_tok, draft_tok)
    common = [i for i in common_tokens(draft_meta, COMMON_N) if draft_tok.token_attr(i) == NORMAL]
    shared = int(np.count_nonzero(bridge.to_target[common] >= 0)) if common else 0
    bridge.shared_common = (shared, len(common))
    if shared < MIN_SHARED * len(common):
        raise SpecCliError(f"draft model vocabulary is not the target's ({problems[0]}) and too few of its tokens have "
                           f"a counterpart: {shared} of its {len(common)} most common tokens "
                           f"({100 * shared / max(len(common), 1):.1f} %, at least {100 * MIN_SHARED:.0f} % needed)")
    return bridge


def _keys(tok: Tokenizer) -> dict[Key, int]:
    """Each key's token: an ordinary token before a byte token of the same bytes (SentencePiece's <0x41> vs A), then
    the lowest id."""
    ranked: dict[int, list[tuple[Key, int]]] = {NORMAL: [], BYTE: [], CONTROL: []}
    for i in range(tok.n_vocab):
        attr = tok.token_attr(i)
        key = _key(tok, i, attr)
        if key is not None:
            ranked[NORMAL if attr & NORMAL else BYTE if attr & BYTE else CONTROL].append((key, i))
    keys: dict[Key, int] = {}
    for pairs in ranked.values():
        for key, i in pairs:
            keys.setdefault(key, i)
    return keys


def _key(tok: Tokenizer, i: int, attr: int) -> Key | None:
    if attr & (CONTROL | USER_DEFINED | UNKNOWN):
        return "text", tok.token_text(i).encode()
    if attr & (NORMAL | BYTE):
        piece = tok.token_to_piece(i)
        return ("bytes", piece) if piece else None
    return None  # unused and undefined tokens stand for nothing


class VocabBridge:
    """Token ids between a target and a draft model's vocabulary (module docstring)."""

    def __init__(self, target_tok: Tokenizer, draft_tok: Tokenizer) -> None:
        self.target_tok, self.draft_tok = target_tok, draft_tok
        target_keys, draft_keys = _keys(target_tok), _keys(draft_tok)
        self.to_target = np.full(draft_tok.n_vocab, -1, dtype=np.int64)  # draft id -> its counterpart, or -1
        self._counterpart: dict[int, int] = {}  # target id -> draft id, the same pairs
        for key, d in draft_keys.items():
            t = target_keys.get(key)
            if t is not None:
                self.to_target[d] = t
                self._counterpart[t] = d
        self.n_shared = len(self._counterpart)
        self.shared_common = (0, 0)  # (shared, of) the draft's common tokens, set by vocab_bridge
        self._by_bytes = {key[1]: d for key, d in draft_keys.items() if key[0] == "bytes"}
        self._longest = max((len(b) for b in self._by_bytes), default=1)
        self._draft_of: dict[int, tuple[int, ...]] = {}  # target id -> its draft tokens, as they are asked for
        self._unmapped: torch.Tensor | None = None  # unmapped_mask, on the device last asked for
        self._mapped: tuple[torch.Tensor, torch.Tensor] | None = None  # (draft ids, their target ids), likewise

    def figures(self) -> dict:
        """What --json and /props show of it: the tokens with a counterpart, and how many of the draft's most common
        ordinary tokens have one (common_shared of common_of, the share the pair is refused below)."""
        shared, of = self.shared_common
        return {"shared_tokens": self.n_shared, "common_shared": shared, "common_of": of}

    def draft_tokens(self, target_id: int) -> tuple[int, ...]:
        """The draft tokens standing for one target token (empty for a control token the draft lacks)."""
        out = self._draft_of.get(target_id)
        if out is None:
            d = self._counterpart.get(target_id)
            if d is not None:
                out = (d,)
            elif self.target_tok.token_attr(target_id) & (NORMAL | BYTE):
                out = self._split(self.target_tok.token_to_piece(target_id))
            else:
                out = ()
            self._draft_of[target_id] = out
        return out

    def _split(self, piece: bytes) -> tuple[int, ...]:
        """The draft tokens of a byte string, longest first from the left (bytes no draft token holds are left out)."""
        out, i = [], 0
        while i < len(piece):
            for n in range(min(self._longest, len(piece) - i), 0, -1):
                d = self._by_bytes.get(piece[i : i + n])
                if d is not None:
                    out.append(d)
                    i += n
                    break
            else:
                i += 1
        return tuple(out)

    def unmapped_mask(self, device: torch.device) -> torch.Tensor:
        """[n_vocab_draft] bool: the draft tokens without a counterpart (a sampled draft is drawn among the others)."""
        if self._unmapped is None or self._unmapped.device != device:
            self._unmapped = torch.from_numpy(self.to_target < 0).to(device)
        return self._unmapped

    def target_distribution(self, q: torch.Tensor) -> torch.Tensor:
        """A draft distribution [n_vocab_draft], zero on the unmapped tokens, as one over the target's vocabulary."""
        if self._mapped is None or self._mapped[0].device != q.device:
            mapped = np.flatnonzero(self.to_target >= 0)
            self._mapped = tuple(torch.from_numpy(ids).to(q.device) for ids in (mapped, self.to_target[mapped]))
        draft_ids, target_ids = self._mapped
        return torch.zeros(self.target_tok.n_vocab, dtype=q.dtype, device=q.device).index_copy_(
            0, target_ids, q[draft_ids])
