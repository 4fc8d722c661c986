"""Verification keeps the target's distribution exactly (both modes), reduces to greedy matching at temp 0, and feeds
the sampler exactly the emitted tokens."""

from functools import cache

import pytest
import torch

from spec_cli.errors import UsageError
from spec_cli.model.sampling import Sampler, SamplingParams
from spec_cli.speculative.verify import choose_mode, verify_match, verify_rejection

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
V = 8


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny tensors gain nothing from threads, and on a busy machine torch's CPU softmax over a few short rows can
    stall for milliseconds waiting for its second thread, which turns the 10000-trial tests into minutes."""
    n_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n_threads)


def greedy_rows(*argmaxes: int, n_vocab: int = 16) -> torch.Tensor:
    """Logits [len, n_vocab] whose row i has its maximum at argmaxes[i]."""
    logits = torch.randn(len(argmaxes), n_vocab, generator=torch.Generator().manual_seed(len(argmaxes)))
    logits[torch.arange(len(argmaxes)), list(argmaxes)] = 10.0
    return logits


def draft_distribution(draft: list[int], n_vocab: int = 16) -> torch.Tensor:
    return torch.softmax(torch.randn(len(draft), n_vocab, generator=torch.Generator().manual_seed(9)), dim=-1)


def verify_with(mode: str, sampler: Sampler, logits: torch.Tensor, draft: list[int], q: torch.Tensor | None):
    if mode == "match":
        return verify_match(sampler, logits, draft)
    return verify_rejection(sampler, logits, draft, q)


# -- greedy -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["match", "rejection"])
@pytest.mark.parametrize("draft, expected", [
    ([3, 5, 7], [3, 5, 7, 2]),  # all accepted + bonus from the last row
    ([3, 9, 7], [3, 5]),  # mismatch at 1: the target's token replaces it
    ([4, 5, 7], [3]),  # mismatch at 0
    ([], [3]),  # no draft: a plain step
])
def test_greedy_verification(device, mode, draft, expected):
    logits = greedy_rows(3, 5, 7, 2)[: len(draft) + 1].to(device)
    sampler = Sampler(SamplingParams(temp=0.0), 16, device)
    q = draft_distribution(draft).to(device) if draft else None
    assert verify_with(mode, sampler, logits, draft, q) == expected


def test_greedy_rejection_is_greedy_matching():
    generator = torch.Generator().manual_seed(5)
    for _ in range(50):
        logits = torch.randn(4, 16, generator=generator)
        draft = torch.randint(0, 16, (3,), generator=generator).tolist()
        draft[: 2] = logits[:2].argmax(-1).tolist()  # make some prefixes match
        q = torch.softmax(torch.randn(3, 16, generator=generator), dim=-1)
        match = verify_match(Sampler(SamplingParams(temp=0.0), 16), logits, draft)
        assert verify_rejection(Sampler(SamplingParams(temp=0.0), 16), logits, draft, q) == match
        assert verify_rejection(Sampler(SamplingParams(temp=0.0), 16), logits, draft, None) == match


def test_penalty_state_advances_through_the_draft_and_emitted_tokens():
    # top_k=1 makes every distribution one-hot on the penalized argmax, so both modes are deterministic at temp > 0.
    # Row 1 sees draft[0] in the history (2 / 4 - 0.1 = 0.4 < 1.9), row 2 sees both (1.9 / 4 - 0.1 = 0.375 < 0.4).
    params = SamplingParams(temp=1.0, top_k=1, repeat_penalty=4.0, frequency_penalty=0.1, seed=1)
    logits = torch.tensor([[2.0, 1.9, 0.0]] * 3)
    probe = 3 * torch.randn(200, 3, generator=torch.Generator().manual_seed(4))  # greedy choices expose the history

    def with_history(tokens):
        sampler = Sampler(params, 3)
        for token in tokens:
            sampler.accept(token)
        return [sampler.sample(row) for row in probe]

    assert with_history([0, 1, 0]) != with_history([0, 1])  # the probe can tell the histories apart
    for verify in (verify_match, verify_rejection):
        sampler = Sampler(params, 3)
        assert verify(sampler, logits, [0, 1]) == [0, 1, 0]
        assert [sampler.sample(row) for row in probe] == with_history([0, 1, 0])  # exactly the emitted tokens were accepted


@pytest.mark.parametrize("device", DEVICES)
def test_match_at_temperature_draws_like_plain_decoding(device):
    # one draw per emitted token from the same generator: verify_match == sampling row by row with a twin sampler
    params = SamplingParams(temp=1.0, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.3, presence_penalty=0.2,
                            seed=42)
    logits = torch.zeros(5, 32, device=device)  # uniform, so draws almost never match a draft by chance
    sampler = Sampler(params, 32, device)
    twin, probe = sampler.clone(), sampler.clone()
    plain = []
    for row in logits:
        plain.append(probe.sample(row))
        probe.accept(plain[-1])
    draft = plain[:2] + [(plain[2] + 1) % 32, plain[3]]
    emitted = verify_match(sampler, logits, draft)
    assert emitted == plain[:3]
    for row in logits[:3]:
        twin.accept(twin.sample(row))
    assert sampler.sample(logits[0]) == twin.sample(logits[0])  # same generator state afterwards


def test_rejection_is_reproducible_per_seed():
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(200, 5, 16, generator=generator)
    q = torch.softmax(torch.randn(200, 4, 16, generator=generator), dim=-1)
    draft = torch.multinomial(q.view(-1, 16), 1, generator=generator).view(200, 4).tolist()
    params = SamplingParams(temp=1.0, seed=11)
    runs = []
    for _ in range(2):
        sampler = Sampler(params, 16)
        runs.append([verify_rejection(sampler, logits[i], draft[i], q[i]) for i in range(200)])
    assert runs[0] == runs[1]
    assert len({len(r) for r in runs[0]}) > 2  # the trials do accept different amounts


# -- statistics ---------------------------------------------------------------------------------------------------
# A two-position toy model over V = 8 tokens: the target's logits for position 0 are L0 and for position 1, after
# token t0, L1[t0]. The target distribution is what a Sampler with non-trivial filters makes of them. Drafts are
# either model-like (d0 ~ q0, d1 ~ Q1[d0], with those probabilities passed) or n-gram-like (deterministic, one-hot).
# Each trial emits the first two tokens, calling verify a second time when the first call stopped after one token.
# N = 10000 trials; tolerances on total variation: 0.025 for an 8-token marginal, 0.04 for the 64-cell joint. Sampling
# noise alone gives about 0.008 / 0.016 (at most 0.018 / 0.023 over 200 simulated runs), while the classic bug of
# resampling from p instead of max(p - q, 0) after a rejection is off by 0.18 (model drafts) and 0.11 (n-gram drafts).
# Acceptance rates: tolerance 0.015 (3 standard deviations).
# The drafts differ from the target by TV > 0.3, so leaking the draft distribution would be far outside too.
N = 10000
TARGET = SamplingParams(temp=0.8, top_k=6, top_p=0.95, min_p=0.05, seed=1234)
L0 = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, 1.5, -1.0, 0.3])
L1 = 1.5 * torch.randn(V, V, generator=torch.Generator().manual_seed(1))  # [t0, V]
Q0 = torch.softmax(torch.tensor([0.0, 1.5, 0.5, 1.0, 0.0, -1.0, 0.8, 0.2]), dim=0)
Q1 = torch.softmax(torch.randn(V, V, generator=torch.Generator().manual_seed(2)), dim=-1)  # [d0, V]


def ngram_next(token: int) -> int:
    return (token + 3) % V


def target_probs() -> tuple[torch.Tensor, torch.Tensor]:
    """p0 [V] and p1 [t0, V] under TARGET's chain."""
    sampler = Sampler(TARGET, V)
    return sampler.probs(L0), torch.stack([sampler.probs(row) for row in L1])


