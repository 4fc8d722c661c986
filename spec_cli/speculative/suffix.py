"""`suffix`: SuffixDecoding (Oliaro et al., arXiv 2411.04975; the behaviour of ArcticInference's implementation, which
vLLM's `suffix` method runs): drafts from the request's own prompt and output and from earlier requests' outputs.

What it answers. For the last tokens of a sequence (the pattern) and each match length m, the occurrences of the
pattern's last m tokens in the text indexed; from them, the draft follows the most frequent continuation token by
token, each token's estimated probability being the product of continuation frequencies along the path,
count(path + token) / count(path); the draft stops below --spec-suffix-min-token-prob, at
floor(m * --spec-suffix-max-spec-factor) tokens and where pattern + draft would pass --spec-suffix-max-depth (the
depth of the paper's suffix trees). Its score is the sum of its tokens' probabilities; the best-scoring match length
wins (the longest on ties), first over the request's own text, then over the earlier outputs, which win only with a
strictly higher score. The draft is verified as one chain (no tree verification here).

The structure: not a pointer-based suffix tree but the equivalent queries over flat int32 buffers. A depth-limited
suffix tree's node count is the number of occurrences of its path, so both answer the same counts; the buffer
holds 4 bytes a token where a Python suffix tree would hold hundreds, and one vectorized scan of the buffer for the
pattern's last token (~0.1 ms per 256 K tokens) replaces walking nodes. Sequences are separated by SEPARATOR, which
no pattern matches. One difference from the reference: the pattern's own occurrence at the end of the request is not
counted (the tree counts it as a path that continues nowhere, lowering every first-token estimate).

State: per sequence, its prompt and committed output (from `draft`'s history); shared by every sequence (server
slots) and kept across requests, the outputs of finished requests (`end`), up to --spec-suffix-cache-tokens
tokens, the oldest request dropped first. A slot file holds the shared outputs (a sequence's own text comes back
with its next request's prompt); restored, they join the outputs the store lacks, as the oldest, so a fresh server
continues exactly as the saved one and a running one keeps its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from spec_cli.errors import StateError
from spec_cli.model.state_arrays import State, entry, ints, token_ids
from spec_cli.speculative.base import DraftParams, HistoryDrafter, SpecParams

SEPARATOR = -1  # ends a sequence in a buffer: no token equals it, so no match crosses it
EPSILON = 1e-6  # floor(m * factor) as the reference computes it, robust to 0.1 * 30 = 2.9999...


@dataclass
class SuffixDraft:
    tokens: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)  # estimated probability of each token, non-increasing

    @property
    def score(self) -> float:
        return sum(self.probs)


@dataclass(frozen=True)
class SuffixSettings:
    max_depth: int  # pattern + draft tokens, at most
    max_spec_factor: float  # draft tokens per matched pattern token
    min_token_prob: float

    def draft_cap(self, match_len: int, n_max: int) -> int:
        """The longest draft a match of match_len tokens may give."""
        by_match = int(match_len * self.max_spec_factor + EPSILON)
        return max(0, min(n_max, by_match, self.max_depth - match_len))


class TokenStore:
    """Sequences in one flat int32 buffer, each followed by SEPARATOR, within a budget of tokens: adding a sequence
    past it drops the oldest whole (a sequence longer than the budget keeps its last `budget` tokens)."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.buf = np.empty(0, dtype=np.int32)
        self.lengths: list[int] = []  # tokens of each stored sequence, oldest first
        self.n_tokens = 0

    def add(self, tokens: list[int]) -> None:
        tokens = tokens[-self.budget:] if self.budget else []
        if tokens:
            self._keep(self.sequences() + [np.asarray(tokens, dtype=np.int32)])

    def merge(self, older: list[np.ndarray]) -> None:
        """Put sequences before the stored ones, as the oldest, leaving out those it holds already (a slot file's
        store restored into a running one); the budget then drops the oldest."""
        held = self.sequences()
        known = {s.tobytes() for s in held}
        self._keep([s for s in older if s.tobytes() not in known] + held)

    def sequences(self) -> list[np.ndarray]:
        """The stored sequences, oldest first (views of the buffer)."""
        starts = np.cumsum([0] + [n + 1 for n in self.lengths[:-1]]).tolist()
        return [self.buf[a : a + n] for a, n in zip(starts, self.lengths)]

    def _keep(self, sequences: list[np.ndarray]) -> None:
        """Store the newest of `sequences` (oldest first) that fit in the budget together."""
        first, total = len(sequences), 0
        while first > 0 and total + len(sequences[first - 1]) <= self.budget:
            first -= 1
            total += len(sequences[first])
        kept = sequences[first:]
        separator = np.array([SEPARATOR], dtype=np.int32)
        self.buf = np.concatenate([a for s in kept for a in (s, separator)]) if kept else np.empty(0, np.int32)
        self.lengths, self.n_tokens = [len(s) for s in kept], total


