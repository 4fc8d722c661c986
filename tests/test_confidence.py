"""A model drafter's confidence under --draft-max auto (spec_cli/speculative/confidence.py): the planner learns how
often tokens of each confidence are accepted, values a draft by its own tokens' confidence, and gates drafting where
the next token stops paying, cheap heads drafting on past tokens a dear draft model stops at. Lossless throughout."""

from __future__ import annotations

import pytest

from spec_cli.options import DRAFT_P_MIN
from spec_cli.speculative.adaptive import AUTO_DRAFT_MAX, Planner
from spec_cli.speculative.base import DraftParams
from spec_cli.speculative.confidence import BIN_MIDDLES, ConfidenceModel, DraftGate, confidence_bin
from spec_cli.speculative.verify_costs import CostModel

N = AUTO_DRAFT_MAX
from tests.draft_recorder import record_drafts
from tests.server_harness import make_session
from tests.test_adaptive import auto_session, planner_with
from tests.test_generate import assert_greedy_equals_plain, plain_outputs  # noqa: F401 (plain_outputs: fixture)


def qwen15_costs() -> CostModel:
    costs = CostModel()  # qwen2.5-coder-1.5b's verify curve (ms), 2 threads
    costs.set_points({1: 32.1, 2: 34.3, 3: 34.0, 4: 35.0, 6: 43.5, 8: 53.6, 12: 74.1, 16: 91.5})
    return costs


def drafted(p: DraftParams, confidences: list[float], p_min: float = 0.0) -> int:
    """Tokens a token-by-token drafter keeps for p (draft_model.py's loop) when its tokens come with these
    confidences."""
    for i, c in enumerate(confidences):
        if not p.keeps(c, p_min):
            break
        p.add(i, c)
        if not p.goes_on(N):
            break
    return len(p.result)


def test_calibration_learns_acceptance_per_confidence_and_starts_from_the_confidence():
    model = ConfidenceModel()
    assert model.rates("x") == BIN_MIDDLES
    for _ in range(300):
        model.observe("x", [0.99, 0.97, 0.65], 2)  # the sure tokens accepted, the unsure one rejected
        model.observe("x", [0.65, 0.99], 0)  # the first rejected: the second was never tried
    rates = model.rates("x")
    assert rates[confidence_bin(0.99)] > 0.95 and rates[confidence_bin(0.97)] > 0.95
    assert rates[confidence_bin(0.65)] < 0.05
    assert rates[confidence_bin(0.45)] == BIN_MIDDLES[confidence_bin(0.45)]  # never seen: its prior


def test_a_draft_is_valued_by_its_tokens_confidence():
    planner = planner_with(CostModel(), {"x": 0.95})
    planner.costs.set_points({1: 1.0, 2: 1.05, 3: 1.1, 4: 1.15, 16: 2.0})
    for _ in range(300):
        planner.observe_accept("x", 3, 2, [0.99, 0.99, 0.65])  # a 0.65 token is rejected, 0.99 ones accepted
    assert planner.plan([("x", 4)], 0.0) == [4]  # by position: 95 % each
    assert planner.plan([("x", 4)], 0.0, [[0.99, 0.99, 0.65, 0.99]]) == [2]  # not past the unsure token
    assert planner.plan([("x", 4)], 0.0, [[]]) == [4]  # an n-gram drafter's draft has none: by position


def test_a_cheap_head_drafts_on_where_a_dear_draft_model_stops():
    """The same confidences, the same verify curve: an EAGLE-3-like head (3.5 ms a token against a 32 ms target
    forward) drafts past tokens that a draft model (13 ms) stops at, and keeps an unsure first token that p-min 0.75
    would have dropped."""
    def gate(ms_per_forward: float) -> DraftGate:
        planner = planner_with(qwen15_costs(), {"x": 0.7})
        for _ in range(50):
            planner.confidence.observe("x", [0.9, 0.9], 1)  # tokens of 0.9 accepted half the time
        planner.observe_drafting("x", 0.0, [(1, 1)])  # the first call is not priced
        planner.observe_drafting("x", ms_per_forward * 3, [(2, 3)])  # 3 forwards
        return planner.gate("x", 1)

    cheap, dear = gate(3.5), gate(13.0)
    assert cheap.forward < dear.forward
    confidences = [0.9, 0.85, 0.9, 0.8, 0.9, 0.85]
    n_cheap = drafted(DraftParams(0, N, 0, 0, [], gate=cheap), confidences)
    n_dear = drafted(DraftParams(0, N, 0, 0, [], gate=dear), confidences)
    assert n_cheap > n_dear >= 1
    assert drafted(DraftParams(0, N, 0, 0, [], gate=cheap), [0.6, 0.9]) == 2
    assert drafted(DraftParams(0, N, 0, 0, [], gate=cheap), [0.6, 0.9], p_min=0.75) == 0  # the user's floor


