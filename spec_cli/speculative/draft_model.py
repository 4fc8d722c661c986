"""`draft-simple`: a small draft model with its own context (llama.cpp common/speculative.cpp, draft-simple impl).

The draft context follows the target's KV position for position, lazily: `process` only records the target's
tokens, and `draft` decodes what the draft cache lacks (positions past the common prefix of its tokens and the
committed history: rejected draft tokens are replaced, accepted ones were decoded while drafting) in one batch with
id_last for every drafting sequence, so a verify step usually costs the draft nothing. A sequence more than
DEFER_MAX positions behind (a prompt) is caught up by `process` itself, in one batch, as far as the target's rows
are settled (TargetCache.settled: never a verify batch's draft rows, which the target may reject). A sequence the
adaptive planner stopped asking (IDLE_STEPS target decodes without a draft) is not prefilled at all; asked again
(a probe) more than RESTART_WINDOW rows behind, its draft cache restarts from the last RESTART_WINDOW committed
tokens at draft position 0 (`offset` maps target to draft positions; rope only sees relative positions), so an
unused draft model costs a window per probe instead of a prefill of every token.
Then one batch per draft position, taking the top-1 of a top-k 10 softmax and stopping below p_min. Logits cover
the draft vocabulary only (`--draft-vocab`, speculative/draft_vocab.py): the common tokens and every token the draft
cache was given.
When verification is by rejection (`DraftParams.sampling` set), the draft instead samples each token from its own
distribution under the target's sampler settings and returns those distributions (q) for exact rejection sampling.
A draft model with another vocabulary than the target's (vocab_bridge.py) reads the target's tokens translated into
its own (the draft cache then holds the translation, by draft position) and drafts until its top token has no
counterpart in the target's vocabulary.
A slot file holds a sequence's draft cache (KV and tokens), its mirror of the target cache, its window offset and idle
count, and the tokens the draft vocabulary was shown (shared by the sequences); the sampling generator is not kept
(each request starts its own, at `begin`), nor the translation of the target's tokens (made again from them).
"""

from __future__ import annotations

import numpy as np
import torch

from spec_cli.errors import SpecCliError, StateError
from spec_cli.model.batch import Batch
from spec_cli.model.context import Context
from spec_cli.model.sampling import draft_generator, sample_restricted
from spec_cli.model.state_arrays import State, counters, ints, prefixed, scalar, token_ids, within
from spec_cli.speculative.base import Drafter, DraftParams, SpecParams, TargetCache
from spec_cli.speculative.draft_vocab import DraftVocab
from spec_cli.speculative.vocab_bridge import VocabBridge

DRAFT_TOP_K = 10  # llama.cpp LLAMA_DRAFT_TOP_K
# Target positions a sequence's draft cache may lag behind before `process` catches it up in a batch of its own: a
# longer lag is a prompt (or a streak another drafter won), mirrored when the target decodes it, as llama.cpp's
# draft mirrors prompt chunks, so a prompt's prefill is prompt time whatever its length (at 64, prompts of 17-64
# tokens were prefilled inside the first draft, 4 % of a 128-token generation with the 0.5b draft on one thread).
DEFER_MAX = 16
# A lag of at most this many rows (the usual accepted tokens of the last step) is decoded in draft(), in the seed
# row's batch and priced as drafting: every step pays it. `catch_up` takes only longer lags (an idle drafter).
CATCH_UP_MIN = 16
# A sequence not asked for a draft in IDLE_STEPS target decodes stops being prefilled (keeping an unused draft
# model in step cost a fifth of a 1.5b decode per token on the CPU); asked again more than RESTART_WINDOW rows
# behind, its draft cache restarts from the last RESTART_WINDOW committed tokens, at draft positions from 0.
IDLE_STEPS = 8
RESTART_WINDOW = 32