def find_matches(buf: np.ndarray, pattern: list[int], max_match: int, limit: int) -> tuple[np.ndarray, np.ndarray]:
    """The occurrences of pattern suffixes ending within buf[:limit]: (ends, lengths), where
    buf[end - length : end] equals the pattern's last `length` tokens (1 <= length <= max_match, as long as the match
    goes) and buf[end] is what followed (SEPARATOR, or past the buffer where nothing did)."""
    ends = np.flatnonzero(buf[:limit] == pattern[-1]) + 1
    lengths = np.ones(len(ends), dtype=np.int64)
    alive = np.arange(len(ends))
    for k in range(1, min(max_match, len(pattern))):
        pos = ends[alive] - 1 - k
        ok = pos >= 0
        ok[ok] = buf[pos[ok]] == pattern[-1 - k]
        alive = alive[ok]
        if not len(alive):
            break
        lengths[alive] += 1
    return ends, lengths


def follow(buf: np.ndarray, ends: np.ndarray, n_max: int, min_prob: float) -> SuffixDraft:
    """The most frequent continuation of the occurrences ending at `ends`, token by token (module docstring); a
    tie goes to the token whose occurrence is the most recent."""
    out = SuffixDraft()
    prob, n = 1.0, len(buf)
    while len(out.tokens) < n_max and len(ends):
        if len(ends) == 1:  # one occurrence: its text, at the probability reached
            start = int(ends[0])
            tail = buf[start : start + n_max - len(out.tokens)].tolist()
            tail = tail[: tail.index(SEPARATOR)] if SEPARATOR in tail else tail
            out.tokens += tail
            out.probs += [prob] * len(tail)
            break
        inside = ends[ends < n]
        nxt = buf[inside]
        inside, nxt = inside[nxt != SEPARATOR], nxt[nxt != SEPARATOR]
        if not len(nxt):
            break
        values, counts = np.unique(nxt, return_counts=True)
        best = counts.max()
        tied = values[counts == best]
        token = int(tied[0]) if len(tied) == 1 else int(buf[inside[np.isin(nxt, tied)].max()])
        prob *= best / len(ends)  # occurrences that ended here count in the parent's total, as in the tree
        if prob < min_prob:
            break
        out.tokens.append(token)
        out.probs.append(prob)
        ends = inside[nxt == token] + 1
    return out


def speculate(buf: np.ndarray, pattern: list[int], n_max: int, settings: SuffixSettings,
              limit: int | None = None) -> SuffixDraft:
    """The best-scoring draft over every match length (the longest on ties) of the occurrences ending within
    buf[:limit] (all of buf by default); empty when nothing matches."""
    best = SuffixDraft()
    if not len(buf) or not pattern or n_max <= 0:
        return best
    # a match leaves room for a draft token within max_depth (>= 2, options.py)
    max_match = min(settings.max_depth - 1, len(pattern))
    ends, lengths = find_matches(buf, pattern, max_match, len(buf) if limit is None else limit)
    if not len(ends):
        return best
    # The occurrences matching at least m tokens only change at the lengths some occurrence reached: one path per
    # group of match lengths (lo, hi], followed as far as the group's longest cap, then scored per m.
    lo = 0
    for hi in np.unique(lengths).tolist():
        group = range(lo + 1, hi + 1)
        caps = [settings.draft_cap(m, n_max) for m in group]
        path = follow(buf, ends[lengths >= hi], max(caps), settings.min_token_prob)
        for cap in caps:
            probs = path.probs[:cap]
            if probs and sum(probs) >= best.score:
                best = SuffixDraft(path.tokens[:cap], probs)
        lo = hi
    return best


