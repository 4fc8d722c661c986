"""--draft-max auto (spec_cli/speculative/adaptive.py): the planner's math, the acceptance and cost models, and the
invariant that matters most: cutting drafts to their planned length never changes greedy output, for every drafter
type, one and four sequences at once. Plus the flag, in the CLI and in bench sweeps."""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from spec_cli.bench.params import from_flags
from spec_cli.bench.runner import run_bench
from spec_cli.cli import app
from spec_cli.model import kernels
from spec_cli.model.batch import Batch
from spec_cli.model.context import Context
from spec_cli.model.sampling import SamplingParams
from spec_cli.options import AUTO, BENCH_OPTIONS, read_flags
from spec_cli.speculative import adaptive, verify_costs
from spec_cli.speculative.adaptive import (
    AUTO_DRAFT_MAX,
    FIRST_PROBE_AFTER,
    GATED_EXTRA,
    JUDGED_DRAFTS,
    JUDGED_PROBES,
    PROBE_BUDGET,
    PROBE_GAP_MAX,
    PROBE_GAP_MIN,
    AcceptanceModel,
    DraftCost,
    Planner,
    expected_tokens,
    forwards,
)
from spec_cli.speculative.base import Drafter, DraftParams
from spec_cli.speculative.chain import Chain
from spec_cli.speculative.verify_costs import CostModel
from tests.test_bench_run import prompt_file, tiny  # noqa: F401 (fixture)
from tests.test_cli import PROMPT, cli
from tests.test_generate import (  # noqa: F401 (plain_outputs is a fixture)
    GREEDY,
    N_PREDICT,
    PROMPTS,
    assert_greedy_equals_plain,
    make_session,
    plain_outputs,
    run,
)
from tests.test_generate_sampling import exact_two_token_distribution
from tests.tiny_mtp import write_tiny_mtp_gguf


def flat(seconds: float = 1.0) -> CostModel:
    costs = CostModel()
    costs.set_points({1: seconds, 64: seconds})
    return costs


def steep() -> CostModel:
    """Every extra row costs as much as a whole forward: sequential decoding, speculation cannot pay."""
    costs = CostModel()
    costs.set_points({1: 1.0, 64: 64.0})
    return costs


def planner_with(costs: CostModel, rates: dict[str, float], ragged: bool = False) -> Planner:
    """A planner whose drafters have the given constant conditional acceptance at every position, known from drafts
    the target has judged."""
    planner = Planner(costs, ragged=ragged)
    know_rates(planner, rates)
    planner.n_verified = dict.fromkeys(rates, JUDGED_DRAFTS)
    return planner


def know_rates(planner: Planner, rates: dict[str, float]) -> None:
    """The recent and long-run estimates of each drafter: its constant acceptance, known without uncertainty."""
    planner.acceptance.gains = lambda name, z=0.0: [rates[name] ** j for j in range(1, AUTO_DRAFT_MAX + 1)]
    planner.long_run.gains = planner.acceptance.gains  # z, the uncertainty to add, is 0


# --- the models ----------------------------------------------------------------------------------------------

def test_expected_tokens_counts_the_target_token_and_the_chain_of_acceptances():
    gains = [0.5, 0.25, 0.125]  # a_i = 0.5 at every position
    assert [expected_tokens(gains, k) for k in range(4)] == [1.0, 1.5, 1.75, 1.875]


def test_acceptance_update_follows_the_conditional_definition():
    model = AcceptanceModel()
    assert model.rates("x")[:3] == [0.5, 0.5, 0.5]  # the prior
    model.observe("x", 4, 2)  # positions 1, 2 accepted, 3 rejected, 4 never tried (its condition failed)
    w = adaptive.PRIOR_WEIGHT * adaptive.ACCEPT_DECAY  # the prior's weight after one observation
    d = adaptive.DEPTH_PRIOR_WEIGHT * adaptive.ACCEPT_DECAY  # a deeper position's borrowed prior weighs more
    a1 = (1 + w * 0.5) / (1 + w)
    a2 = (1 + d * a1) / (1 + d)
    a3 = (0 + d * a2) / (1 + d)
    assert model.rates("x")[:4] == pytest.approx([a1, a2, a3, a3])  # position 4 borrows from position 3
    assert model.gains("x")[:3] == pytest.approx([a1, a1 * a2, a1 * a2 * a3])
    assert model.rates("y")[0] == 0.5  # per drafter


def test_a_few_short_accepted_drafts_do_not_buy_a_long_one():
    """Accepted drafts of 1 and then 2 tokens (an n-gram drafter on prose): the positions never verified borrow
    from the ones before, but as a guess, not as evidence: the planner does not jump to a long draft (it planned 10
    tokens here; on chat and summarize prompts ngram-cache's 8-token drafts were rejected at the first)."""
    costs = CostModel()  # qwen2.5-coder-1.5b's curve on 2 cores (ms): a 2-row verify costs 1.5 decodes
    costs.set_points({1: 29.3, 2: 44.8, 3: 58.2, 4: 73.1, 6: 100.2, 8: 125.0, 12: 175.0, 16: 225.0})
    planner = Planner(costs)
    planner.observe_accept("ngram-cache", 1, 1)
    planner.observe_accept("ngram-cache", 2, 2)
    assert 1 <= planner.plan([("ngram-cache", 16)], 0.0)[0] <= 3  # was 10


def test_acceptance_decays_so_it_follows_a_change_of_text():
    model = AcceptanceModel()
    for _ in range(100):
        model.observe("x", 4, 4)
    assert model.rates("x")[0] > 0.99  # the prior is forgotten: an always-right drafter gets long drafts
    for _ in range(20):
        model.observe("x", 4, 0)
    assert model.rates("x")[0] < 0.15  # the good past weighs 0.9^20 = 12 % after 20 drafts
    _, trials, _ = model.counts["x"][0]
    assert trials < 1 / (1 - adaptive.ACCEPT_DECAY)  # the memory is bounded


def test_cost_interpolates_between_points_and_extrapolates_past_the_last():
    costs = CostModel()
    costs.set_points({1: 1.0, 4: 1.3, 8: 2.1})
    assert [costs(r) for r in (1, 2, 3, 4, 6, 8, 12)] == pytest.approx([1.0, 1.1, 1.2, 1.3, 1.7, 2.1, 2.9])
    single = CostModel()
    single.set_points({1: 2.0})
    assert single(3) == pytest.approx(6.0)


def test_cost_online_update_is_a_mean_with_the_curve_until_it_is_an_ema():
    """The first steps at a row count correct the calibration at once (it may come from another phase of the
    machine); later ones are an EMA, so one disturbed step cannot move the estimate far."""
    costs = CostModel()
    costs.set_points({1: 1.0, 4: 1.3})
    costs.observe(2, 2.1)
    assert costs(2) == pytest.approx((1.1 + 2.1) / 2)  # the curve counts as one sample
    costs.observe(2, 2.1)
    assert costs(2) == pytest.approx((1.1 + 2 * 2.1) / 3)
    for _ in range(200):
        costs.observe(2, 2.1)
    assert costs(2) == pytest.approx(2.1)
    costs.observe(2, 3.1)
    assert costs(2) == pytest.approx(2.1 + verify_costs.COST_EMA * 1.0)


def test_unseen_rows_move_with_the_nearest_observed_rows_by_the_lower_reading():
    """Steps above the calibration by a fixed gap (what a bare forward does not see) move unseen row counts by
    that gap, not in proportion; steps below it (a machine faster than when it was calibrated) move them in
    proportion, not by the gap: each time the lower reading, interpolated between observed row counts."""
    costs = CostModel()
    costs.set_points({1: 1.0, 4: 1.3, 8: 2.1})
    assert costs(3) == pytest.approx(1.2)  # nothing observed: the curve
    costs.observe(1, 1.4)  # 1.2: 0.2 (20 %) above the curve
    assert costs(3) == pytest.approx(1.2 + 0.2)  # beyond the observed rows: the nearest one's gap (not 1.2 x 1.2)
    costs.observe(4, 0.9)  # the mean of 1.5 (the curve moved by that gap) and 0.9: 1.2, 0.1 below the curve
    assert costs(2) == pytest.approx(1.1 + 0.2 - 0.3 / 3)  # between: the gaps interpolated
    assert costs(8) == pytest.approx(2.1 * 1.2 / 1.3)  # beyond: in proportion (the gap would read 2.0)