class DraftModelDrafter(Drafter):
    name = "draft-simple"
    cheap = False

    def __init__(self, ctx: Context, params: SpecParams, n_seq: int, bridge: VocabBridge | None = None):
        if ctx.n_seq != n_seq:
            raise SpecCliError(f"draft context has {ctx.n_seq} sequences, the target {n_seq}")
        ctx.clear()  # a fresh drafter: its draft cache starts empty, as `cached` says
        self.ctx = ctx
        self.params = params
        # another vocabulary than the target's (vocab_bridge.py): the draft cache holds the draft's tokens for the
        # target's, by draft position; None: the same ids, positions offset by `offset` only
        self.bridge = bridge
        # per sequence, the translation `_draft_history` made last: (target tokens, their draft tokens, where each
        # target token's draft tokens end in them, after a leading 0)
        self.translated: list[tuple[list[int], list[int], list[int]]] = [([], [], [0]) for _ in range(n_seq)]
        self.cached: list[list[int]] = [[] for _ in range(n_seq)]  # tokens in the draft KV, by draft position
        self.target_cache = TargetCache(n_seq)  # tokens in the target KV, as far as known
        self.offset = [0] * n_seq  # target position of draft position 0 (> 0 after a restart from a window)
        self.idle = [0] * n_seq  # target decodes since the sequence last asked for a draft
        self.rng: list[torch.Generator | None] = [None] * n_seq  # per request, for sampled drafts
        self.vocab: DraftVocab | None = None  # None: logits over the whole vocabulary
        if params.draft_vocab and DraftVocab.supported(ctx.model):
            self.vocab = DraftVocab(ctx.loaded, params.draft_vocab)

    def begin(self, seq: int, prompt: list[int]) -> None:
        self.rng[seq] = None
        self.idle[seq] = 0  # a new request: its first draft catches the whole prompt up, never from a window
        # The prompt arrived through process(), before this hook: where the sequence was idle then (the last request
        # did not ask this drafter), its rows were not mirrored, and are now, as part of the prompt's processing.
        # Left to the first step instead, they cost the generation a prefill (draft-simple under --draft-max auto:
        # every prompt after the first, 0.87x of plain where it never drafted).
        if self._lag(seq, prompt) > DEFER_MAX:
            late = Batch()
            self._add_catch_up(late, seq, prompt, len(prompt), seed=False)
            self._decode(late)

    def process(self, batch: Batch) -> None:
        late = Batch()
        for seq, p0 in self.target_cache.record(batch).items():
            if p0 is None:  # positions filled without this drafter: draft() catches up from the history
                continue
            if p0 < self.offset[seq]:  # the target went back before the window: start over from position 0
                self._restart(seq, 0)
            known = self.target_cache.tokens[seq]
            self.idle[seq] += 1
            if self.idle[seq] <= IDLE_STEPS and self._lag(seq, known) > DEFER_MAX:
                # settled rows only: a verify batch's draft rows may be rejected (TargetCache.settled)
                self._add_catch_up(late, seq, known, self.target_cache.settled[seq], seed=False)
        if len(late):
            self._decode(late)

    def catch_up(self, params: list[DraftParams]) -> None:
        """Called by the chain before `draft`, outside the drafting time the adaptive planner prices (a drafted token
        should not look dear because the cache fell behind while this drafter was idle): for a sequence more than
        CATCH_UP_MIN rows behind, decode the committed rows the draft cache lacks but the last, which goes with the
        seed row in `draft`. A shorter lag is the cost of every step, and left to `draft`: one decode, priced."""
        batch = Batch()
        for p in params:
            lag = self._lag(p.seq, p.prompt)
            if self.idle[p.seq] > IDLE_STEPS and lag > RESTART_WINDOW:
                self._restart(p.seq, p.pos0 - RESTART_WINDOW)
                lag = RESTART_WINDOW
            if lag > CATCH_UP_MIN:
                self._add_catch_up(batch, p.seq, p.prompt, p.pos0 - 1, seed=False)
        if len(batch):
            self._decode(batch)

    def draft(self, params: list[DraftParams]) -> None:
        batch = Batch()
        last_row: dict[int, int] = {}
        for p in params:
            self.idle[p.seq] = 0
            known = self.target_cache.tokens[p.seq]
            if len(known) < p.pos0:  # the target's KV was filled without process(): the history says what it holds
                known[:] = p.prompt
            del known[p.pos0:]  # rows the target rejected
            if self._add_catch_up(batch, p.seq, p.prompt + [p.id_last], p.pos0 + 1, seed=True):  # usually id_last
                last_row[p.seq] = len(batch) - 1
        active = {p.seq: p for p in params if p.seq in last_row}
        logits = self._decode(batch) if len(batch) else None
        rows = {seq: sum(batch.logits[: last_row[seq] + 1]) - 1 for seq in active}
        q_rows: dict[int, list[torch.Tensor]] = {seq: [] for seq in active}
        while active and logits is not None:
            top = torch.topk(logits, min(DRAFT_TOP_K, logits.shape[-1]), dim=-1)
            p_top = torch.softmax(top.values, dim=-1)[:, 0].tolist()  # top-1 probability under the top-k softmax
            best = top.indices[:, 0]
            ids = (best if self.vocab is None else self.vocab.ids[best]).tolist()
            step = Batch()
            for seq, p in list(active.items()):
                row = rows[seq]
                token = ids[row]
                if not p.keeps(p_top[row], p.p_floor(self.params.draft_p_min)) or not self._crosses(p, token):
                    del active[seq]
                    continue
                if p.sampling is not None:
                    token, q = self._sample(seq, logits[row], p.sampling)
                    q_rows[seq].append(q)
                p.add(token if self.bridge is None else int(self.bridge.to_target[token]), p_top[row])
                if not p.goes_on(min(p.n_max, self.params.draft_max)):
                    del active[seq]
                    continue
                step.add(token, len(self.cached[seq]), seq, True)  # the draft position after the decoded rows
            if not len(step):
                break
            logits = self._decode(step)
            rows = {seq: i for i, seq in enumerate(step.seq_ids)}
        for p in params:
            if len(p.result) < p.min_length(self.params):
                p.truncate(0)
            elif p.sampling is not None and p.result:
                p.probs = torch.stack(q_rows[p.seq])  # [len(result), n_vocab] (the target's through a bridge)

    def _crosses(self, p: DraftParams, token: int) -> bool:
        """Whether the draft's top token has a counterpart in the target's vocabulary (always, with one vocabulary);
        counts the draft tokens that crossed and the one that did not (the chain's statistics read them)."""
        if self.bridge is None:
            return True
        mapped = bool(self.bridge.to_target[token] >= 0)
        crossed, missed = p.crossed or (0, 0)
        p.crossed = (crossed + mapped, missed + (not mapped))
        return mapped

    def _sample(self, seq: int, logits: torch.Tensor, sampling) -> tuple[int, torch.Tensor]:
        """One draft token drawn from q = the draft's distribution under the target's sampler chain (with another
        vocabulary: among the tokens that have a counterpart, q then over the target's vocabulary)."""
        if self.rng[seq] is None:
            self.rng[seq] = draft_generator(sampling, logits.device)
        ids = self.vocab.ids if self.vocab is not None else None
        if self.bridge is None:
            return sample_restricted(logits, ids, self.ctx.config.n_vocab, sampling, self.rng[seq])
        unmapped = self.bridge.unmapped_mask(logits.device)  # q is 0 on the draft tokens without a counterpart
        logits = logits.float().masked_fill(unmapped if ids is None else unmapped[ids], float("-inf"))
        token, q = sample_restricted(logits, ids, self.ctx.config.n_vocab, sampling, self.rng[seq])
        return token, self.bridge.target_distribution(q)

    def min_length(self, p: DraftParams) -> int:
        return p.min_length(self.params)

    def save_state(self, seq: int) -> State:
        return {**prefixed("kv/", self.ctx.seq_state(seq)), "cached": ints(self._synced(seq)),
                **prefixed("target/", self.target_cache.save_state(seq)),
                "counters": np.asarray([self.offset[seq], self.idle[seq]]),
                "vocab_seen": ints(self.vocab.seen() if self.vocab is not None else [])}

    def restore_state(self, seq: int, state: State, n_vocab: int) -> None:
        cached = token_ids(state, "cached", self.ctx.config.n_vocab).tolist()
        seen = token_ids(state, "vocab_seen", self.ctx.config.n_vocab).tolist()
        offset, idle = counters(state, "counters", 2)
        kv = within(state, "kv/")
        if scalar(kv, "length") != len(cached):
            raise StateError(f"'cached' holds {len(cached)} tokens, the draft cache {int(kv['length'])}")
        self.target_cache.restore_state(seq, within(state, "target/"), n_vocab)
        if offset > len(self.target_cache.tokens[seq]):
            raise StateError(f"the draft window starts at {offset}, past the {len(self.target_cache.tokens[seq])} "
                             "target positions")
        self.ctx.restore_seq(seq, kv)
        self.cached[seq], self.offset[seq], self.idle[seq], self.rng[seq] = cached, offset, idle, None
        if self.vocab is not None:
            self.vocab.see(seen)

    def forget(self, seq: int) -> None:
        self._trim(seq, 0)
        self.target_cache.forget(seq)
        self.offset[seq] = self.idle[seq] = 0
        self.rng[seq] = None
        self.translated[seq] = ([], [], [0])

    def slot_info(self, seq: int) -> dict:
        return {"n_kv": self.ctx.lengths[seq]}

    def _synced(self, seq: int) -> list[int]:
        """Cached tokens of a sequence, cut to what the draft context still holds (it may have been cleared)."""
        del self.cached[seq][self.ctx.lengths[seq]:]
        return self.cached[seq]

    def _trim(self, seq: int, pos: int) -> None:
        """Keep draft positions [0, pos)."""
        self.ctx.seq_rm(seq, pos)
        del self.cached[seq][pos:]

    def _lag(self, seq: int, history: list[int]) -> int:
        """Rows of `history` (target tokens by target position) past what the draft cache holds (draft rows)."""
        wanted = self._draft_history(seq, history, len(history))
        return len(wanted) - common_prefix(self._synced(seq), wanted)

    def _draft_history(self, seq: int, history: list[int], end: int) -> list[int]:
        """What seq's draft cache should hold for history[offset:end], by draft position: those tokens, or with
        another vocabulary their translation (kept per sequence, so a grown history costs its new tokens only)."""
        tokens = history[self.offset[seq] : end]
        if self.bridge is None:
            return tokens
        src, dst, ends = self.translated[seq]
        n = common_prefix(src, tokens)
        del src[n:], dst[ends[n]:], ends[n + 1:]
        for t in tokens[n:]:
            src.append(t)
            dst.extend(self.bridge.draft_tokens(t))
            ends.append(len(dst))
        return list(dst)

    def _add_catch_up(self, batch: Batch, seq: int, history: list[int], end: int, seed: bool) -> bool:
        """Add the rows that bring seq's draft cache to history[offset:end] (trimming what differs). With `seed` the
        last row is decoded even when cached, and flagged: its logits seed a draft. False, adding nothing, when a row
        is outside a smaller draft vocabulary, or another vocabulary's rows and a draft would not fit in the draft
        context even from the last window (then the sequence gets no draft)."""
        wanted = self._draft_history(seq, history, end)
        if self._overflows(wanted):  # another vocabulary may take more positions than the target's
            self._restart(seq, max(0, end - RESTART_WINDOW))
            wanted = self._draft_history(seq, history, end)
        start = common_prefix(self._synced(seq), wanted)
        if seed:
            start = min(start, len(wanted) - 1)
        if start < 0 or start >= len(wanted) or self._overflows(wanted):
            return False
        if max(wanted[start:]) >= self.ctx.config.n_vocab:
            return False
        self._trim(seq, start)
        for pos in range(start, len(wanted)):
            batch.add(wanted[pos], pos, seq, seed and pos == len(wanted) - 1)
        return True

    def _overflows(self, wanted: list[int]) -> bool:
        """Whether draft rows `wanted` and a whole draft after them would pass the draft context: only with another
        vocabulary (with the target's, the rows are the target's own, which fit)."""
        return self.bridge is not None and len(wanted) + self.params.draft_max > self.ctx.n_ctx_seq

    def _restart(self, seq: int, offset: int) -> None:
        """Empty seq's draft cache, to hold the history from target position `offset` on."""
        self._trim(seq, 0)
        self.offset[seq] = offset

    def _decode(self, batch: Batch) -> torch.Tensor:
        """Decode in n_batch slices (a catch-up may exceed it) -> logits of the flagged rows, batch order."""
        head = None
        if self.vocab is not None:
            self.vocab.see(batch.tokens)
            head = self.vocab.logits
        logits = [self.ctx.decode(part, head=head).logits for part in batch.split(self.ctx.n_batch)]
        for tok, seq in zip(batch.tokens, batch.seq_ids):
            self.cached[seq].append(tok)
        return torch.cat(logits)


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the common prefix of two token lists."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the usual case, compared at C speed
        return n
    i = 0
    while a[i] == b[i]:
        i += 1
    return i
