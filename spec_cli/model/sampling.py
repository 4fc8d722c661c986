"""Token sampling: llama.cpp's sampler chain, in its order and with its defaults, with one seeded state per sequence.

Mirrors llama.cpp common/sampling.cpp (`common_sampler`, built from `common_params_sampling`) and the samplers of
src/llama-sampling.cpp it chains by default. The order is:

    logit bias -> penalties -> top-k -> top-p -> min-p -> temperature -> softmax -> draw

- logit bias: only --ignore-eos uses it (-inf on every end-of-generation token, as llama.cpp does).
- top-p and min-p look at the logits BEFORE temperature, because temperature is the last transform in llama.cpp.
- temp <= 0 is greedy: the argmax of the biased and penalized logits, which is the only token llama.cpp's temperature
  sampler keeps at temp <= 0. Greedy never touches the random generator.
- Draws use the exponential race (gpt-fast `multinomial_sample_one_no_sync`): argmax(p / E) with E ~ Exp(1) picks i with
  probability p_i and needs no host sync; only turning the winner into a python int does.
The random stream is a torch.Generator, so draws match llama.cpp's distribution but not its mt19937 sequence.
"""

from __future__ import annotations

import copy
import math
import secrets
from collections import deque
from dataclasses import dataclass

import torch

from spec_cli.options import OPTIONS, RANDOM_SEED, default


@dataclass
class SamplingParams:
    """The sampler flags (llama.cpp `common_params_sampling`, same defaults)."""

    temp: float = default("temp")
    top_k: int = default("top_k")  # 0 = off
    top_p: float = default("top_p")  # 1.0 = off
    min_p: float = default("min_p")  # 0.0 = off
    repeat_penalty: float = default("repeat_penalty")  # 1.0 = off
    repeat_last_n: int = default("repeat_last_n")  # 0 = penalties off, -1 = the whole sequence (llama.cpp: n_ctx)
    presence_penalty: float = default("presence_penalty")
    frequency_penalty: float = default("frequency_penalty")
    seed: int = default("seed")  # RANDOM_SEED: a fresh seed per sampler
    ignore_eos: bool = default("ignore_eos")

    @property
    def greedy(self) -> bool:
        return self.temp <= 0.0

    @property
    def has_penalties(self) -> bool:
        """Whether the penalties sampler changes anything (llama.cpp skips it otherwise)."""
        active = self.repeat_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0
        return self.repeat_last_n != 0 and active

    def validate(self) -> None:
        """Raise UsageError naming the first bad value (by its flag: the options' own checks)."""
        for name in vars(self):
            OPTIONS[name].value(getattr(self, name))