def test_a_curve_calibrated_in_a_slower_phase_does_not_make_long_verifies_look_dear():
    """A cached calibration taken when the machine ran at half today's speed (another phase, another load), steps
    then observed at 1 and 3 rows only: a 17-row verify reads half its calibrated time, as the short ones do. By
    the gap it read 9.7 one-row forwards where it costs 5.3, and ngram-mod's 16-token drafts, accepted whole, were
    cut to 2 tokens for good (issue 46)."""
    today = {1: 0.0145, 2: 0.018, 3: 0.020, 4: 0.028, 6: 0.034, 8: 0.040, 12: 0.058, 16: 0.075}
    costs = CostModel()
    costs.set_points({rows: 2 * seconds for rows, seconds in today.items()})
    for _ in range(20):
        costs.observe(1, today[1])
        costs.observe(3, today[3])
    assert costs(17) == pytest.approx(costs.curve(17) / 2, rel=0.02)  # 5.4 one-row forwards, not 10
    planner = planner_with(costs, {"ngram-mod": 0.995})
    assert planner.plan([("ngram-mod", 16)], 0.0) == [16]


def test_cold_copies_share_the_calibration():
    """A renewed session's cost model (cold) that calibrates calibrates the engine's, so the next renewal does not
    time forwards again inside its first request."""
    costs = CostModel()
    cold = costs.cold()
    cold.set_points({1: 1.0, 2: 1.5})
    cold.observe(2, 2.5)
    assert costs.calibrated and costs(2) == 1.5 and costs.cold()(2) == 1.5  # the steps' lessons stay apart


def test_draft_cost_is_seconds_per_forward():
    cost = DraftCost()
    assert cost.per_forward == 0.0  # unknown: optimistic until the first priced call
    cost.observe(5.0, 1)  # the first call pays one-time costs: not priced
    assert cost.per_forward == 0.0
    cost.observe(0.4, 4)
    assert cost.per_forward == pytest.approx(0.1)
    for _ in range(200):
        cost.observe(0.3, 1)
    assert cost.per_forward == pytest.approx(0.3, rel=1e-3)
    # a draft filling its cap of 4 ran 4 forwards (the last token is not decoded); stopped by p-min after 2 tokens,
    # 3 (the third's logits were computed); nothing drafted, its seed row
    assert [forwards(4, 4), forwards(2, 4), forwards(0, 4), forwards(0, 1)] == [4, 3, 1, 1]


def test_calibration_is_cheap_and_leaves_the_kv_cache_as_it_was(tiny_model_path):
    session = make_session(tiny_model_path, n_seq=2)
    ctx: Context = session.engine.ctx
    batch = Batch()
    for i, tok in enumerate(PROMPTS[0]):
        batch.add(tok, i, 1, i == len(PROMPTS[0]) - 1)
    before = ctx.decode(batch).logits
    t0 = time.perf_counter()
    session.engine.costs.calibrate(ctx, 1)
    elapsed = time.perf_counter() - t0
    assert ctx.lengths == [0, len(PROMPTS[0])]
    assert session.engine.costs.rows == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32]  # several sequences: wider batches too
    assert elapsed < 2.0  # ~0.1 s when the machine is idle
    ctx.seq_rm(1, len(PROMPTS[0]) - 1)
    again = Batch()
    again.add(PROMPTS[0][-1], len(PROMPTS[0]) - 1, 1, True)
    assert ctx.decode(again).logits[0].tolist() == pytest.approx(before[0].tolist(), abs=1e-5)


def test_calibration_keeps_the_fastest_of_its_repetitions(tiny_model_path, monkeypatch):
    """A 1-row forward disturbed in two of its timed repetitions (another process on the core) does not inflate the
    curve: the 1-row cost decides whether any draft pays, and no drafting step corrects it later."""
    session = make_session(tiny_model_path)
    ctx: Context = session.engine.ctx
    batch = Batch()
    for i, tok in enumerate(PROMPTS[0]):
        batch.add(tok, i, 0, False)
    ctx.decode(batch)
    rows: list[int] = []
    decode = ctx.decode
    monkeypatch.setattr(ctx, "decode", lambda b, **kw: (rows.append(len(b)), decode(b, **kw))[1])

    class Clock:  # 1 ms per row, a 1-row forward 5 ms when disturbed: its first two timed samples after the warmup
        now, calls = 0, 0

        def perf_counter_ns(self):
            self.calls += 1
            if self.calls % 2 == 0:  # the end of a timed forward
                n_one = rows.count(1)
                self.now += 5_000_000 if rows[-1] == 1 and n_one in (2, 3) else rows[-1] * 1_000_000
            return self.now

    monkeypatch.setattr(verify_costs, "time", Clock())
    session.engine.costs.calibrate(ctx, 0)
    assert session.engine.costs(1) == pytest.approx(0.001)
    assert session.engine.costs(2) == pytest.approx(0.002)


def test_calibration_is_cached_per_model_and_settings(tiny_model_path, tmp_path, monkeypatch):
    """A second engine on the same model file and settings reads the curve and times only the short verifies again
    (re-anchoring the rest); another sequence count or kernel build calibrates anew; an unreadable cache file is
    only a reason to calibrate."""
    cache = tmp_path / "verify-cost.json"
    monkeypatch.setattr("spec_cli.runtime.engine.verify_cost_cache", lambda: cache)

    def calibrated(n_seq: int):
        session = make_session(tiny_model_path, n_seq=n_seq)
        batch = Batch()
        for i, tok in enumerate(PROMPTS[0]):
            batch.add(tok, i, 0, False)
        session.engine.ctx.decode(batch)
        session.engine.costs.calibrate(session.engine.ctx, 0)
        return session.engine.costs

    first = calibrated(1)
    assert len(json.loads(cache.read_text())) == 1
    real_timer = verify_costs.time_forwards
    timed: list[int] = []

    def fake_timer(ctx, seq, ks, repetitions, rng, sync):  # 1 ms per row: the machine in another phase
        timed.extend(ks)
        return {k: [k * 1_000_000] * repetitions for k in ks}

    monkeypatch.setattr(verify_costs, "time_forwards", fake_timer)
    again = calibrated(1)
    assert set(timed) == set(verify_costs.REFRESH_ROWS)  # only the short verifies are timed again
    assert again.rows == first.rows and len(json.loads(cache.read_text())) == 1  # the cached curve is kept
    assert [again(k) for k in verify_costs.REFRESH_ROWS] == pytest.approx([0.001, 0.002, 0.003, 0.004])
    gap = 0.004 - first(4)  # longer verifies move with the longest one timed again
    assert [again(k) for k in (8, 16)] == pytest.approx([first(8) + gap, first(16) + gap])
    monkeypatch.setattr(verify_costs, "time_forwards", real_timer)
    assert calibrated(2).rows[-1] == 32 and len(json.loads(cache.read_text())) == 2
    monkeypatch.setattr(kernels, "_BUILD", "rebuilt")  # other kernels, other speeds: timed again
    calibrated(1)
    assert len(json.loads(cache.read_text())) == 3
    cache.write_text("{not json")
    assert calibrated(1).calibrated and len(json.loads(cache.read_text())) == 1


# --- the planner -----------------------------------------------------------------------------------------------

def test_no_draft_when_acceptance_is_low_and_rows_are_expensive():
    planner = planner_with(steep(), {"x": 0.05})
    assert planner.plan([("x", 8)], 0.0) == [0]
    planner.step = 10**6  # ...and no probe is due
    planner.next_probe["x"] = 2 * 10**6
    assert planner.drafting_caps(["x"], 1) == {"x": 0}


def test_long_drafts_when_acceptance_is_high_and_cost_is_flat():
    planner = planner_with(flat(), {"x": 0.99})
    assert planner.plan([("x", 16)], 0.0) == [16]
    assert planner.drafting_caps(["x"], 1) == {"x": AUTO_DRAFT_MAX}


def test_plan_respects_every_draft_length():
    planner = planner_with(flat(), {"x": 0.99, "y": 0.99})
    assert planner.plan([("x", 5), (None, 0), ("y", 2)], 0.0) == [5, 0, 2]