@cache
def run_trials(mode: str, drafter: str) -> tuple[torch.Tensor, float]:
    """(first two emitted tokens [N, 2], fraction of trials whose first draft token was accepted)."""
    sampler = Sampler(TARGET, V)
    drafts = torch.Generator().manual_seed(99)
    d0s = torch.multinomial(Q0, N, replacement=True, generator=drafts).tolist()
    d1s = torch.multinomial(Q1, N, replacement=True, generator=drafts).T.tolist()  # [N][d0]
    next_drafts = torch.multinomial(Q1, N, replacement=True, generator=drafts).T.tolist()  # [N][t0]
    tokens, n_first_accepted = [], 0
    for i in range(N):
        if drafter == "model":
            draft, q = [d0s[i], d1s[i][d0s[i]]], torch.stack([Q0, Q1[d0s[i]]])
        else:
            draft, q = [1, ngram_next(1)], None
        logits = torch.stack([L0, L1[draft[0]], L1[draft[1]]])  # the last row's values do not matter here
        emitted = verify_with(mode, sampler, logits, draft, q)
        n_first_accepted += len(emitted) > 1
        if len(emitted) == 1:  # the next step drafts after the recovered token
            t0 = emitted[0]
            draft2, q2 = ([next_drafts[i][t0]], Q1[t0][None]) if drafter == "model" else ([ngram_next(t0)], None)
            emitted += verify_with(mode, sampler, torch.stack([L1[t0], L0]), draft2, q2)
        tokens.append(emitted[:2])
    return torch.tensor(tokens), n_first_accepted / N


