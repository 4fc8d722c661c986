"""Speculation at temperature > 0 keeps the target's output distribution.

match mode draws each emitted token from the target sampler's stream for its position, so with the same seed the
speculative output IS the plain output; rejection mode changes the draws, so its output is compared in distribution with the
exact target distribution of the first two tokens."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from spec_cli.model.batch import Batch
from spec_cli.model.context import Context
from spec_cli.model.sampling import Sampler, SamplingParams
from tests.test_generate import PROMPTS, make_session, run

HOT = dict(temp=0.8, top_k=40, top_p=0.95, min_p=0.05)


@pytest.mark.parametrize("chain", ["ngram-simple", "ngram-mod", "draft-simple", "ngram-mod,draft-simple"])
def test_match_mode_with_a_seed_reproduces_plain_sampling(tiny_model_path, tiny_draft_path, chain):
    plain = make_session(tiny_model_path)
    spec = make_session(tiny_model_path, chain, draft=tiny_draft_path, verify="match")
    drafted = 0
    for seed in range(4):
        sampling = SamplingParams(seed=seed, **HOT)
        expected, _ = run(plain, PROMPTS[seed], sampling=sampling)
        got, seq = run(spec, PROMPTS[seed], sampling=SamplingParams(seed=seed, **HOT))
        assert got == expected
        drafted += seq.n_drafted
    assert drafted > 0


def exact_two_token_distribution(session, prompt, sampling) -> dict[tuple[int, int], float]:
    """P(t1, t2) of plain sampling, from the target's own logits and the sampler's filtered distribution."""
    ctx = Context(session.engine.target, n_ctx=64)
    b = Batch()
    for i, t in enumerate(prompt):
        b.add(t, i, 0, i == len(prompt) - 1)
    p1 = Sampler(sampling, ctx.config.n_vocab).probs(ctx.decode(b).logits[0])
    joint = {}
    for t1 in torch.nonzero(p1).flatten().tolist():
        ctx.seq_rm(0, len(prompt))
        b = Batch()
        b.add(t1, len(prompt), 0, True)
        p2 = Sampler(sampling, ctx.config.n_vocab).probs(ctx.decode(b).logits[0])
        for t2 in torch.nonzero(p2).flatten().tolist():
            joint[(t1, t2)] = float(p1[t1] * p2[t2])
    return joint


@pytest.mark.parametrize("draft_vocab", [0, 4], ids=["whole-vocab", "draft-vocab-4"])
def test_rejection_mode_keeps_the_target_distribution(tiny_model_path, tiny_close_draft_path, draft_vocab):
    # flat sampler (high temperature, top-k 3) so several (t1, t2) pairs are likely and the draft is often rejected;
    # a draft vocabulary of 4 common tokens plus the prompt's leaves some of the target's tokens undraftable (q = 0)
    params = dict(temp=1.5, top_k=3, top_p=1.0, min_p=0.0)
    session = make_session(tiny_model_path, "draft-simple", draft=tiny_close_draft_path, verify="rejection", draft_max=3,
                           draft_vocab=draft_vocab)
    prompt = PROMPTS[1]
    exact = exact_two_token_distribution(session, prompt, SamplingParams(**params))
    n = 600
    counts: Counter = Counter()
    accepted = drafted = 0
    for seed in range(n):
        out, seq = run(session, prompt, 4, sampling=SamplingParams(seed=seed, **params))  # t2 is a verified token
        counts[tuple(out[:2])] += 1
        accepted += seq.n_accepted
        drafted += seq.n_drafted
    tv = 0.5 * sum(abs(counts[k] / n - exact.get(k, 0.0)) for k in set(exact) | set(counts))
    # noise alone gives TV ~0.05 at n=600 over <= 9 cells; a wrong q or misaligned rows gives far more
    print("TV", tv, accepted, drafted)
    assert tv < 0.12, f"total variation {tv:.3f}"
    assert set(counts) <= set(exact)
    assert drafted > 0 and 0 < accepted < drafted  # both accepting and rejecting paths were exercised