def test_a_costly_drafter_that_seldom_drafts_is_not_asked():
    """A draft model that stops below p-min gives no draft on most asks but pays its seed row every time: the
    planner weighs its gain by the fraction of asks that gave a draft (writing: 29 of 101 asks, 0.80x of plain)."""
    planner = planner_with(flat(), {"x": 0.97})
    planner.observe_drafting("x", 0.3, [(1, 1)])  # not priced (first call)
    planner.observe_drafting("x", 0.3, [(1, 1)])  # 0.3 forwards per ask
    assert planner.drafting_caps(["x"], 1)["x"] > 0  # a draft on every ask: worth it
    for _ in range(60):
        planner.observe_drafting("x", 0.3, [(0, AUTO_DRAFT_MAX)])  # asked, no draft
    planner.observe_drafting("x", 1.8, [(2, AUTO_DRAFT_MAX)] + [(0, AUTO_DRAFT_MAX)] * 3)  # one short draft
    assert planner.reach["x"][0] < 0.3
    assert planner.drafting_caps(["x"], 1) == {"x": 0}  # planned at 0: not asked, its probes a shortest gap away
    free = planner_with(flat(), {"x": 0.97})  # the same yield costs nothing to a drafter whose asks are free
    free.reach["x"] = planner.reach["x"]
    assert free.drafting_caps(["x"], 1)["x"] > 1


def test_a_draft_model_is_priced_by_how_far_its_drafts_reach():
    """A draft model stopped by p-min drafts short: on chat (the 0.5b for the 1.5b, draft-max 4) half its asks gave
    no draft, a draft reached positions 2, 3 and 4 on 33, 19 and 15 % of asks, 88 % of its tokens were accepted, and
    it ran at 1.12-1.16x of plain. Its asks cost the forwards they ran, not draft-max of them: priced as if every ask
    drafted k tokens, it was never asked."""
    costs = CostModel()  # the 1.5b's curve (ms) in that run, one draft forward 11.5 ms
    costs.set_points({1: 32.1, 2: 34.3, 3: 34.0, 4: 35.0, 6: 43.5, 8: 53.6, 12: 74.1, 16: 91.5})
    planner = planner_with(costs, {"x": 0.0})
    planner.acceptance.gains = lambda name: [0.95, 0.88, 0.68, 0.49] + [0.0] * (AUTO_DRAFT_MAX - 4)
    # drafts of 0, 1, 2, 3 and 4 tokens on 10, 3, 3, 1 and 3 asks of 20: positions 1-4 reached on 50, 35, 20, 15 %
    asks = [(n, 4) for n in (0, 1, 0, 2, 0, 4, 0, 1, 0, 2, 0, 3, 0, 4, 0, 1, 0, 2, 0, 4)]
    planner.observe_drafting("x", 9.0, [(1, 4)])  # the first call is not priced
    for lengths in asks * 20:
        planner.observe_drafting("x", 11.5 * forwards(*lengths), [lengths])
    assert planner.draft_costs["x"].per_forward == pytest.approx(11.5)
    assert planner.drafting_caps(["x"], 1)["x"] >= 2


def test_a_model_drafter_is_probed_until_the_target_has_judged_its_drafts():
    """Asks stopped by p-min say how seldom a draft model drafts, not how well: planned at 0 before the target has
    judged JUDGED_DRAFTS of its drafts, it is probed at every step (up to JUDGED_PROBES times), not after the gap
    a probe's price sets. On chat its first asks come at the start of an answer, where p-min stopped them: it fell
    to 0 on the prior and its next probe was 256 steps away."""
    planner = Planner(flat())
    planner.observe_drafting("x", 9.0, [(1, 1)])  # the first call is not priced
    for _ in range(4):
        planner.observe_drafting("x", 0.6, [(0, 2)])  # dear, and stopped by p-min
    assert [planner.drafting_caps(["x"], 1)["x"] for _ in range(3)] == [1, 1, 1]  # probed at once, step after step
    for _ in range(JUDGED_DRAFTS):
        planner.observe_accept("x", 1, 0)  # judged: wrong
    probes = [planner.drafting_caps(["x"], 1)["x"] for _ in range(PROBE_GAP_MIN)]
    assert sum(probes) <= 1  # now on the priced schedule
    never = Planner(flat())  # a drafter p-min always stops is probed JUDGED_PROBES times, then on the schedule
    never.observe_drafting("x", 9.0, [(0, 1)])
    never.observe_drafting("x", 0.6, [(0, 1)])
    probes = [never.drafting_caps(["x"], 1)["x"] for _ in range(2 * JUDGED_PROBES)]
    assert probes[:JUDGED_PROBES] == [1] * JUDGED_PROBES and sum(probes[JUDGED_PROBES:]) <= 1


def test_a_drafter_dropped_on_little_evidence_is_probed_until_its_estimates_can_tell():
    """Judged on three drafts (3 of 3 accepted, then 0 of 6 and 0 of 2) a draft model at 0.4 of a target forward
    falls to 0; while its estimates, raised by their uncertainty, still say it may pay, it is probed at once: right,
    it is back the next step; wrong, its probes stop after two."""
    def caps_after_unlucky_drafts(probe_accepted: bool) -> list[int]:
        planner = Planner(flat())
        planner.observe_drafting("x", 9.0, [(1, 1)])  # the first call is not priced
        planner.observe_drafting("x", 0.4, [(1, 1)])
        for n, accepted in ((3, 3), (6, 0), (2, 0)):
            planner.drafting_caps(["x"], 1)
            planner.observe_accept("x", n, accepted)
        caps = []
        for _ in range(PROBE_GAP_MIN):
            caps.append(planner.drafting_caps(["x"], 1)["x"])
            if caps[-1]:
                planner.observe_accept("x", 1, int(probe_accepted))
        return caps

    right = caps_after_unlucky_drafts(True)
    assert right[:2] == [1, 2] and min(right[1:]) >= 2  # probed, then planned again
    wrong = caps_after_unlucky_drafts(False)
    assert 1 <= sum(wrong) <= 2 and wrong[:sum(wrong)] == [1] * sum(wrong)  # a probe or two, then dropped


def test_a_model_drafter_is_asked_only_clear_of_break_even():
    """Asking a draft model costs its forwards: planned at 1.02x of plain it is not asked (estimates move by more
    than that from step to step); at 1.1x it is (for its planned token and GATED_EXTRA more, which its gate stops
    where they do not pay), and a free drafter with the same numbers is asked at 1.02x."""
    costs = CostModel()
    costs.set_points({1: 1.0, 2: 1.2, 3: 2.2, 64: 63.2})

    def cap(seconds_per_token: float, free: bool) -> int:
        planner = planner_with(costs, {"x": 0.5})
        planner.observe_drafting("x", 9.0, [(1, 1)])  # the first call is not priced
        planner.observe_drafting("x", seconds_per_token, [(1, 1)])
        return planner.drafting_caps(["x"], 1, frozenset({"x"}) if free else frozenset())["x"]

    # one draft token: 1.5 expected tokens per 1.2 + its price, against 1 per 1.0
    assert cap(0.27, free=False) == 0  # 1.02x
    assert cap(0.16, free=False) == 1 + GATED_EXTRA  # 1.10x
    assert cap(0.27, free=True) == AUTO_DRAFT_MAX  # asked for its whole draft, which `plan` cuts


def test_draft_cost_caps_drafting_but_a_paid_draft_is_verified():
    # E(k) / (1 + 0.5 k) with a = 0.9 peaks at k = 3 (1.376) before k = 4 (1.365)
    planner = planner_with(flat(), {"x": 0.9})
    planner.observe_drafting("x", 9.0, [(1, 1)])  # the first call (one-time costs) is not priced
    assert planner.drafting_caps(["x"], 1) == {"x": AUTO_DRAFT_MAX}
    planner.observe_drafting("x", 0.5, [(1, 1)])
    assert planner.drafting_caps(["x"], 1) == {"x": 3 + GATED_EXTRA}  # what its gate may still stop
    assert planner.plan([("x", 8)], 4.0) == [8]  # drafting is spent: verifying all 8 costs nothing more


