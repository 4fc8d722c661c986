"""The sampler chain keeps llama.cpp's maths and order, and its random state is reproducible per seed."""

import math

import pytest
import torch

from spec_cli.errors import UsageError
from spec_cli.model.sampling import Sampler, SamplingParams, apply_penalties, draw

# a chain with every filter off: probs == softmax(logits / temp)
PLAIN = {"top_k": 0, "top_p": 1.0, "min_p": 0.0, "temp": 1.0}


def kept(sampler: Sampler, logits: list[float]) -> set[int]:
    return set(torch.nonzero(sampler.probs(torch.tensor(logits)) > 0).flatten().tolist())


def test_greedy_is_the_argmax_and_a_one_hot():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    sampler = Sampler(SamplingParams(temp=0.0, seed=1), 50)
    best = int(logits.argmax())
    assert sampler.greedy
    assert sampler.sample(logits) == best
    assert torch.equal(sampler.probs(logits), torch.nn.functional.one_hot(torch.tensor(best), 50).float())
    assert sampler.argmax_rows(torch.stack([logits, -logits])) == [best, int((-logits).argmax())]


def test_top_k_keeps_the_k_best():
    sampler = Sampler(SamplingParams(**{**PLAIN, "top_k": 3}), 6)
    assert kept(sampler, [0.1, 2.0, -1.0, 1.5, 3.0, 0.0]) == {1, 3, 4}


def test_top_p_keeps_the_shortest_prefix_reaching_p():
    probs = [0.1, 0.4, 0.2, 0.3]  # sorted: 0.4 (1), 0.3 (3), 0.2 (2), 0.1 (0)
    logits = [math.log(p) for p in probs]
    assert kept(Sampler(SamplingParams(**{**PLAIN, "top_p": 0.35}), 4), logits) == {1}
    assert kept(Sampler(SamplingParams(**{**PLAIN, "top_p": 0.65}), 4), logits) == {1, 3}
    assert kept(Sampler(SamplingParams(**{**PLAIN, "top_p": 0.75}), 4), logits) == {1, 3, 2}
    # llama.cpp applies top-p before temperature, so a hotter temperature keeps the same set
    assert kept(Sampler(SamplingParams(**{**PLAIN, "top_p": 0.65, "temp": 3.0}), 4), logits) == {1, 3}
    # the kept tokens are renormalised among themselves
    p = Sampler(SamplingParams(**{**PLAIN, "top_p": 0.65}), 4).probs(torch.tensor(logits))
    assert torch.allclose(p, torch.tensor([0.0, 4 / 7, 0.0, 3 / 7]))


def test_min_p_drops_tokens_below_a_fraction_of_the_best():
    logits = [math.log(p) for p in [0.5, 0.3, 0.12, 0.08]]
    assert kept(Sampler(SamplingParams(**{**PLAIN, "min_p": 0.2}), 4), logits) == {0, 1, 2}  # threshold 0.10
    assert kept(Sampler(SamplingParams(**{**PLAIN, "min_p": 0.5}), 4), logits) == {0, 1}  # threshold 0.25


def test_filters_chain_in_llama_cpp_order():
    # top-k 3 leaves {0,1,2} with renormalised probs 0.5/0.3/0.2 -> top-p 0.75 drops 2 -> min-p 0.7 drops 1
    logits = [math.log(p) for p in [0.4, 0.24, 0.16, 0.12, 0.08]]
    assert kept(Sampler(SamplingParams(top_k=3, top_p=1.0, min_p=0.0, temp=1.0), 5), logits) == {0, 1, 2}
    assert kept(Sampler(SamplingParams(top_k=3, top_p=0.75, min_p=0.0, temp=1.0), 5), logits) == {0, 1}
    assert kept(Sampler(SamplingParams(top_k=3, top_p=0.75, min_p=0.7, temp=1.0), 5), logits) == {0}


def test_temperature_scales_the_kept_logits():
    logits = torch.tensor([1.0, 0.0, -1.0])
    p = Sampler(SamplingParams(**{**PLAIN, "temp": 0.5}), 3).probs(logits)
    assert torch.allclose(p, torch.softmax(logits / 0.5, dim=0))


