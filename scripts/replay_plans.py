"""Draft lengths compared without the machine's noise: the real step loop, drafters and planner run every
configuration over a prompt set's greedy outputs, with the target's forward replaced by an oracle that answers from
those outputs and charges the verify-cost curve's time for its rows.

Why: `spec-cli bench --draft-max 4,8,16,auto` compares configurations that differ by a few percent on a VM that
drifts 15-30 % between runs, and on sets where drafts are rare the differences hide in the noise. Greedy speculation
commits the plain output token for token, so the target's answers are known in advance: what decides the speed is
then how many steps of how many rows each configuration takes, which this replays exactly, plus the drafting,
planning and bookkeeping, which run for real and are timed. The one model in it is the cost of a target forward of
k rows, the same curve `--draft-max auto` plans with (calibrated on this machine, or read from its cache), so a
configuration's modeled speed is what it would run at if forwards cost what the planner believes they cost: `auto`
loses to a fixed length here only by its own choices.

    python scripts/replay_plans.py -m qwen2.5-coder-0.5b --spec-type "ngram-mod;ngram-cache" \
        --draft-max 4,8,16,auto --prompt-set code-edit,writing,chat -n 64

Drafters that read the target's hidden states (draft-mtp, draft-eagle3, draft-dflash, draft-dspark) cannot run
against the oracle; a draft model (-md, draft-simple) runs for real, its forwards taking their real time, or with
`--draft-clock curve` the time of its own cost curve, timed once as the target's is (`ChargedDrafts`).

`--ceiling` adds what a drafter that copies the set's text could reach at best (`copy_ceiling`): the yardstick for
suffix decoding and the n-gram drafters on a set.
"""

from __future__ import annotations

import spec_cli  # noqa: F401  (first: sets the OpenMP wait policy before torch loads)

# isort: split

import argparse
import json
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from spec_cli.errors import UsageError
from spec_cli.model.batch import Batch
from spec_cli.model.context import DecodeOutput
from spec_cli.model.sampling import SamplingParams
from spec_cli.options import OPTIONS, draft_bound
from spec_cli.runtime.engine import EngineOptions, build_engine
from spec_cli.runtime.generate import generate
from spec_cli.runtime.session import Session
from spec_cli.speculative.base import SpecParams
from spec_cli.speculative.verify_costs import CostModel
from spec_cli.text.prompt_sets import load_prompt_set, render_tokens

GREEDY = SamplingParams(temp=0.0)


class FrozenCosts(CostModel):
    """The calibrated curve, not refined by the steps: the oracle's forwards take no real time to learn from."""

    def observe(self, rows: int, seconds: float) -> None:
        pass


class ReplayedCosts(CostModel):
    """The calibrated curve refined online as in a real run, from each step's verify side with its target forward
    taken at the curve's cost instead of the oracle's real time (`--costs online`): the planner then also learns
    what the step loop itself takes, which a real run's estimates include and the frozen curve leaves out."""

    def __init__(self) -> None:
        super().__init__()
        self.last_decode = (0.0, 0.0)  # the oracle's last forward: (its real seconds, the curve's)

    def observe(self, rows: int, seconds: float) -> None:
        real, modeled = self.last_decode
        super().observe(rows, seconds - real + modeled)