def test_a_block_drafter_is_priced_per_call_and_its_length_follows_the_verify_cost():
    """A block drafter (draft-dflash: one forward whatever the draft's length) pays as much for one token as for
    all: the same 0.5 forwards a call that capped a per-token drafter at 3 leave its length to the verify cost curve
    and the acceptance."""
    planner = planner_with(flat(), {"x": 0.9})
    planner.per_call = frozenset({"x"})
    planner.observe_drafting("x", 9.0, [(1, 1)])  # the first call is not priced
    planner.observe_drafting("x", 0.5, [(1, 1)])  # a call that drafted one token
    assert planner.drafting_caps(["x"], 1) == {"x": AUTO_DRAFT_MAX}
    costs = CostModel()  # flat up to 8 rows, then dear
    costs.set_points({1: 1.0, 8: 1.0, 16: 4.0})
    planner.costs = costs
    assert planner.drafting_caps(["x"], 1) == {"x": 7}


def test_a_stepped_cost_curve_does_not_stop_the_plan_early():
    costs = CostModel()  # 2 rows cost a lot, 4..8 barely more: a greedy stop at the first loss would give 0
    costs.set_points({1: 1.0, 2: 2.0, 4: 2.05, 8: 2.1, 16: 8.0})
    planner = planner_with(costs, {"x": 0.9})
    assert planner.plan([("x", 16)], 0.0) == [7]  # 8 rows


def test_a_model_drafter_may_draft_a_token_past_its_planned_length_a_block_drafter_not():
    """A position past the cap would never be drafted, so never judged again: a token-by-token model drafter's cap
    is one past its planned length (its gate stops it where it does not pay); a block drafter's is its plan."""
    for per_call in (False, True):
        planner = planner_with(flat(), {"x": 0.9})
        planner.per_call = frozenset({"x"}) if per_call else frozenset()
        planner.observe_drafting("x", 9.0, [(1, 1)])  # the first call is not priced
        planner.observe_drafting("x", 0.5, [(3, 3)] if per_call else [(1, 1)])
        planned = planner._uniform_length("x", 1)
        assert 0 < planned and (per_call or planned < AUTO_DRAFT_MAX)
        assert planner.drafting_caps(["x"], 1)["x"] == planned + (0 if per_call else 1)


def test_several_sequences_share_the_padded_verify_batch():
    costs = CostModel()  # flat up to 8 rows: two sequences fit 3 draft tokens each, padded to [2, 4]
    costs.set_points({1: 1.0, 8: 1.0, 16: 4.0})
    planner = planner_with(costs, {"x": 0.9})
    assert planner.plan([("x", 16), ("x", 16)], 0.0) == [3, 3]
    assert planner.drafting_caps(["x"], 2) == {"x": 3 + GATED_EXTRA}


def test_a_ragged_verify_batch_gives_one_sequence_its_long_draft_beside_draftless_ones():
    """Server slots on the CPU kernels: a verify step costs its own rows, so one slot's copied block is verified
    whole beside three slots with no draft; padded to [4, 17] (68 rows) it does not pay at any length."""
    costs = CostModel()  # every row adds a fifth of a forward
    costs.set_points({1: 1.2, 64: 13.8})
    drafts = [("x", 16), (None, 0), (None, 0), (None, 0)]
    assert planner_with(costs, {"x": 0.99}, ragged=True).plan(drafts, 0.0) == [16, 0, 0, 0]
    assert planner_with(costs, {"x": 0.99}).plan(drafts, 0.0) == [0, 0, 0, 0]


def test_a_useless_drafter_is_probed_with_growing_gaps_and_recovers():
    planner = planner_with(flat(), {"x": 0.0})  # a probe costs next to nothing: the shortest gap
    probes = [step for step in range(1, 200) if planner.drafting_caps(["x"], 1)["x"] == 1]
    f, g = 1 + FIRST_PROBE_AFTER, PROBE_GAP_MIN  # the first probe early in the request, then gaps doubling
    assert probes == [f, f + g, f + 3 * g, f + 7 * g]
    planner.drafting_caps(["x"], 1)
    planner.step = 1000  # due again: the probe survives the plan that says 0
    assert planner.drafting_caps(["x"], 1) == {"x": 1}
    assert planner.plan([("x", 1)], 0.0) == [1]
    planner.acceptance.gains = lambda name: [0.99 ** j for j in range(1, AUTO_DRAFT_MAX + 1)]
    planner.costs = flat()
    assert planner.drafting_caps(["x"], 1)["x"] > 1  # right now, and worth asking ...
    assert planner.next_probe["x"] == planner.step + PROBE_GAP_MIN  # ... so should it fall back to 0, its probes
    assert planner.probe_gap["x"] == 2 * PROBE_GAP_MIN  # start over at the shortest gap


def test_a_free_drafter_planned_at_0_is_shadowed_not_probed():
    """An n-gram drafter whose drafts do not pay is never verified: it is shadowed, i.e. asked apart from the other
    drafters (in a chain its draft must not take the step from them) and its draft scored against the tokens the
    step commits. A shadow stays due step after step until the drafter has a draft to score (one that finds
    nothing teaches nothing), then comes back at the gap that keeps its asking within PROBE_BUDGET. A model
    drafter planned at 0 still gets verified 1-token probes (its asking costs forwards)."""
    planner = planner_with(flat(), {"x": 0.0, "y": 0.0})
    free = frozenset({"x"})
    for _ in range(5):
        assert planner.drafting_caps(["x"], 1, free) == {"x": 0} and planner.shadowing == {"x"}
        assert planner.plan([(None, 0)], 0.0) == [0]  # nothing verified, no probe
    planner.observe_drafting("x", 9.0, [(1, 1)])  # the first call is not priced
    planner.observe_drafting("x", 0.05, [(0, 1)])  # a lookup costs 5 % of a forward
    planner.observe_shadow("x", 1, 0)  # scored: its first token was not the target's
    assert planner.acceptance.counts["x"][0][:2] == [0.0, 1.0]  # a trial of position 1, not a hit
    gap = round(0.05 / (PROBE_BUDGET * 1.0))
    shadowed = [(planner.drafting_caps(["x"], 1, free), "x" in planner.shadowing) for _ in range(gap)]
    assert shadowed == [({"x": 0}, False)] * (gap - 1) + [({"x": 0}, True)]
    planner.acceptance.gains = lambda name: [(0.99 if name == "x" else 0.0) ** j for j in range(1, AUTO_DRAFT_MAX + 1)]
    assert planner.drafting_caps(["x"], 1, free) == {"x": AUTO_DRAFT_MAX} and not planner.shadowing
    asks = [planner.drafting_caps(["y"], 1)["y"] for _ in range(FIRST_PROBE_AFTER + 1)]
    assert asks == [0] * FIRST_PROBE_AFTER + [1] and not planner.shadowing


def test_a_free_drafter_is_asked_for_its_whole_draft_whatever_its_lookups_cost():
    """Issue 46: ngram-mod drafts on few steps of a code edit (where its hashed history continues a copied block),
    and its lookup's time, priced per drafted token on every ask against a gain that comes with one ask in ten,
    capped it at a few tokens or dropped it, where its copied blocks were accepted whole. Asking an n-gram drafter
    costs nothing (Drafter.cheap): it is asked for its whole draft, and `plan` verifies all of it."""
    costs = CostModel()  # a 0.5b-like curve (s): a 17-row verify costs 5.3 one-row forwards
    costs.set_points({1: 0.0145, 2: 0.018, 3: 0.020, 4: 0.028, 6: 0.034, 8: 0.040, 12: 0.058, 16: 0.075})
    planner = planner_with(costs, {"ngram-mod": 0.99})
    for _ in range(40):
        planner.observe_drafting("ngram-mod", 0.001, [(0, AUTO_DRAFT_MAX)])  # 1 ms a lookup (a busy machine), ...
    planner.observe_drafting("ngram-mod", 0.001, [(AUTO_DRAFT_MAX, AUTO_DRAFT_MAX)])  # ... mostly without a draft
    assert planner.reach["ngram-mod"][0] < 0.15
    assert planner.drafting_caps(["ngram-mod"], 1, frozenset({"ngram-mod"})) == {"ngram-mod": AUTO_DRAFT_MAX}
    assert planner.plan([("ngram-mod", AUTO_DRAFT_MAX)], 0.001) == [AUTO_DRAFT_MAX]