def test_a_token_that_cannot_pay_for_its_row_is_not_kept():
    hopeless = DraftGate(rates=BIN_MIDDLES, row=(2.0,) * N, ahead=1.0, forward=0.0)
    assert drafted(DraftParams(0, N, 0, 0, [], gate=hopeless), [0.999] * 4) == 0
    assert drafted(DraftParams(0, N, 0, 0, []), [0.999] * 4) == 4  # no gate: p-min and the cap alone


@pytest.mark.parametrize("chain", ["draft-simple", "ngram-simple,draft-simple"])
def test_the_gate_stops_a_draft_model_and_greedy_output_stays_plain(tiny_model_path, tiny_close_draft_path,
                                                                    plain_outputs, monkeypatch, chain):  # noqa: F811
    """A gate that goes on after the first token and not after the second: every draft of the draft model has at
    most 2 tokens (some exactly 2), and the output is plain decoding's."""
    two = DraftGate(rates=(1.0,) * len(BIN_MIDDLES), row=(0.0, 0.0) + (10.0,) * (N - 2), ahead=1.0, forward=0.5)
    monkeypatch.setattr(Planner, "gate", lambda self, name, n_seq: two)
    session = auto_session(tiny_model_path, chain, tiny_close_draft_path)
    calls = record_drafts(session)
    assert_greedy_equals_plain(session, plain_outputs)
    lengths = {len(draft) for _, _, draft in calls}
    assert lengths and max(lengths) == 2


def test_the_planner_learns_the_confidence_of_the_drafts_it_verifies(tiny_model_path, tiny_close_draft_path,
                                                                     plain_outputs):  # noqa: F811
    session = auto_session(tiny_model_path, "draft-simple", tiny_close_draft_path)
    assert_greedy_equals_plain(session, plain_outputs)
    counts = session.chain.planner.confidence.counts["draft-simple"]
    assert sum(trials for _, trials, _ in counts) > 0


def test_p_min_auto_is_the_gate_where_there_is_one_and_llama_cpps_floor_where_not():
    gate = DraftGate(rates=BIN_MIDDLES, row=(0.0,) * N, ahead=1.0, forward=0.0)
    assert DraftParams(0, N, 0, 0, [], gate=gate).p_floor("auto") == 0.0  # --draft-max auto
    assert DraftParams(0, N, 0, 0, []).p_floor("auto") == DRAFT_P_MIN  # a fixed --draft-max
    assert DraftParams(0, N, 0, 0, [], gate=gate).p_floor(0.75) == 0.75  # given: a floor under the gate too
    assert DraftParams(0, N, 0, 0, [], gate=gate, p_min=0.5).p_floor("auto") == 0.5  # a request's own


@pytest.mark.parametrize("p_min", ["auto", 0.75])
def test_a_draft_model_under_auto_drafts_below_0_75_where_its_gate_keeps_the_tokens(
        tiny_model_path, tiny_close_draft_path, plain_outputs, monkeypatch, p_min):  # noqa: F811
    """--draft-p-min auto (the default) with --draft-max auto: the draft model keeps tokens of top-1 probability
    below llama.cpp's 0.75 where its gate keeps them (here a gate that keeps every token); a p-min given stays a
    floor. Greedy output is plain decoding's either way."""
    keep_all = DraftGate(rates=(1.0,) * len(BIN_MIDDLES), row=(0.0,) * N, ahead=1.0, forward=0.0)
    monkeypatch.setattr(Planner, "gate", lambda self, name, n_seq: keep_all)
    session = make_session(tiny_model_path, 1, "draft-simple", draft=tiny_close_draft_path, draft_max=N,
                           adaptive=True, draft_p_min=p_min)
    drafter, confidences = session.chain.drafters[-1], []
    inner = drafter.draft

    def draft(params):
        inner(params)
        confidences.extend(c for p in params for c in p.confidence)

    drafter.draft = draft
    assert_greedy_equals_plain(session, plain_outputs)
    if p_min == "auto":
        assert confidences and min(confidences) < DRAFT_P_MIN
    else:
        assert confidences and min(confidences) >= 0.75