class OracleContext:
    """Stands in for the target context: per sequence the whole greedy stream (prompt, then output), each row with
    logits answered by a one-hot row at the stream's next token; every decode adds the curve's seconds for its rows
    to `modeled_s` and its own real time to `real_s` (taken out of the step's measured time)."""

    def __init__(self, ctx, costs: CostModel) -> None:
        self.config, self.device = ctx.config, ctx.device
        self.n_seq, self.n_ctx, self.n_ctx_seq, self.n_batch = ctx.n_seq, ctx.n_ctx, ctx.n_ctx_seq, ctx.n_batch
        self.costs = costs
        self.ragged = True  # a decode is charged for its own rows
        self.streams: dict[int, list[int]] = {}
        self.modeled_s = self.real_s = 0.0

    def step_rows(self, batch: Batch) -> int:
        return len(batch)

    def decode(self, batch: Batch, hidden: bool = False) -> DecodeOutput:
        t0 = time.perf_counter()
        rows = [i for i in range(len(batch)) if batch.logits[i]]
        logits = torch.zeros(len(rows), self.config.n_vocab)
        for r, i in enumerate(rows):
            stream, nxt = self.streams[batch.seq_ids[i]], batch.pos[i] + 1
            logits[r, stream[nxt] if nxt < len(stream) else 0] = 1.0
        modeled, real = self.costs.curve(len(batch)), time.perf_counter() - t0
        if isinstance(self.costs, ReplayedCosts):
            self.costs.last_decode = (real, modeled)
        self.modeled_s += modeled
        self.real_s += real
        return DecodeOutput(logits, None)

    def seq_rm(self, seq: int, p0: int, p1: int = -1) -> None:
        pass

    def clear(self) -> None:
        pass

    def set_taps(self, layers) -> None:
        if tuple(layers):  # a drafter's target_layers: the oracle has no hidden states to give
            raise SystemExit("drafters that read the target's hidden states (draft-mtp, draft-eagle3, draft-dflash, "
                             "draft-dspark) cannot run against the oracle")


class ChargedDrafts:
    """A draft model's forwards charged from its cost curve instead of their real time: time.perf_counter, which the
    step loop, the chain and the planner read, becomes a clock that leaves out each draft forward's real time and
    adds the curve's, so the planner prices drafting, and the replay counts it, alike in every phase of the machine.
    Why: timed for real against the target's curve timed once, draft-max 8 with the 0.5b drafting for the 1.5b
    replayed at 2.06x, 1.85x and 1.34x of plain on the same code edits within an hour."""

    def __init__(self, ctx, costs: CostModel) -> None:
        self.costs = costs
        self.shift = 0.0  # seconds the clock is ahead of the real one: curve less real time, summed over forwards
        self.real_clock = time.perf_counter
        self.decode = ctx.decode
        ctx.decode = self.charged
        time.perf_counter = self.now

    def charged(self, batch: Batch, *args, **kwargs) -> DecodeOutput:
        t0 = self.real_clock()
        out = self.decode(batch, *args, **kwargs)
        self.shift += self.costs(len(batch)) - (self.real_clock() - t0)
        return out

    def now(self) -> float:
        return self.real_clock() + self.shift


@dataclass
class Replay:
    seconds: float = 0.0  # modeled: the oracle's forwards at the curve's cost, the rest of each step as timed
    tokens: int = 0
    steps: int = 0
    drafted: int = 0
    accepted: int = 0


def greedy_outputs(session: Session, prompts: list[list[int]], n_predict: int) -> list[tuple[list[int], int | None]]:
    """The plain greedy output of every prompt on the real target, and the end-of-generation token it stopped at."""
    outputs = []
    for prompt in prompts:
        session.reset()
        out: list[int] = []
        s = generate(session.generator(), prompt, GREEDY, n_predict, on_emit=lambda e: out.extend(e.tokens))
        outputs.append((out, s.id_last if s.finish_reason == "stop" else None))
    return outputs


def replay(session: Session, oracle: OracleContext, prompts: list[list[int]],
           outputs: list[tuple[list[int], int | None]], n_predict: int) -> Replay:
    """Every prompt through `session`'s step loop against the oracle; checks that the output is the plain one."""
    result = Replay()
    for prompt, (expected, stop) in zip(prompts, outputs):
        oracle.streams[0] = prompt + expected + ([stop] if stop is not None else [])
        out: list[int] = []

        def collect(emitted) -> None:
            if not out:  # the first token comes with the prompt, whose forward is not generation time
                oracle.modeled_s = oracle.real_s = 0.0
            out.extend(emitted.tokens)

        gen = session.generator()
        s = generate(gen, prompt, GREEDY, n_predict, on_emit=collect)
        if out != expected:
            raise SystemExit(f"{session.types} {session.n_draft}: the output differs from the plain one")
        result.seconds += gen.timings.t_gen_ms / 1000 - oracle.real_s + oracle.modeled_s
        result.tokens += len(out) - 1
        result.steps += s.n_steps
        result.drafted += s.n_drafted
        result.accepted += s.n_accepted
    return result