def test_a_free_drafter_is_asked_however_long_it_has_had_no_draft():
    """How seldom a free drafter drafts does not enter its cap: its yield, decayed by every draftless ask, reaches
    1e-16 after some 350 asks, where weighing its gain by it tied its rate with plain decoding's (the writing set)."""
    planner = planner_with(flat(), {"ngram-mod": 0.5})
    free = frozenset({"ngram-mod"})
    for _ in range(1000):
        assert planner.drafting_caps(["ngram-mod"], 1, free) == {"ngram-mod": AUTO_DRAFT_MAX}
        planner.observe_drafting("ngram-mod", 1e-4, [(0, AUTO_DRAFT_MAX)])
    assert planner.reach["ngram-mod"][0] < 1e-40 and not planner.shadowing


def test_a_right_but_dear_drafter_is_probed_ever_more_rarely():
    """A draft model whose tokens cost more than they save (free writing) is probed at gaps that hold a probe's
    whole price (its token, the extra verify row and the catch-up of its idle cache, which is not the price of its
    tokens) to PROBE_BUDGET of the steps between probes, doubling up to PROBE_GAP_MAX."""
    costs = CostModel()
    costs.set_points({1: 1.0, 2: 1.5, 64: 32.0})
    planner = planner_with(costs, {"x": 0.5})
    planner.observe_drafting("x", 9.0, [(1, 1)])  # not priced
    planner.observe_drafting("x", 0.3, [(1, 1)])  # 0.3 forwards per drafted token: pays only when mostly right

    def next_probe(catch_up: float) -> int:
        """Steps to the next probe; the probe then spends `catch_up` seconds catching its cache up."""
        for gap in range(1, 10**4):
            if planner.drafting_caps(["x"], 1)["x"] == 1:
                planner.observe_catch_up("x", catch_up)
                return gap
        raise AssertionError("never probed")

    def worth_asking_for_a_moment() -> None:
        """The text changes and the drafter pays for a step: its probes start over at the shortest gap."""
        rates = planner.acceptance.gains
        planner.acceptance.gains = lambda name: [1.0] * AUTO_DRAFT_MAX
        assert planner.drafting_caps(["x"], 1)["x"] > 0
        planner.acceptance.gains = rates

    next_probe(0.0)
    price = 0.3 + (1.5 - 1.0)  # in one-row forwards
    first = next_probe(0.0)
    assert abs(first - price / PROBE_BUDGET) <= 1 and next_probe(0.0) == 2 * first  # then doubling
    worth_asking_for_a_moment()
    assert next_probe(0.6) == first  # this probe found the draft cache idle: 0.6 forwards of catch-up
    worth_asking_for_a_moment()
    assert abs(next_probe(0.0) - (price + 0.6) / PROBE_BUDGET) <= 1  # the catch-up is part of the price now
    assert PROBE_GAP_MAX < 4 * first and next_probe(0.0) == PROBE_GAP_MAX


def test_a_draft_models_probes_after_its_first_are_priced_by_its_prompt_prefill_and_never_undercut_the_price():
    """A draft model mirrors the prompt; its first probe comes while its cache still holds it (one draft token and
    a verify row), but a probe after it falls to 0 will restart from a window of about the prompt's size, so that
    price schedules those probes, not the shortest gap. And a probe that turns out dearer than the doubled gap
    allows pushes the next probe out to the price's gap."""
    planner = planner_with(flat(), {"x": 1.0})  # worth asking at first
    planner.observe_drafting("x", 9.0, [(1, 1)])  # not priced
    planner.observe_drafting("x", 0.3, [(1, 1)])
    planner.observe_mirroring("x", 1.0)  # the prompt: one forward's worth of prefill
    assert planner.drafting_caps(["x"], 1)["x"] > 0
    planner.observe_mirroring("x", 0.0)  # a verify step's rows: not a probe's price
    planner.observe_catch_up("x", 0.0)  # an ask with a cache in step: neither
    assert planner.drafting_caps(["x"], 1)["x"] > 0
    know_rates(planner, {"x": 0.0})  # the text changes: never right any more
    price = 1.0 + 0.3  # + a flat curve's free extra row, in one-row forwards
    probes = [step for step in range(3, 1000) if planner.drafting_caps(["x"], 1)["x"] == 1]
    assert abs(probes[0] - (2 + price / PROBE_BUDGET)) <= 1

    unpriced = planner_with(flat(), {"x": 0.0})  # no price known: the shortest gap, then doubling ...
    probes = []
    for step in range(1, 400):
        if unpriced.drafting_caps(["x"], 1)["x"] == 1:
            probes.append(step)
            unpriced.observe_catch_up("x", 2.0 if len(probes) == 2 else 0.0)  # ... until the 2nd probe's price
    f, g = 1 + FIRST_PROBE_AFTER, PROBE_GAP_MIN
    assert probes == [f, f + g, f + 3 * g, f + 3 * g + round(2.0 / PROBE_BUDGET)]

    cold = planner_with(flat(), {"x": 0.0})  # never worth asking: the first probe comes early, the next one waits
    cold.observe_mirroring("x", 0.0)  # the prompt's decode (an MTP head defers its rows there) ...
    cold.observe_mirroring("x", 1.0)  # ... then `begin`, which decodes them: the prompt's price, which ...
    first = next(cold.step for _ in range(10) if cold.drafting_caps(["x"], 1)["x"] == 1)
    cold.observe_catch_up("x", 0.0)  # ... the early probe's free catch-up (the prompt was in cache) does
    cold.acceptance.gains = lambda name: [1.0] * AUTO_DRAFT_MAX  # not undercut, not even when the probe was right,
    assert cold.drafting_caps(["x"], 1)["x"] > 0  # the drafter asked at the next step (its probes start over) and
    cold.observe_catch_up("x", 0.0)
    cold.acceptance.gains = lambda name: [0.0] * AUTO_DRAFT_MAX  # then dropped again
    second = next(cold.step for _ in range(10**4) if cold.drafting_caps(["x"], 1)["x"] == 1)
    assert first == 1 + FIRST_PROBE_AFTER and abs(second - (first + 1 + 1.0 / PROBE_BUDGET)) <= 1


def test_a_dropped_drafter_comes_back_only_through_a_probe():
    """Planned at 0, a drafter is asked again only after a probe: an estimate that drifts back over 0 without new
    evidence (the verify cost's online refinement) would ask an idle draft model, whose cache restart from a window
    is a price that estimate does not see."""
    planner = planner_with(steep(), {"x": 0.9})  # sequential verify: speculation cannot pay
    first = next(step for step in range(1, 10**4) if planner.drafting_caps(["x"], 1) == {"x": 1})
    assert first == 1 + FIRST_PROBE_AFTER  # a model drafter's first probe comes early in the request
    assert planner.drafting_caps(["x"], 1) == {"x": 0}
    planner.costs = flat()  # the cost estimate drifts: now every draft length would pay ...
    gap = planner.next_probe["x"] - planner.step - 1
    assert gap > 0 and all(planner.drafting_caps(["x"], 1) == {"x": 0} for _ in range(gap))  # ... not asked
    assert planner.drafting_caps(["x"], 1) == {"x": 1}  # until its probe
    assert planner.drafting_caps(["x"], 1)["x"] > 1  # whose evidence brings it back



def test_a_draft_model_is_not_dropped_at_a_dip_of_its_estimates_and_comes_back_at_a_request_start():
    """A model drafter planned at 0 is not observed, so estimates that dropped it at a dip (a run of asks p-min
    stopped at once) would stay there. Estimates of a longer memory keep it asked through a dip; once both plan it
    at 0 it is dropped, and comes back only through a probe or at a request's first step (its draft cache holds the
    prompt), never mid-request on estimates alone."""
    costs = CostModel()  # a 1.5b's curve (ms); the 0.5b drafting for it costs 11.5 ms a forward
    costs.set_points({1: 32.1, 2: 34.3, 3: 34.0, 4: 35.0, 6: 43.5, 8: 53.6, 12: 74.1, 16: 91.5})
    planner = Planner(costs)
    planner.begin_request()

    def ask(n_drafted: int, times: int = 1) -> None:
        for _ in range(times):
            planner.observe_drafting("x", 11.5 * forwards(n_drafted, 4), [(n_drafted, 4)])
            if n_drafted:
                planner.observe_accept("x", n_drafted, n_drafted)

    for i in range(60):  # half its asks give a draft of 3, accepted whole: worth asking
        planner.drafting_caps(["x"], 1)
        ask(3 * (i % 2))
    ask(0, 12)  # a dip: twelve asks stopped by p-min
    assert planner._uniform_length("x", 1) == 0  # the recent estimates alone would drop it
    assert planner.drafting_caps(["x"], 1)["x"] > 0
    ask(0, 60)  # the text changes: no draft any more
    assert [planner.drafting_caps(["x"], 1)["x"] for _ in range(5)] == [0] * 5  # dropped, its probe far away
    ask(3, 60)  # (what a run of right probes would teach)
    assert [planner.drafting_caps(["x"], 1)["x"] for _ in range(5)] == [0] * 5  # not back mid-request
    planner.begin_request()
    assert planner.drafting_caps(["x"], 1)["x"] > 0  # the next request asks it again