def apply_penalties(logits: torch.Tensor, counts: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """llama.cpp `llama_sampler_penalties_apply` for every token seen in the window (counts[v] > 0).

    logits: [..., V] float32, counts: [V] float32 occurrences in the last `repeat_last_n` accepted tokens.
    The repeat penalty divides a positive logit and multiplies a non-positive one (so it always lowers it);
    then count * frequency_penalty + presence_penalty is subtracted.
    """
    seen = counts > 0  # [V]
    repeated = torch.where(logits <= 0, logits * params.repeat_penalty, logits / params.repeat_penalty)
    penalized = repeated - counts * params.frequency_penalty - seen.float() * params.presence_penalty
    return torch.where(seen, penalized, logits)


def top_p_mask(sorted_logits: torch.Tensor, p: float) -> torch.Tensor:
    """llama.cpp top-p on logits sorted descending ([..., n]): keep the shortest prefix whose probability reaches p."""
    probs = torch.softmax(sorted_logits, dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs  # mass of the better candidates; 0 for the first, so it always stays
    return sorted_logits.masked_fill(before >= p, -math.inf)


def min_p_mask(logits: torch.Tensor, p: float) -> torch.Tensor:
    """llama.cpp min-p: drop tokens whose probability is below p times the best one's (logit < max + log p)."""
    threshold = logits.amax(dim=-1, keepdim=True) + math.log(p)
    return logits.masked_fill(logits < threshold, -math.inf)


def filter_and_softmax(logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor | None]:
    """top-k -> top-p -> min-p -> temperature -> softmax over the last dim of logits [..., V] (temp > 0).

    Returns (probs [..., n], ids [..., n] | None): probs over the n candidates left by top-k (all V when top-k is off),
    ids maps each candidate slot to its token id (None: slot i is token i). Filtered candidates get probability 0.
    Working on top-k's k candidates keeps top-p's sort off the full vocabulary.
    """
    ids = None
    if 0 < params.top_k < logits.shape[-1]:
        logits, ids = logits.topk(params.top_k, dim=-1)  # sorted descending
    elif params.top_p < 1.0:
        logits, ids = logits.sort(dim=-1, descending=True)
    if params.top_p < 1.0:
        logits = top_p_mask(logits, params.top_p)
    if params.min_p > 0.0:
        logits = min_p_mask(logits, params.min_p)
    return torch.softmax(logits / params.temp, dim=-1), ids


def draw(weights: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Index drawn from non-negative weights [..., n] (any scale) along the last dim, without a host sync.

    Exponential race: argmax(w_i / E_i), E_i ~ Exp(1), wins with probability w_i / sum(w). The clamp keeps a zero
    noise sample from turning 0 / 0 into NaN, so zero-weight entries never win.
    """
    noise = torch.empty_like(weights).exponential_(generator=generator)
    return (weights / noise.clamp_min_(1e-30)).argmax(dim=-1)


def sample_restricted(logits: torch.Tensor, ids: torch.Tensor | None, n_vocab: int, params: SamplingParams,
                      generator: torch.Generator) -> tuple[int, torch.Tensor]:
    """One token drawn from a draft's distribution under the target's sampler settings. `logits` [n] cover the
    tokens `ids` [n] (a draft vocabulary; None = ids 0..n-1) -> (token id, q float32 over the ids 0..n_vocab-1 with
    `ids`, over 0..n-1 without; 0 outside `ids`): the distribution the token was drawn from, which rejection
    sampling needs."""
    if ids is not None:
        logits = torch.full((n_vocab,), float("-inf"), device=logits.device).index_copy_(0, ids, logits.float())
    probs, kept = filter_and_softmax(logits.float(), params)
    q = probs
    if kept is not None:
        q = torch.zeros(logits.shape[-1], dtype=torch.float32, device=logits.device).scatter_(0, kept, probs)
    return int(draw(q, generator)), q


def draft_generator(params: SamplingParams, device: torch.device) -> torch.Generator:
    """A drafter's generator for one request: seeded from the request's seed (+1: not the target's own stream),
    else at random."""
    seed = params.seed + 1 if params.seed >= 0 else int(torch.randint(0, 2**62, ()))
    return torch.Generator(device=device).manual_seed(seed)


def _mix64(seed: int, position: int) -> int:
    """A 64-bit generator seed from (seed, position): splitmix64's finalizer over seed * golden ratio + position, so
    neighbouring positions and seeds get unrelated streams."""
    mask = (1 << 64) - 1
    z = (seed * 0x9E3779B97F4A7C15 + position) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return z ^ (z >> 31)


class PenaltyHistory:
    """The last `last_n` accepted tokens and how often each occurs (llama.cpp's penalties ring buffer + token counts)."""

    def __init__(self, n_vocab: int, last_n: int, device: torch.device):
        self.last_n = last_n  # -1: unbounded (a sequence never outgrows its context, llama.cpp's meaning of -1)
        self.tokens: deque[int] = deque()
        self.counts = torch.zeros(n_vocab, dtype=torch.float32, device=device)  # [V], updated on device: no sync

    def accept(self, token: int) -> None:
        if len(self.tokens) == self.last_n:
            self.counts[self.tokens.popleft()] -= 1
        self.tokens.append(token)
        self.counts[token] += 1

    def clone(self) -> PenaltyHistory:
        other = copy.copy(self)
        other.tokens = deque(self.tokens)
        other.counts = self.counts.clone()
        return other

    def reset(self) -> None:
        self.tokens.clear()
        self.counts.zero_()


class Sampler:
    """One sequence's sampler: the chain of `params` plus its state (penalty history, random generator).

    Callers feed every token the sequence commits through `accept` (llama.cpp also accepts the prompt's tokens, so
    the penalties see them); verification does it for the tokens it emits.
    """

    def __init__(self, params: SamplingParams, n_vocab: int, device: torch.device | str = "cpu",
                 eog_ids: list[int] | None = None):
        params.validate()
        self.params = params
        self.n_vocab = n_vocab
        self.device = torch.device(device)
        bad = [t for t in eog_ids or [] if not 0 <= t < n_vocab]
        if bad:
            raise ValueError(f"end-of-generation ids {bad} outside the vocabulary of {n_vocab}")
        self._eog = None  # [n_eog] token ids whose logit is -inf (--ignore-eos)
        if params.ignore_eos and eog_ids:
            self._eog = torch.tensor(sorted(set(eog_ids)), dtype=torch.long, device=self.device)
        self._penalties = PenaltyHistory(n_vocab, params.repeat_last_n, self.device) if params.has_penalties else None
        self.generator = torch.Generator(device=self.device)
        self.n_accepted = 0  # tokens accepted (prompt included): the position of the next token
        self.seed = self._reseed()

    @property
    def greedy(self) -> bool:
        return self.params.greedy

    @property
    def has_penalties(self) -> bool:
        return self._penalties is not None

    def _reseed(self) -> int:
        """llama.cpp `llama_sampler_dist` seeding: the fixed seed, or a fresh random one for -1. Returns the seed used."""
        return secrets.randbits(32) if self.params.seed == RANDOM_SEED else self.params.seed

    def rng(self) -> torch.Generator:
        """The random stream of the next token's draws, seeded by (seed, its position): a token's draws do not depend
        on how many draws came before it, so with match verification a speculative run samples exactly the tokens a
        plain run does, whatever was drafted, rejected or re-verified in between."""
        return self.generator.manual_seed(_mix64(self.seed, self.n_accepted))

    # -- the chain ------------------------------------------------------------------------------------------------

    def _adjusted(self, logits: torch.Tensor, penalties: PenaltyHistory | None) -> torch.Tensor:
        """Logits [..., V] after the logit bias and the penalties, as float32 (the caller's tensor is not modified)."""
        x = logits.float()
        if self._eog is not None:
            x = x.index_fill(-1, self._eog, -math.inf)
        if penalties is not None:
            x = apply_penalties(x, penalties.counts, self.params)
        return x

    def _adjusted_rows(self, logits: torch.Tensor, prefix: list[int]) -> torch.Tensor:
        """Adjusted logits [R, V] where row i sees the penalty state after accepting prefix[:i] (a verify batch)."""
        if self._penalties is None:
            return self._adjusted(logits, None)
        if len(prefix) < logits.shape[0] - 1:
            raise ValueError(f"{logits.shape[0]} rows need a prefix of at least {logits.shape[0] - 1} tokens")
        state = self._penalties.clone()
        rows = []
        for i, row in enumerate(logits):
            rows.append(self._adjusted(row, state))
            if i + 1 < logits.shape[0]:
                state.accept(prefix[i])
        return torch.stack(rows)

    def _candidates(self, adjusted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(probs [..., n], ids [..., n]): the chain's distribution over the candidates that survive it.

        Greedy: the argmax with probability 1. Otherwise top-k's candidates (all V tokens when top-k is off).
        """
        if self.greedy:
            ids = adjusted.argmax(dim=-1, keepdim=True)
            return torch.ones_like(ids, dtype=torch.float32), ids
        probs, ids = filter_and_softmax(adjusted, self.params)
        if ids is None:
            ids = torch.arange(adjusted.shape[-1], device=adjusted.device).expand_as(probs)
        return probs, ids

    # -- public API -----------------------------------------------------------------------------------------------

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution [V] the chain samples from for logits [V] (one-hot on the argmax when greedy)."""
        adjusted = self._adjusted(logits, self._penalties)
        probs, ids = self._candidates(adjusted)
        return torch.zeros_like(adjusted).scatter_(-1, ids, probs)

    def candidates_rows(self, logits: torch.Tensor, prefix: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The chain's distributions for a verify batch logits [R, V] as (probs [R, n], ids [R, n]).

        Token ids[i, j] has probability probs[i, j] in row i and every other token 0; n is top-k's k, which keeps
        callers off vocabulary-wide work. Row i sees the penalty state after accepting prefix[:i].
        """
        return self._candidates(self._adjusted_rows(logits, prefix))

    def argmax_rows(self, logits: torch.Tensor, prefix: tuple[int, ...] | list[int] = ()) -> list[int]:
        """Greedy tokens of logits [R, V] with one host sync; row i as if prefix[:i] had been accepted first."""
        return self._adjusted_rows(logits, list(prefix)).argmax(dim=-1).tolist()

    def sample_on_device(self, logits: torch.Tensor) -> torch.Tensor:
        """Token [] (long, on the logits' device) drawn from logits [V], without a host sync."""
        adjusted = self._adjusted(logits, self._penalties)
        if self.greedy:  # no draw: greedy leaves the generator alone
            return adjusted.argmax(dim=-1)
        probs, ids = self._candidates(adjusted)
        return ids.gather(-1, draw(probs, self.rng()).unsqueeze(-1)).squeeze(-1)

    def sample(self, logits: torch.Tensor) -> int:
        """Token drawn from logits [V] (greedy: the argmax). Does not accept it."""
        return int(self.sample_on_device(logits))

    def accept(self, token: int) -> None:
        """Record a committed token: the next draw's position, and the penalty history."""
        self.n_accepted += 1
        if self._penalties is not None:
            self._penalties.accept(token)

    def clone(self) -> Sampler:
        """An independent copy: same penalty history, same seed and position (so the same future draws)."""
        other = copy.copy(self)
        other._penalties = self._penalties.clone() if self._penalties is not None else None
        other.generator = torch.Generator(device=self.device)
        return other

    def reset(self) -> None:
        """llama.cpp `common_sampler_reset`: empty the penalty history and reseed (a new random seed for -1)."""
        if self._penalties is not None:
            self._penalties.reset()
        self.n_accepted = 0
        self.seed = self._reseed()