def copy_ceiling(prompts: list[list[int]], outputs: list[tuple[list[int], int | None]], draft_max: int,
                 costs: CostModel) -> tuple[float, int]:
    """What a drafter that copies this set's text could reach at best, chain-verified: at every step it drafts, in
    hindsight, the longest continuation of the output (up to draft_max tokens) that follows an occurrence of the
    last committed token in the request's own text so far or in the earlier requests' outputs (the text a suffix
    tree or an n-gram cache holds), all of it accepted, drafting free. Returns the speed-up over plain decoding,
    forwards at the curve's cost and nothing else counted, and the steps. Why: a target for a copy drafter above
    this cannot be met by choosing its drafts better, only by verifying more than one path or by another drafter."""
    def text(tokens: list[int]) -> str:  # token ids as characters, so that str's substring search does the matching
        return "".join(chr(t + 1) for t in tokens)

    earlier, seconds, plain_seconds, steps = "", 0.0, 0.0, 0
    for prompt, (out, _) in zip(prompts, outputs):
        i = 1  # out[i - 1] is the last committed token (out[0] comes with the prompt)
        while i < len(out):
            source = text(prompt + out[: i - 1]) + "\0" + earlier  # not the last token's own place
            n = 0
            while n < draft_max and i + n < len(out) and text(out[i - 1 : i + n + 1]) in source:
                n += 1
            seconds += costs(n + 1)
            steps += 1
            i += n + 1
        plain_seconds += costs(1) * (len(out) - 1)
        earlier += "\0" + text(out)
    return plain_seconds / seconds if seconds else 1.0, steps