def test_a_draft_model_dropped_where_both_memories_dipped_returns_where_the_requests_so_far_say_it_pays():
    """A stretch of hard text longer than the ~20-ask memory drops a model drafter on both sets of estimates, and
    while dropped it is not observed: at the next request's first step the estimates of the whole run so far (~100
    asks) bring it back, where the dip alone said nothing of it."""
    costs = CostModel()  # a 1.5b's curve (ms); the 0.5b drafting for it costs 11.5 ms a forward
    costs.set_points({1: 32.1, 2: 34.3, 3: 34.0, 4: 35.0, 6: 43.5, 8: 53.6, 12: 74.1, 16: 91.5})
    planner = Planner(costs)
    planner.begin_request()

    def ask(n_drafted: int) -> None:
        planner.observe_drafting("x", 11.5 * forwards(n_drafted, 4), [(n_drafted, 4)])
        if n_drafted:
            planner.observe_accept("x", n_drafted, n_drafted)

    for i in range(150):  # half its asks give a draft of 3, accepted whole: worth asking
        assert planner.drafting_caps(["x"], 1)["x"] > 0
        ask(3 * (i % 2))
    for _ in range(30):  # hard text: every ask stopped by p-min
        ask(0)
    assert [planner.drafting_caps(["x"], 1)["x"] for _ in range(5)] == [0] * 5  # dropped on both memories
    assert planner._uniform_length("x", 1, "long_run") == 0
    planner.begin_request()
    assert planner.drafting_caps(["x"], 1)["x"] > 0  # the run's evidence brings it back
    assert planner.drafting_caps(["x"], 1)["x"] > 0  # and the recent estimates start over from it


# --- a recorded trace ------------------------------------------------------------------------------------------

TRACES = Path(__file__).parent / "traces"


def load_trace(name: str) -> tuple[dict, CostModel]:
    """A recorded trace and its run's verify-cost curve."""
    trace = json.loads((TRACES / name).read_text())
    costs = CostModel()
    costs.set_points({int(rows): ms / 1000 for rows, ms in trace["verify_ms"].items()})
    return trace, costs


def pays_whole(costs: CostModel, n: int) -> bool:
    """Whether an n-token draft accepted whole commits more tokens per second verified whole than cut."""
    return (1 + n) / costs(1 + n) > max((1 + j) / costs(1 + j) for j in range(n))


def replay_trace(trace: dict, planner: Planner) -> list[tuple[int, int, int]]:
    """A recorded acceptance trace (scripts/record_acceptance_trace.py: per step, the drafter's draft, how much of
    it the target accepted when it verified all of it, the drafting time) fed to `planner` step by step as the step
    loop feeds it: caps, drafting, plan, then what the target's tokens say of the verified tokens, of the first
    token a cut removed (scored against the target's own token) and of a shadowed drafter's draft. Each step
    replays as recorded (a cut draft's tail is not drafted again at the next step). Returns per recorded draft
    (its length, its tokens accepted, its tokens verified now)."""
    name = trace["spec_type"]
    free = frozenset({name})
    out = []
    for proposed, accepted, draft_us in (step for prompt in trace["prompts"] for step in prompt):
        cap = planner.drafting_caps([name], 1, free)[name]
        shadowed = name in planner.shadowing
        drafted = min(proposed, cap)
        if cap or shadowed:
            planner.observe_drafting(name, draft_us / 1e6, [(drafted if cap else proposed, cap or AUTO_DRAFT_MAX)])
        k = planner.plan([(name if drafted else None, drafted)], draft_us / 1e6 if cap or shadowed else 0.0)[0]
        if k < drafted and accepted >= k:
            planner.observe_accept(name, k + 1, k + (accepted > k))
        elif k:
            planner.observe_accept(name, k, min(k, accepted))
        if shadowed and proposed:
            planner.observe_shadow(name, 1, int(accepted > 0))
        if proposed:
            out.append((proposed, accepted, k))
    return out


def test_a_recorded_ngram_mod_trace_verifies_the_long_drafts_that_pay():
    """Issue 46, from a real run (qwen2.5-coder-0.5b on the code-edit prompts, ngram-mod at --draft-max 16: the
    trace file names its command): ngram-mod drafts on 14 of 195 steps, where an edit copies a block, and 13 of its
    drafts were accepted whole. On the run's verify-cost curve a whole 16-token draft verified whole commits 17
    tokens for 4.7 one-row forwards, more per second than any cut of it: the planner must verify such drafts whole
    once its first drafts have taught it (it starts from the prior of a drafter never seen, a_1 = 0.5). Before, it
    priced the drafter's lookups per drafted token (one of them took 7 ms) and dropped it: the last edit's three
    drafts, 37 tokens all accepted, were not verified at all."""
    trace, costs = load_trace("ngram-mod-code-edit-0.5b.json")
    drafts = replay_trace(trace, Planner(costs))
    paying = [(n, k) for n, accepted, k in drafts if accepted == n and pays_whole(costs, n)]
    assert len(paying) == 13
    learning = 3  # planned mostly from the prior
    assert [k for _, k in paying[learning:]] == [n for n, _ in paying[learning:]]


def test_a_recorded_ngram_mod_trace_is_asked_after_hundreds_of_steps_without_a_draft():
    """From a real run (qwen2.5-coder-0.5b on the writing prompts, 128 tokens each, ngram-mod at --draft-max 16: the
    trace file names its command): ngram-mod drafts 9 tokens at the end of the first answer, then nothing for 417
    steps of free writing, then the last answer copies a block: 85 tokens in 6 drafts, all accepted. A free drafter
    has nothing to lose by asking, however seldom it drafts; but the fraction of its asks that gave a draft, weighed
    into its rate, decayed below 1e-16 after some 350 draftless asks, the rate tied with plain decoding's and it was
    shadowed: the block's first draft, 16 tokens accepted whole, was scored and not verified."""
    trace, costs = load_trace("ngram-mod-writing-0.5b.json")
    steps = [step for prompt in trace["prompts"] for step in prompt]
    drafted = [i for i, (proposed, _, _) in enumerate(steps) if proposed]
    assert drafted[1] - drafted[0] > 400  # what the trace shows: the long wait between its drafts
    drafts = replay_trace(trace, Planner(costs))
    assert all(accepted == n for n, accepted, _ in drafts)
    assert all(k > 0 for _, _, k in drafts)  # every draft verified, the block's first one too
    block = [k for n, _, k in drafts if n == 16]
    learning = 2  # its first drafts planned mostly from the prior and one 9-token draft, 400 steps before
    assert len(block) == 5 and pays_whole(costs, 16) and block[learning:] == [16] * (len(block) - learning)


# --- lossless, end to end ------------------------------------------------------------------------------------

CHAINS = ["ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache", "draft-simple",
          "ngram-mod,draft-simple"]


@pytest.fixture
def tiled_costs(monkeypatch):
    """A cost curve like the int4 CPU kernel's (4-row tiles) and no timing-driven learning, so plans depend only on
    acceptance and drafts get lengths between 0 and their full length. Counts the cuts. With `capped=False` the
    drafters are neither capped nor gated (DraftGate) while drafting, so every shortening goes through the cut after
    drafting."""
    monkeypatch.setattr(CostModel, "observe", lambda *a: None)
    monkeypatch.setattr(DraftCost, "observe", lambda *a: None)
    cuts = []
    original = Chain.cut

    def counting(self, p, n):
        cuts.append((len(p.result), n))
        original(self, p, n)

    monkeypatch.setattr(Chain, "cut", counting)

    def install(session, capped=True):
        session.engine.costs.set_points({1: 1.0, 4: 1.05, 5: 1.6, 8: 1.7, 9: 2.3, 16: 2.5, 64: 16.0})
        if not capped:
            monkeypatch.setattr(Planner, "drafting_caps", lambda self, names, n_seq, free=frozenset(): {})
            monkeypatch.setattr(Planner, "gate", lambda self, name, n_seq: None)
        return cuts

    return install


