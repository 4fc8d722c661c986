"""Verification of a draft against the target's logits: which draft tokens to keep, and the token that follows them.

Terms as in vLLM's rejection sampler: draft tokens the target keeps are *accepted*; the target's token at the first
rejected position is *recovered*; when the whole draft is accepted, the token from the extra last row is the *bonus*.
Both functions return accepted + [recovered or bonus], so at least one token, and n_accepted = len(result) - 1.
They call `sampler.accept` on every token they return, in order, and on nothing else.

Input layout (llama.cpp speculative-simple's verify batch): logits [k+1, V], where row i is the target's prediction
after [id_last] + draft[:i]; the draft has k tokens.

Two exact modes: the emitted tokens are distributed as the target sampler's, whatever the draft.
  match      llama.cpp common/sampling.cpp `common_sampler_sample_and_accept_n`: sample every row with the full
             sampler and keep the draft while the sample equals it.
  rejection  Leviathan et al. 2023 / Chen et al. 2023 (vLLM `rejection_sampler.py`, gpt-fast `speculative_decode`):
             accept draft token x with probability min(1, p(x) / q(x)), where p is the sampler's distribution
             (the full chain, temperature included) and q the draft's; on rejection draw from max(p - q, 0).
             Accepts more than match when q is a real distribution; for a one-hot q both accept with probability p(x).
"""

from __future__ import annotations

import torch

from spec_cli.errors import UsageError
from spec_cli.model.sampling import Sampler, draw
from spec_cli.options import VERIFY_MODES


def choose_mode(mode: str, has_draft_probs: bool, greedy: bool) -> str:
    """Resolve --spec-verify: auto = rejection when the drafter gave probabilities and sampling is not greedy."""
    if mode not in VERIFY_MODES:
        raise UsageError(f"unknown verify mode {mode!r} (choose from {', '.join(VERIFY_MODES)})")
    if mode == "auto":
        return "rejection" if has_draft_probs and not greedy else "match"
    return mode


def _check_rows(logits: torch.Tensor, draft: list[int]) -> None:
    if logits.dim() != 2 or logits.shape[0] != len(draft) + 1:
        raise ValueError(f"verify needs logits [k+1, V] for a draft of k={len(draft)}, got {tuple(logits.shape)}")


def verify_match(sampler: Sampler, logits: torch.Tensor, draft: list[int]) -> list[int]:
    """llama.cpp `common_sampler_sample_and_accept_n`: sample row i, keep going while it equals draft[i].

    At temp > 0 each emitted token is drawn as in plain decoding, from the stream of its position (Sampler.rng), so with
    the same seed (and the same logits: the kernels are batch-invariant) speculative output equals non-speculative
    output token for token.
    """
    _check_rows(logits, draft)
    if sampler.greedy:
        # argmax needs no generator: take every row at once (one host sync), then cut at the first mismatch
        target = sampler.argmax_rows(logits, draft)
        n_accepted = next((i for i, (t, d) in enumerate(zip(target, draft)) if t != d), len(draft))
        emitted = target[: n_accepted + 1]
        for token in emitted:
            sampler.accept(token)
        return emitted
    emitted = []
    for i in range(len(draft) + 1):
        token = sampler.sample(logits[i])
        sampler.accept(token)
        emitted.append(token)
        if i == len(draft) or token != draft[i]:
            break
    return emitted


def verify_rejection(sampler: Sampler, logits: torch.Tensor, draft: list[int],
                     draft_probs: torch.Tensor | None = None) -> list[int]:
    """Leviathan/Chen speculative sampling; draft_probs [k, V] = q per position, None = one-hot q (n-gram drafts).

    q must be the distribution each draft token was actually drawn from: a drafter that takes the argmax of its
    softmax drafts from a one-hot q, and passing its softmax instead would bias the output.
    One host sync for the whole draft: every row's p is computed assuming the draft so far was accepted, which is
    the only case in which that row matters (penalty state included).
    """
    _check_rows(logits, draft)
    if sampler.greedy or not draft:
        # greedy p is one-hot on the argmax a: min(1, p(x)/q(x)) is 1 for x == a and 0 otherwise, and the residual
        # max(p - q, 0) is one-hot on a again, so rejection sampling is exactly greedy matching. Without a draft
        # only the bonus row is left, which is a plain sample.
        return verify_match(sampler, logits, draft)
    k = len(draft)
    device = logits.device
    p, ids = sampler.candidates_rows(logits, draft)  # [k+1, C] each: row i's distribution over its candidates
    x = torch.tensor(draft, dtype=torch.long, device=device)  # [k]
    is_x = ids[:k] == x[:, None]  # [k, C] where the draft token sits among the candidates (nowhere if filtered)
    p_x = (p[:k] * is_x).sum(dim=-1)  # [k]
    if draft_probs is None:  # one-hot q
        q_x = torch.ones_like(p_x)  # [k]
        q = is_x.float()  # [k, C]
    else:
        draft_probs = draft_probs.to(device=device, dtype=torch.float32)  # [k, V]
        q_x = draft_probs.gather(1, x[:, None])[:, 0]  # [k]
        q = draft_probs.gather(1, ids[:k])  # [k, C]; q outside p's candidates never matters: p - q <= 0 there
    rng = sampler.rng()  # one stream for the step, seeded by the position of its first row
    u = torch.rand(k, generator=rng, device=device)  # [k]
    accepted = u * q_x < p_x  # u < p/q without dividing: accepts w.p. min(1, p/q), never a token with p = 0
    n = accepted.long().cumprod(0).sum()  # [] first rejected position, k when all accepted

    # The last emitted token comes from max(p_n - q_n, 0). Row k has no draft token (q_k = 0), so for n = k this is
    # the bonus drawn from p_k itself: one formula, and no need to know n on the host yet.
    p_n = p.index_select(0, n[None])[0]  # [C]
    q_n = q.index_select(0, n.clamp_max(k - 1)[None])[0] * (n < k)  # [C]
    residual = (p_n - q_n).clamp_min(0.0)  # [C]
    residual = torch.where(residual.sum() > 0, residual, p_n)  # all zero only when p_n <= q_n everywhere: draw p_n
    last = ids.index_select(0, n[None])[0].gather(0, draw(residual, rng)[None])[0]  # [] token id
    n_accepted, last_token = torch.stack([n, last]).tolist()
    emitted = draft[:n_accepted] + [last_token]
    for token in emitted:
        sampler.accept(token)
    return emitted