def test_penalties_by_hand():
    # history [0, 1, 1, 3]: counts 0->1, 1->2, 3->1; repeat 2, frequency 0.5, presence 0.25
    params = SamplingParams(**PLAIN, repeat_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0])
    expected = torch.tensor([
        2.0 / 2 - 1 * 0.5 - 0.25,  # positive logit: divided
        -1.0 * 2 - 2 * 0.5 - 0.25,  # non-positive logit: multiplied
        0.5,  # never seen: unchanged
        3.0 / 2 - 1 * 0.5 - 0.25,
        -2.0,
    ])
    counts = torch.tensor([1.0, 2.0, 0.0, 1.0, 0.0])
    assert torch.allclose(apply_penalties(logits, counts, params), expected)
    sampler = Sampler(params, 5)
    for token in [0, 1, 1, 3]:
        sampler.accept(token)
    assert torch.allclose(sampler.probs(logits), torch.softmax(expected, dim=0))


def test_penalty_window_forgets_old_tokens():
    params = SamplingParams(**PLAIN, repeat_penalty=2.0, repeat_last_n=2)
    sampler = Sampler(params, 5)
    for token in [0, 1, 1, 3]:  # only [1, 3] are in the window
        sampler.accept(token)
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0])
    expected = torch.tensor([2.0, -2.0, 0.5, 1.5, -2.0])
    assert torch.allclose(sampler.probs(logits), torch.softmax(expected, dim=0))
    assert not Sampler(SamplingParams(repeat_penalty=2.0, repeat_last_n=0), 5).has_penalties


def test_penalties_move_the_greedy_choice():
    sampler = Sampler(SamplingParams(temp=0.0, repeat_penalty=4.0), 3)
    logits = torch.tensor([2.0, 1.0, 0.0])
    assert sampler.sample(logits) == 0
    sampler.accept(0)
    assert sampler.sample(logits) == 1
    # rows of a verify batch see the history extended by the draft before them
    assert sampler.argmax_rows(torch.stack([logits, logits]), prefix=[1]) == [1, 0]


def test_verify_rows_see_the_prefix_without_changing_the_sampler():
    params = SamplingParams(top_k=5, repeat_penalty=1.5, presence_penalty=0.3, seed=0)
    logits = 2 * torch.randn(3, 20, generator=torch.Generator().manual_seed(1))
    logits[:, 4] = logits[:, 7] = 4.0  # the prefix tokens are strong candidates, so penalizing them shows
    sampler = Sampler(params, 20)
    before = sampler.probs(logits[0])
    probs, ids = sampler.candidates_rows(logits, [4, 7])
    sequential = sampler.clone()
    for i, row in enumerate(logits):
        dense = torch.zeros(20).scatter_(0, ids[i], probs[i])
        assert torch.allclose(dense, sequential.probs(row))
        sequential.accept([4, 7, 0][i])
    assert not torch.allclose(sequential.probs(logits[0]), before)  # the prefix does change the distribution
    assert torch.equal(sampler.probs(logits[0]), before)  # but candidates_rows left the sampler's history alone


def test_ignore_eos_removes_end_of_generation_tokens():
    logits = torch.tensor([0.0, 5.0, 1.0, 4.0])
    sampler = Sampler(SamplingParams(**PLAIN, ignore_eos=True, seed=3), 4, eog_ids=[1, 3])
    assert kept(sampler, logits.tolist()) == {0, 2}
    assert Sampler(SamplingParams(temp=0.0, ignore_eos=True), 4, eog_ids=[1, 3]).sample(logits) == 2
    assert Sampler(SamplingParams(temp=0.0), 4, eog_ids=[1, 3]).sample(logits) == 1  # only with ignore_eos


def sample_sequence(sampler: Sampler, logits: torch.Tensor) -> list[int]:
    """Sample and commit one token per row, as the step loop does."""
    tokens = []
    for row in logits:
        tokens.append(sampler.sample(row))
        sampler.accept(tokens[-1])
    return tokens