def auto_session(model, chain, draft, n_seq=1):
    return make_session(model, chain, draft=draft, n_seq=n_seq, draft_max=AUTO_DRAFT_MAX, adaptive=True)


def run_together(session, prompts) -> list[list[int]]:
    """Greedy outputs of all prompts generated at once, one sequence each."""
    session.reset()
    gen = session.generator()
    outs = {seq: gen.start(seq, prompt, GREEDY, N_PREDICT).tokens for seq, prompt in enumerate(prompts)}
    while emitted := gen.step():
        for e in emitted:
            outs[e.seq].extend(e.tokens)
    return [outs[seq] for seq in range(len(prompts))]


@pytest.mark.parametrize("capped", [True, False], ids=["capped", "cut"])
@pytest.mark.parametrize("chain", CHAINS)
def test_greedy_auto_equals_plain_one_sequence(tiny_model_path, tiny_close_draft_path, plain_outputs, tiled_costs,
                                               chain, capped):
    session = auto_session(tiny_model_path, chain, tiny_close_draft_path)
    cuts = tiled_costs(session, capped)
    assert_greedy_equals_plain(session, plain_outputs)
    assert capped or any(0 < n < full for full, n in cuts), "no draft was cut to a shorter length"


@pytest.mark.parametrize("chain", CHAINS)
def test_greedy_auto_equals_plain_four_sequences(tiny_model_path, tiny_close_draft_path, plain_outputs, tiled_costs,
                                                 chain):
    session = auto_session(tiny_model_path, chain, tiny_close_draft_path, n_seq=4)
    cuts = tiled_costs(session)
    assert run_together(session, PROMPTS) == plain_outputs
    assert sum(st.n_acc_tokens for st in session.chain.stats.values()) > 0
    assert cuts


@pytest.fixture(scope="module")
def mtp_path(tmp_path_factory):
    return write_tiny_mtp_gguf(tmp_path_factory.mktemp("mtp") / "tiny-mtp.gguf")


# one sequence: every shortening is a cut after drafting; four: capped drafting (with probes: the tiled curve makes a
# padded [4, 2] batch cost as much as [4, 4], so a prior-only estimate plans no draft at first)
@pytest.mark.parametrize("n_seq, capped", [(1, False), (4, True)])
@pytest.mark.parametrize("chain", ["draft-mtp", "ngram-mod,draft-mtp"])
def test_greedy_auto_with_mtp_equals_plain(mtp_path, tiled_costs, chain, n_seq, capped):
    plain = make_session(mtp_path)
    expected = [run_together(plain, [prompt])[0] for prompt in PROMPTS[:n_seq]]
    session = make_session(mtp_path, chain, n_seq=n_seq, draft_max=AUTO_DRAFT_MAX, adaptive=True)
    tiled_costs(session, capped)
    assert run_together(session, PROMPTS[:n_seq]) == expected
    stats = session.chain.stats["draft-mtp"]
    assert stats.n_acc_tokens > 0 and len(stats.n_gen_tokens_per_pos) <= 3  # MTP's own cap is below 16


@pytest.mark.parametrize("n_seq", [1, 4])
def test_auto_with_real_calibration_and_timings_is_lossless(tiny_model_path, tiny_close_draft_path, plain_outputs,
                                                            n_seq):
    session = auto_session(tiny_model_path, "ngram-mod,draft-simple", tiny_close_draft_path, n_seq=n_seq)
    for prompt, expected in zip(PROMPTS, plain_outputs):
        assert run(session, prompt)[0] == expected
    assert session.engine.costs.calibrated and session.engine.costs.observed
    # how much is drafted depends on this machine's timings (a busy machine can make every draft look dear): the
    # drafters were asked, and what was verified stayed within the bound; drafts of every length are lossless in
    # the tiled-cost tests above
    assert all(st.n_call_draft > 0 for st in session.chain.stats.values())
    assert all(st.mean_draft_len <= AUTO_DRAFT_MAX for st in session.chain.stats.values() if st.n_gen_drafts)


def test_cut_drafts_keep_rejection_sampling_exact(tiny_model_path, tiny_close_draft_path, tiled_costs):
    """The draft distributions (probs) are cut with their tokens: the output distribution stays the target's."""
    params = dict(temp=1.5, top_k=3, top_p=1.0, min_p=0.0)
    session = make_session(tiny_model_path, "draft-simple", draft=tiny_close_draft_path, verify="rejection",
                          draft_max=3, adaptive=True)
    cuts = tiled_costs(session, capped=False)
    session.engine.costs.set_points({1: 1.0, 2: 1.3, 3: 2.2, 4: 3.0})  # one token pays, three rarely
    prompt = PROMPTS[1]
    exact = exact_two_token_distribution(session, prompt, SamplingParams(**params))
    n = 600
    counts: Counter = Counter()
    for seed in range(n):
        out, _ = run(session, prompt, 4, sampling=SamplingParams(seed=seed, **params))
        counts[tuple(out[:2])] += 1
    tv = 0.5 * sum(abs(counts[k] / n - exact.get(k, 0.0)) for k in set(exact) | set(counts))
    assert tv < 0.12, f"total variation {tv:.3f}"  # as tests/test_generate_sampling.py
    assert any(0 < n < full for full, n in cuts)


def test_a_cut_never_leaves_a_model_draft_shorter_than_draft_min(tiny_model_path, tiny_close_draft_path,
                                                                  plain_outputs, tiled_costs):
    session = make_session(tiny_model_path, "draft-simple", draft=tiny_close_draft_path, draft_max=8, adaptive=True,
                          draft_min=3)
    cuts = tiled_costs(session, capped=False)
    for prompt, expected in zip(PROMPTS, plain_outputs):
        assert run(session, prompt)[0] == expected
    assert any(0 < n < 3 for _, n in cuts)  # the planner asked for drafts below the minimum ...
    per_pos = session.chain.stats["draft-simple"].n_gen_tokens_per_pos
    assert per_pos[0] > 0 and per_pos[0] == per_pos[2]  # ... but every verified draft had at least 3 tokens


def test_catching_up_a_lagging_cache_is_not_priced_as_drafting():
    """A draft model idle for a while catches its cache up before drafting again; the planner's price of a drafted
    token must not include that, or a probe after idling looks dear and the drafter stays idle for good."""
    from spec_cli.speculative.base import DraftParams

    class Lagging:
        name = "draft-simple"

        def catch_up(self, params):
            time.sleep(0.05)

        def draft(self, params):
            for p in params:
                p.result.append(7)

    chain = Chain([Lagging()], n_seq=1)
    p = DraftParams(seq=0, n_max=4, pos0=3, id_last=1, prompt=[1, 2, 3])
    spent = chain.draft([p])
    assert p.result == [7] and spent["draft-simple"] < 0.05
    assert chain.stats["draft-simple"].t_draft_us >= 0.05e6  # still the drafter's time in the statistics


