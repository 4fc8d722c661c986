"""scripts/replay_plans.py: the oracle target replays the steps the real target takes, and the script runs end to
end on the tiny models."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from spec_cli.runtime.session import Session
from spec_cli.speculative.base import SpecParams
from tests.test_generate import PROMPTS, SMALL, make_session, run

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "replay_plans.py"
N = 24


def load_script():
    spec = importlib.util.spec_from_file_location("replay_plans", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_the_oracle_takes_the_real_targets_steps(tiny_model_path):
    """At a fixed draft length an n-gram drafter's drafts depend on the committed tokens only, so replayed against
    the oracle every configuration takes the steps, drafts and acceptances of a run on the real target."""
    rp = load_script()
    real = make_session(tiny_model_path, "ngram-simple", draft_max=4)
    plain = Session(real.engine, SpecParams())
    outputs = rp.greedy_outputs(plain, PROMPTS, N)
    steps = [(s.n_steps, s.n_drafted, s.n_accepted) for s in (run(real, prompt, N)[1] for prompt in PROMPTS)]
    assert sum(n for n, _, _ in steps) < sum(len(out) for out, _ in outputs)  # the drafts pay on these prompts
    costs = rp.FrozenCosts()
    costs.set_points({1: 1.0, 4: 1.5, 64: 32.0})
    oracle = rp.OracleContext(real.engine.ctx, costs)
    virtual = replace(real.engine, ctx=oracle, costs=costs)
    spec = SpecParams(types=["ngram-simple"], draft_max=4, draft_p_min=0.0, **SMALL)
    replayed = [rp.replay(Session(virtual, spec), oracle, [p], [out], N) for p, out in zip(PROMPTS, outputs)]
    assert [(r.steps, r.drafted, r.accepted) for r in replayed] == steps
    # the forwards are charged at the curve's cost: each step's rows, none at their real time
    assert all(r.seconds >= costs(1) * r.steps for r in replayed)


def test_replay_plans_prints_a_table_per_prompt_set(tiny_model_path, tiny_close_draft_path, tmp_path):
    """And with --curves, the first run keeps the curves it timed, the second replays on them (its planner's costs
    refined online)."""
    curves = tmp_path / "curves.json"
    written = None
    for costs in ("frozen", "online"):
        proc = subprocess.run(
            [sys.executable, str(SCRIPT), "-m", str(tiny_model_path), "-md", str(tiny_close_draft_path),
             "--spec-type", "ngram-simple;draft-simple", "--draft-max", "4,auto", "--prompt-set", "code-edit", "-n",
             "8", "-t", "1", "--draft-clock", "curve", "--curves", str(curves), "--costs", costs],
            capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        assert proc.returncode == 0, proc.stderr
        rows = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
        assert rows[0] == "| chain | draft-max 4 | draft-max auto |"
        assert [row.split(" | ")[0] for row in rows[1:]] == ["| ngram-simple", "| draft-simple"]
        saved = json.loads(curves.read_text())
        assert saved["target"]["1"] > 0 and saved["draft"]["1"] > 0
        assert written in (None, curves.stat().st_mtime_ns)  # read, not timed again
        written = curves.stat().st_mtime_ns


@pytest.mark.parametrize("flag, value, says", [
    ("--draft-max", "4,x", "--draft-max must be a non-negative integer or auto (got 'x')"),
    ("--draft-p-min", "2", "--draft-p-min must be in [0, 1] (got '2')"),
    ("--spec-type", "ngram-mod;bogus", "--spec-type must be drafter types from"),
])
def test_a_bad_flag_value_is_a_usage_error(flag, value, says):
    """Read as spec-cli reads them, before a model loads: exit 2 and the flag's message, no traceback."""
    args = {"--spec-type": "ngram-mod", flag: value}
    proc = subprocess.run([sys.executable, str(SCRIPT), "-m", "no-such-model", *(x for kv in args.items() for x in kv)],
                          capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2
    assert says in proc.stderr and "Traceback" not in proc.stderr


def test_a_charged_draft_forward_takes_its_curves_time(monkeypatch):
    """--draft-clock curve: across a draft forward the clock that the step loop and the planner read moves by the
    draft cost curve's seconds for its rows, not by the forward's real time."""
    rp = load_script()
    monkeypatch.setattr(time, "perf_counter", time.perf_counter)  # put back after the test

    class SlowContext:
        def decode(self, batch, **kwargs):
            time.sleep(0.05)
            return len(batch)

    costs = rp.FrozenCosts()
    costs.set_points({1: 0.001, 4: 0.004})
    ctx = SlowContext()
    rp.ChargedDrafts(ctx, costs)
    t0 = time.perf_counter()
    assert ctx.decode([0, 0, 0], head=None) == 3
    assert costs(3) <= time.perf_counter() - t0 < costs(3) + 0.01


def test_the_copy_ceiling_jumps_the_longest_copyable_continuation():
    """Per step the longest continuation that follows the last committed token somewhere earlier (the request's own
    text, or earlier outputs), up to draft_max: here 2 steps, then 3 at a cap of 2, then one for a repeated output."""
    rp = load_script()
    costs = rp.FrozenCosts()
    costs.set_points({1: 1.0, 64: 1.0})  # every forward the same: the speed-up is tokens over steps
    prompt, out = [1, 2, 3, 4, 5], [9, 2, 3, 4, 5, 7]
    assert rp.copy_ceiling([prompt], [(out, None)], 16, costs) == (5 / 2, 2)  # 9 unseen, then 2 -> 3 4 5
    assert rp.copy_ceiling([prompt], [(out, None)], 2, costs) == (5 / 3, 3)
    speed, steps = rp.copy_ceiling([prompt, [8]], [(out, None), (out, None)], 16, costs)
    assert steps == 2 + 1  # the second request copies the first one's output whole


def test_no_copy_drafter_beats_the_copy_ceiling(tiny_model_path):
    """The ceiling bounds what suffix and ngram-cache take: never fewer steps than it at the same draft max."""
    rp = load_script()
    real = make_session(tiny_model_path)
    outputs = rp.greedy_outputs(Session(real.engine, SpecParams()), PROMPTS, N)
    costs = rp.FrozenCosts()
    costs.set_points({1: 1.0, 4: 1.5, 64: 32.0})
    oracle = rp.OracleContext(real.engine.ctx, costs)
    virtual = replace(real.engine, ctx=oracle, costs=costs)
    _, bound = rp.copy_ceiling(PROMPTS, outputs, 4, costs)
    for drafter in ("suffix", "ngram-cache"):
        spec = SpecParams(types=[drafter], draft_max=4, draft_p_min=0.0, **SMALL)
        replayed = rp.replay(Session(virtual, spec), oracle, PROMPTS, outputs, N)
        assert bound <= replayed.steps, drafter
    assert bound < sum(len(out) - 1 for out, _ in outputs)  # these prompts repeat: copying pays


def test_online_replay_costs_learn_the_step_with_its_forward_at_the_curves_cost():
    """--costs online: a step's verify side is learned with the oracle's real forward time swapped for the curve's,
    so what the step loop itself takes is learned and the oracle's speed is not; the frozen curve learns nothing."""
    rp = load_script()
    online, frozen = rp.ReplayedCosts(), rp.FrozenCosts()
    for costs in (online, frozen):
        costs.set_points({1: 1.0, 64: 64.0})
        costs.last_decode = (0.01, costs.curve(3))  # a 3-row oracle forward: 10 ms real, 3 s by the curve
        for _ in range(50):
            costs.observe(3, 0.01 + 0.5)  # the forward's real time and 0.5 s of the step loop's own
    assert online(3) == pytest.approx(3.0 + 0.5, abs=0.02)  # its first estimate, the curve, is forgotten
    assert frozen(3) == 3.0