def test_same_seed_same_tokens_and_clone_continues_identically():
    logits = torch.zeros(40, 100)  # uniform: any change in the random stream shows
    params = SamplingParams(**PLAIN, seed=1234)
    first = sample_sequence(Sampler(params, 100), logits)
    assert first == sample_sequence(Sampler(params, 100), logits)
    assert len(set(first)) > 10  # the draws do move

    sampler = Sampler(params, 100)
    sample_sequence(sampler, logits[:7])
    twin = sampler.clone()
    assert sample_sequence(twin, logits) == sample_sequence(sampler, logits)

    sampler.reset()  # reseeds with the same fixed seed
    assert sample_sequence(sampler, logits) == first


def test_a_tokens_draw_depends_on_its_position_not_on_earlier_draws():
    """Draws come from (seed, position) streams: drawing again before accepting (a rejected verify row, a re-verified
    draft) changes nothing that follows."""
    logits = torch.zeros(30, 100)
    params = SamplingParams(**PLAIN, seed=99)
    plain = sample_sequence(Sampler(params, 100), logits)
    busy = Sampler(params, 100)
    tokens = []
    for row in logits:
        for _ in range(3):
            busy.sample(row)  # discarded draws
        tokens.append(busy.sample(row))
        busy.accept(tokens[-1])
    assert tokens == plain
    other_seed = sample_sequence(Sampler(SamplingParams(**PLAIN, seed=100), 100), logits)
    assert other_seed != plain


def test_clone_copies_the_penalty_history():
    sampler = Sampler(SamplingParams(temp=0.0, repeat_penalty=4.0), 3)
    twin = sampler.clone()
    sampler.accept(0)
    logits = torch.tensor([2.0, 1.0, 0.0])
    assert (sampler.sample(logits), twin.sample(logits)) == (1, 0)
    assert sampler.clone().sample(logits) == 1


def test_different_seeds_differ_and_minus_one_is_random():
    logits = torch.zeros(40, 100)
    a = sample_sequence(Sampler(SamplingParams(**PLAIN, seed=1), 100), logits)
    b = sample_sequence(Sampler(SamplingParams(**PLAIN, seed=2), 100), logits)
    assert a != b
    r1, r2 = Sampler(SamplingParams(**PLAIN), 100), Sampler(SamplingParams(**PLAIN), 100)
    assert r1.seed != r2.seed  # 32-bit random seeds: equal with probability 2^-32
    assert sample_sequence(r1, logits) != sample_sequence(r2, logits)


def test_draws_follow_the_distribution():
    # the chain's distribution, then 20000 draws in one call: total variation within 0.02 (expected ~0.008)
    p = Sampler(SamplingParams(top_k=5, top_p=1.0, min_p=0.0, seed=0), 8).probs(torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, 3.0]))
    assert (p > 0).sum() == 5
    generator = torch.Generator().manual_seed(7)
    tokens = draw(p.expand(20000, 8), generator)
    empirical = torch.bincount(tokens, minlength=8).float() / 20000
    assert 0.5 * (empirical - p).abs().sum() < 0.02
    assert empirical[p == 0].sum() == 0


@pytest.mark.parametrize("bad", [
    {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": -1}, {"min_p": -0.1}, {"min_p": 2.0}, {"repeat_penalty": 0.0},
    {"repeat_last_n": -2}, {"seed": -2}, {"temp": float("nan")}, {"presence_penalty": float("inf")},
])
def test_bad_values_are_usage_errors(bad):
    with pytest.raises(UsageError):
        SamplingParams(**bad).validate()
    with pytest.raises(UsageError):
        Sampler(SamplingParams(**bad), 10)


def test_defaults_are_llama_cpp_defaults():
    p = SamplingParams()
    assert (p.temp, p.top_k, p.top_p, p.min_p, p.seed) == (0.8, 40, 0.95, 0.05, -1)
    assert (p.repeat_penalty, p.repeat_last_n, p.presence_penalty, p.frequency_penalty) == (1.0, 64, 0.0, 0.0)
    assert not p.greedy and not p.has_penalties and not p.ignore_eos