class SuffixDrafter(HistoryDrafter):
    name = "suffix"

    def __init__(self, params: SpecParams, n_seq: int, n_ctx_seq: int) -> None:
        self.settings = SuffixSettings(params.suffix_max_depth, params.suffix_max_spec_factor,
                                       params.suffix_min_token_prob)
        self.outputs = TokenStore(params.suffix_cache_tokens)  # earlier requests' outputs, for every sequence
        # per sequence: its prompt and committed output, then one slot for id_last (rewritten at every draft); a
        # sequence's context bounds what it grows to (n_ctx_seq + 1 tokens: runtime/memory.py counts that)
        self.text = [np.empty(0, dtype=np.int32) for _ in range(n_seq)]
        self.n_text = [0] * n_seq
        self.max_text = n_ctx_seq + 1

    def begin(self, seq: int, prompt: list[int]) -> None:
        self.n_text[seq] = 0
        self._extend(seq, prompt)

    def end(self, seq: int, output: list[int]) -> None:
        self.outputs.add(output)

    def save_state(self, seq: int) -> State:
        """The earlier outputs, which every sequence drafts from. Not the sequence's own text: the next request's
        `begin` hands it over again (its prompt holds every token the slot kept)."""
        buf = self.outputs.buf
        return {"outputs": buf[buf != SEPARATOR], "output_lengths": ints(self.outputs.lengths)}

    def restore_state(self, seq: int, state: State, n_vocab: int) -> None:
        """Earlier outputs the store lacks join it as its oldest (in a fresh process: the saved store as it was)."""
        tokens = token_ids(state, "outputs", n_vocab)
        lengths = entry(state, "output_lengths")
        if lengths.size and (lengths.min() < 1 or lengths.max() > len(tokens)) or int(lengths.sum()) != len(tokens):
            raise StateError(f"'output_lengths' does not split the {len(tokens)} tokens of 'outputs'")
        self.outputs.merge(np.split(tokens.astype(np.int32), np.cumsum(lengths)[:-1]) if lengths.size else [])
        self.forget(seq)

    def forget(self, seq: int) -> None:
        self.n_text[seq] = 0  # the shared outputs stay

    def slot_info(self, seq: int) -> dict:
        return {"n_tokens": self.n_text[seq], "n_output_tokens": self.outputs.n_tokens}

    def store_bytes(self) -> int:
        """Bytes its token buffers hold now: the shared outputs with their separators, each sequence's text as
        allocated (runtime/memory.py)."""
        return self.outputs.buf.nbytes + sum(t.nbytes for t in self.text)

    def draft_one(self, p: DraftParams) -> list[int]:
        seq = p.seq
        if len(p.prompt) < self.n_text[seq]:  # not this request's history (no begin): start over from it
            self.n_text[seq] = 0
        self._extend(seq, p.prompt[self.n_text[seq]:])
        n = self.n_text[seq]
        self.text[seq][n] = p.id_last  # what follows an occurrence that ends at the last committed token
        pattern = p.prompt[max(0, len(p.prompt) - self.settings.max_depth + 1):] + [p.id_last]
        own = speculate(self.text[seq][: n + 1], pattern, p.n_max, self.settings, limit=n)  # not id_last's own place
        earlier = speculate(self.outputs.buf, pattern, p.n_max, self.settings)
        return (earlier if earlier.score > own.score else own).tokens

    def _extend(self, seq: int, tokens: list[int]) -> None:
        """Append committed tokens to seq's text, keeping a free slot after them for id_last."""
        n = self.n_text[seq]
        need = n + len(tokens) + 1
        if len(self.text[seq]) < need:
            grown = np.empty(max(need, min(max(2 * len(self.text[seq]), 256), self.max_text)), dtype=np.int32)
            grown[:n] = self.text[seq][:n]
            self.text[seq] = grown
        self.text[seq][n : n + len(tokens)] = tokens
        self.n_text[seq] = n + len(tokens)