def timed_curves(engine, plain: Session, prompt: list[int], draft_clock: str,
                 path: Path | None) -> tuple[dict[int, float], dict[int, float] | None]:
    """Seconds by rows of the target's forwards (the curve `auto` plans with) and, with --draft-clock curve, of the
    draft model's: read from `path` where it exists, so that replays in other processes run on the same curves
    (timed at another moment, they follow the machine's phase), else timed now and kept in `path`."""
    if path is not None and path.exists():
        saved = json.loads(path.read_text())
        target, draft = ({int(rows): s for rows, s in curve.items()} if curve else None
                         for curve in (saved["target"], saved.get("draft")))
        if draft is None and draft_clock == "curve" and engine.draft_ctx is not None:
            raise SystemExit(f"{path} has no draft model curve: time one with --draft-clock curve")
        return target, draft
    if not engine.costs.calibrated:  # at the first prompt's depth, as a command's first step does
        plain.reset()
        plain.generator().start(0, prompt, GREEDY, 1)
        engine.costs.calibrate(engine.ctx, 0)
    target, draft = dict(zip(engine.costs.rows, engine.costs.seconds)), None
    if draft_clock == "curve" and engine.draft_ctx is not None:
        timed = CostModel()
        timed.calibrate(engine.draft_ctx, 0)
        draft = dict(zip(timed.rows, timed.seconds))
    if path is not None:
        path.write_text(json.dumps({"target": target, "draft": draft}))
    return target, draft


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("-md", "--model-draft", default=None)
    ap.add_argument("--spec-type", required=True, help="chains separated by ';', drafters of one chain by ','")
    ap.add_argument("--draft-max", default="4,8,16,auto")
    ap.add_argument("--prompt-set", default="code-edit,writing,chat")
    ap.add_argument("-n", "--n-predict", type=int, default=64)
    ap.add_argument("--draft-p-min", default=SpecParams.draft_p_min,
                    help="a draft model's p-min: a probability or auto (spec-cli's --draft-p-min)")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--draft-clock", choices=("real", "curve"), default="real",
                    help="a draft model's forwards at their real time, or at its cost curve's (timed at the start)")
    ap.add_argument("--curves", type=Path, help="JSON of the timed curves: read where it exists, else written")
    ap.add_argument("--costs", choices=("frozen", "online"), default="frozen",
                    help="the planner's verify costs: the calibrated curve as it is, or refined by the steps as in a "
                         "real run (the curve's cost for the forward plus the step loop's own time)")
    ap.add_argument("--ceiling", action="store_true",
                    help="add a row: a copy drafter's best in hindsight (the longest continuation of the output found "
                         "after the last token in the text copied from, all accepted; forwards only)")
    args = ap.parse_args()
    try:  # as spec-cli reads them: a bad value is a usage error, not a traceback
        p_min = OPTIONS["draft_p_min"].value(args.draft_p_min)
        lengths = [OPTIONS["draft_max"].value(v) for v in args.draft_max.split(",")]
        chains = [OPTIONS["spec_type"].value(chain) for chain in args.spec_type.split(";")]
    except UsageError as e:
        ap.error(str(e))
    torch.set_num_threads(args.threads)
    engine = build_engine(EngineOptions(model=args.model, model_draft=args.model_draft, n_ctx=4096,
                                        threads=args.threads))
    plain = Session(engine, SpecParams())
    set_names = args.prompt_set.split(",")
    first = render_tokens(load_prompt_set(set_names[0]).prompts[0], engine.tokenizer)
    target_curve, draft_curve = timed_curves(engine, plain, first, args.draft_clock, args.curves)
    def fresh_costs() -> CostModel:  # per configuration: what one configuration's steps teach stays its own
        costs = ReplayedCosts() if args.costs == "online" else FrozenCosts()
        costs.set_points(target_curve)
        return costs

    costs = fresh_costs()
    if args.draft_clock == "curve" and draft_curve is not None:
        draft_costs = FrozenCosts()
        draft_costs.set_points(draft_curve)
        ChargedDrafts(engine.draft_ctx, draft_costs)
    print(f"{args.model}, -n {args.n_predict}, {args.threads} threads, draft clock {args.draft_clock}, p-min "
          f"{p_min}: modeled speed-up over plain decoding (steps; draft tokens accepted / drafted)")
    for set_name in set_names:
        prompts = [render_tokens(p, engine.tokenizer) for p in load_prompt_set(set_name).prompts]
        outputs = greedy_outputs(plain, prompts, args.n_predict)
        oracle = OracleContext(engine.ctx, costs)
        virtual = replace(engine, ctx=oracle, costs=costs)
        base = replay(Session(virtual, SpecParams()), oracle, prompts, outputs, args.n_predict)
        print(f"\n{set_name}: plain {base.tokens / base.seconds:.1f} tok/s modeled, {base.steps} steps\n")
        print("| chain | " + " | ".join(f"draft-max {n}" for n in lengths) + " |")
        print("|---|" + "---:|" * len(lengths))
        for chain in chains:
            cells = []
            for n in lengths:
                bound, adaptive = draft_bound(n)
                spec = SpecParams(types=chain, draft_max=bound, adaptive=adaptive, draft_p_min=p_min)
                oracle.costs = fresh_costs()
                r = replay(Session(replace(virtual, costs=oracle.costs), spec), oracle, prompts, outputs,
                           args.n_predict)
                speed = (r.tokens / r.seconds) / (base.tokens / base.seconds)
                cells.append(f"{speed:.3f} ({r.steps}; {r.accepted}/{r.drafted})")
            print(f"| {','.join(chain)} | " + " | ".join(cells) + " |")
        if args.ceiling:
            bounds = [copy_ceiling(prompts, outputs, draft_bound(n)[0], costs) for n in lengths]
            print("| copy ceiling | " + " | ".join(f"{speed:.3f} ({steps})" for speed, steps in bounds) + " |")


if __name__ == "__main__":
    main()