@pytest.mark.parametrize("chain, draft_min", [("ngram-simple", 0), ("draft-simple", 3)])
def test_the_first_token_a_cut_removed_is_scored_against_the_targets_token(tiny_model_path, tiny_close_draft_path,
                                                                          plain_outputs, monkeypatch, chain,
                                                                          draft_min):
    """Under match verification a draft token is accepted exactly when it equals the token the target commits at its
    position. So where the plan cut a draft (to 1 token here; a draft model's, below its --draft-min, to none) and
    every verified token was accepted, the target's own next token says whether the first token cut off would have
    been: the planner hears of it as tried (else a position the plan stopped verifying keeps its estimate for good).
    Checked against the committed output, lossless."""
    events = []
    monkeypatch.setattr(Planner, "drafting_caps", lambda self, names, n_seq, free=frozenset(): {})  # whole drafts
    monkeypatch.setattr(Planner, "gate", lambda self, name, n_seq: None)
    monkeypatch.setattr(Planner, "plan", lambda self, drafts, drafting_s, conf=None: [min(n, 1) for _, n in drafts])
    cut, observe = Chain.cut, Planner.observe_accept

    def cutting(self, p, n):
        draft = list(p.result)
        cut(self, p, n)
        events.append(("cut", p.pos0, draft, len(p.result)))

    monkeypatch.setattr(Chain, "cut", cutting)
    monkeypatch.setattr(Planner, "observe_accept",
                        lambda self, name, n, a, conf=(): (events.append((n, a)), observe(self, name, n, a, conf))[1])
    session = make_session(tiny_model_path, chain, draft=tiny_close_draft_path, draft_max=AUTO_DRAFT_MAX, adaptive=True,
                           draft_min=draft_min)
    scored = 0
    for prompt, expected in zip(PROMPTS, plain_outputs):
        events.clear()
        out, seq = run(session, prompt)
        assert out == expected
        committed = seq.tokens + [seq.id_last]  # committed[i]: the token at position i
        for event, heard in zip(events, events[1:]):
            if event[0] != "cut":
                continue
            _, pos0, draft, n = event
            target = committed[pos0 + 1 : pos0 + 2 + n]  # the target's tokens at the draft's first n + 1 positions
            if draft[:n] == target[:n]:
                assert heard == (n + 1, n + (draft[n] == target[n]))
                scored += 1
    assert scored > 0, "no cut draft had all its verified tokens accepted: the test proves nothing"


def test_a_free_drafter_that_does_not_pay_is_scored_without_verifying(tiny_model_path, plain_outputs, monkeypatch):
    """Where no draft pays for its verify rows (here every row costs a whole forward), an n-gram drafter is never
    verified, not even a probe's token: it is asked apart and its drafts scored against the committed tokens, so
    its estimates go on learning for the price of its lookups alone. Lossless."""
    monkeypatch.setattr(CostModel, "observe", lambda *a: None)
    session = auto_session(tiny_model_path, "ngram-simple", None)
    session.engine.costs.set_points({1: 1.0, 64: 64.0})
    for prompt, expected in zip(PROMPTS, plain_outputs):
        out, seq = run(session, prompt)
        assert out == expected and seq.n_drafted == 0
    stats = session.chain.stats["ngram-simple"]
    assert stats.n_proposed > 0 and stats.n_gen_drafts == 0
    hits, trials, _ = session.chain.planner.acceptance.counts["ngram-simple"][0]
    assert trials > 0 and hits > 0


def test_a_shadowed_drafter_does_not_take_the_step_from_the_drafters_after_it():
    class Fixed(Drafter):
        def __init__(self, name: str, token: int, cheap: bool):
            self.name, self.token, self.cheap = name, token, cheap

        def draft(self, params):
            for p in params:
                if p.drafting:
                    p.result = [self.token] * 3

    chain = Chain([Fixed("lookup", 7, cheap=True), Fixed("model", 9, cheap=False)], n_seq=1)
    p = DraftParams(seq=0, n_max=4, pos0=3, id_last=1, prompt=[1, 2, 3])
    chain.draft([p], shadow=frozenset({"lookup"}))
    assert p.result == [9, 9, 9] and chain.winner(0) == "model"
    assert chain.shadows == {0: [("lookup", [7, 7, 7])]}
    chain.draft([replace(p, result=[], drafting=True)])
    assert chain.shadows == {}  # one step's shadows only


def test_per_request_n_max_still_caps_auto(tiny_model_path, plain_outputs, tiled_costs):
    from spec_cli.runtime.generate import SpecOverrides

    session = auto_session(tiny_model_path, "ngram-simple", None)
    tiled_costs(session)
    out, seq = run(session, PROMPTS[0], spec=SpecOverrides(n_max=1))
    assert out == plain_outputs[0] and seq.n_drafted > 0
    assert len(session.chain.stats["ngram-simple"].n_gen_tokens_per_pos) == 1


# --- the flag ------------------------------------------------------------------------------------------------

def test_cli_draft_max_auto(capsys, monkeypatch, tiny_model_path):
    base = ["-m", str(tiny_model_path), "-p", PROMPT, "-n", "16", "--temp", "0", "--json"]
    code, out, err = cli(capsys, monkeypatch, "run", *base)
    assert code == 0, err
    plain = json.loads(out)
    code, out, err = cli(capsys, monkeypatch, "speculative-simple", *base, "--spec-type", "ngram-simple",
                         "--spec-ngram-simple-size-n", "2", "--draft-max", "auto")
    assert code == 0, err
    spec = json.loads(out)
    assert spec["content"] == plain["content"] and spec["n_draft"] == AUTO
    assert "mean_draft_len" in spec["drafters"][0]


def test_first_run_calibration_is_not_generation_time(capsys, monkeypatch, tiny_model_path):
    """The one-time verify-cost calibration of --draft-max auto runs inside the first step, but the generation speed
    reported must not include it (smollm2-135m's first run once reported 3.5 tok/s, its second 10.5)."""
    calibrate = CostModel.calibrate

    def slow_calibrate(self, ctx, seq):
        time.sleep(1.0)
        calibrate(self, ctx, seq)

    monkeypatch.setattr(CostModel, "calibrate", slow_calibrate)
    code, out, err = cli(capsys, monkeypatch, "speculative-simple", "-m", str(tiny_model_path), "-p", PROMPT, "-n",
                         "8", "--temp", "0", "--json", "--spec-type", "ngram-simple", "--draft-max", "auto")
    assert code == 0, err
    assert json.loads(out)["predicted_ms"] < 900


@pytest.mark.parametrize("value", ["abc", "-3", "1.5"])
def test_cli_bad_draft_max_is_a_usage_error(capsys, monkeypatch, tiny_model_path, value):
    code, _, err = cli(capsys, monkeypatch, "speculative-simple", "-m", str(tiny_model_path), "-p", PROMPT,
                       "--spec-type", "ngram-simple", f"--draft-max={value}")
    assert code == 2
    assert "--draft-max must be a non-negative integer or auto" in err


def test_bench_sweeps_auto_next_to_fixed_lengths(tiny_model_path, prompt_file):  # noqa: F811
    for flags, draft_max in (({"draft_max": ["4,16,auto"]}, [4, 16, AUTO]), ({"draft_max": ["1-4*2", "auto"]},
                                                                               [1, 2, 4, AUTO])):
        assert from_flags(read_flags(BENCH_OPTIONS, {**flags, "spec_type": ["ngram-mod"]})).draft_max == draft_max
    params = tiny(tiny_model_path, random_tests=False, spec_type=["ngram-simple"], draft_max=[2, AUTO],
                  prompt_sets=[str(prompt_file)], n_gen=[8], repetitions=1)
    rows = [r.to_dict() for r in run_bench(params)]
    assert [(r["spec_type"], r["draft_max"]) for r in rows] == [("none", 0), ("ngram-simple", 2),
                                                                 ("ngram-simple", AUTO)]
    assert json.loads(json.dumps(rows[2]))["draft_max"] == AUTO  # the field reads back as written
    result = CliRunner().invoke(app, ["bench", "-m", str(tiny_model_path), "-dev", "cpu", "--spec-type",
                                      "ngram-simple", "--draft-max", "2,auto", "--prompts", str(prompt_file), "-n",
                                      "4", "-r", "1", "--no-warmup"])
    assert result.exit_code == 0, result.output
    assert "auto |" in result.stdout  # the draft_max column of the md table


def test_a_renewed_session_plans_from_the_calibration_alone(tiny_model_path, tiny_close_draft_path):
    """renew() is a fresh process: what earlier steps taught the cost model does not carry into the next
    configuration's plans (it made compare_peers' results depend on the configurations run before)."""
    session = auto_session(tiny_model_path, "ngram-mod,draft-simple", tiny_close_draft_path)
    run(session, PROMPTS[0])
    costs = session.engine.costs
    assert costs.calibrated and costs.observed
    renewed = session.renew(types=["ngram-simple"])
    cold = renewed.engine.costs
    assert cold is not costs and cold.observed == {} and cold.n_observed == {}
    assert (cold.rows, cold.seconds, cold.cache) == (costs.rows, costs.seconds, costs.cache)
    assert renewed.chain.planner.costs is cold
    assert renewed.engine.ctx is session.engine.ctx  # the same models and caches