def total_variation(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a - b).abs().sum())


def test_toy_model_is_a_meaningful_check():
    p0, p1 = target_probs()
    assert (p0 == 0).any() and (p0 > 0).sum() >= 4  # the filters bite, and there is still something to sample
    assert total_variation(p0, Q0) > 0.3
    assert min(total_variation(p1[t], Q1[t]) for t in range(V)) > 0.3


@pytest.mark.parametrize("drafter", ["model", "ngram"])
@pytest.mark.parametrize("mode", ["match", "rejection"])
def test_emitted_tokens_follow_the_target_distribution(mode, drafter):
    tokens, _ = run_trials(mode, drafter)
    p0, p1 = target_probs()
    joint = p0[:, None] * p1  # [t0, t1]
    first = torch.bincount(tokens[:, 0], minlength=V).float() / N
    second = torch.bincount(tokens[:, 1], minlength=V).float() / N
    pairs = torch.bincount(tokens[:, 0] * V + tokens[:, 1], minlength=V * V).float().view(V, V) / N
    assert total_variation(first, p0) < 0.025
    assert total_variation(second, joint.sum(0)) < 0.025
    assert total_variation(pairs, joint) < 0.04
    assert pairs[joint == 0].sum() == 0  # never a token the target's filters removed


def test_rejection_accepts_more_than_match():
    p0, _ = target_probs()
    match = run_trials("match", "model")[1]
    rejection = run_trials("rejection", "model")[1]
    # theory for the first position: match accepts w.p. sum(q p), rejection w.p. sum(min(p, q))
    assert abs(match - float((Q0 * p0).sum())) < 0.015
    assert abs(rejection - float(torch.minimum(Q0, p0).sum())) < 0.015
    assert rejection > match + 0.05
    # for a one-hot (n-gram) draft both accept w.p. p(x)
    for mode in ("match", "rejection"):
        assert abs(run_trials(mode, "ngram")[1] - float(p0[1])) < 0.015


def test_rejection_without_filters_follows_the_target():
    # top-k off and top-p 1: the candidates are the whole vocabulary (the other layout of the compact rows).
    # 5000 one-token drafts: first-token TV tolerance 0.03 (noise about 0.01)
    params = SamplingParams(temp=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=5)
    sampler, drafts = Sampler(params, V), torch.Generator().manual_seed(6)
    d0s = torch.multinomial(Q0, 5000, replacement=True, generator=drafts).tolist()
    logits = torch.stack([L0, L0])
    first = [verify_rejection(sampler, logits, [d], Q0[None])[0] for d in d0s]
    empirical = torch.bincount(torch.tensor(first), minlength=V).float() / 5000
    assert total_variation(empirical, torch.softmax(L0, dim=0)) < 0.03


# -- mode choice and bad input ------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode, has_probs, greedy, expected", [
    ("auto", True, False, "rejection"), ("auto", False, False, "match"), ("auto", True, True, "match"),
    ("match", True, False, "match"), ("rejection", False, True, "rejection"),
])
def test_choose_mode(mode, has_probs, greedy, expected):
    assert choose_mode(mode, has_probs, greedy) == expected


def test_unknown_mode_and_bad_shapes():
    with pytest.raises(UsageError):
        choose_mode("typical", True, False)
    sampler = Sampler(SamplingParams(temp=0.0), 16)
    with pytest.raises(ValueError):
        verify_match(sampler, greedy_rows(1, 2), [1, 2])
    with pytest.raises(ValueError):
        verify_rejection(sampler, greedy_rows(1, 2, 3), [1])
