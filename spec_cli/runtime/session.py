"""A Session: one speculation configuration (SpecParams) running on a loaded, immutable Engine.

    EngineOptions --build_engine--> Engine (models, contexts, tokenizer, cost model)
    Engine + SpecParams --Session--> chain of drafters (+ planner), hidden-state capture, statistics
    Session.generator() --> Generator (the step loop every command shares)

A session owns what a configuration changes: the drafters the registry builds for its spec types (fresh, with
empty n-gram state), the adaptive planner for --draft-max auto, and whether the target keeps its hidden states
for the drafters that read them (draft-mtp, draft-eagle3, draft-dflash). Sessions share their engine's KV caches, so
one lives at a time; other settings mean a new session (`renew`), never an assignment into the engine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from spec_cli.options import AUTO
from spec_cli.runtime.engine import Engine, EngineOptions, build_engine, implied_spec
from spec_cli.runtime.generate import Generator
from spec_cli.speculative.adaptive import Planner
from spec_cli.speculative.base import Drafter, SpecParams
from spec_cli.speculative.chain import Chain
from spec_cli.speculative.registry import DrafterInputs, build_drafters
from spec_cli.speculative.stats import DrafterStats

DrafterMaker = Callable[[DrafterInputs], list[Drafter]]


class Session:
    def __init__(self, engine: Engine, spec: SpecParams, make_drafters: DrafterMaker | None = None):
        """`make_drafters`: builds the chain's drafters instead of the registry's types (bench --spec-accept's
        synthetic drafter); renewed sessions build theirs with it too."""
        self.engine, self.spec, self.make_drafters = engine, spec, make_drafters
        self.chain = build_chain(engine, spec, make_drafters)
        # set either way, so features an earlier session's drafters asked for are not captured past it
        engine.ctx.set_taps(layer for d in self.drafters for layer in d.target_layers())

    @property
    def drafters(self) -> tuple[Drafter, ...]:
        """The chain's drafters, in priority order; none without speculation."""
        return tuple(self.chain.drafters) if self.chain is not None else ()

    @property
    def types(self) -> list[str]:
        """The spec types drafting in this session, in priority order (a server request may choose among them)."""
        return self.chain.names if self.chain is not None else []

    @property
    def stats(self) -> dict[str, DrafterStats]:
        """The chain's counters per drafter, since the session opened."""
        return self.chain.stats if self.chain is not None else {}

    @property
    def n_draft(self) -> int | str:
        """llama.cpp's n_draft figure of a run: the draft bound, or `auto` when the planner chooses."""
        return AUTO if self.spec.adaptive else self.spec.draft_max

    def pooled_stats(self) -> DrafterStats:
        """Every drafter's counters added together (pooled counts, as the server's totals report them)."""
        pooled = DrafterStats("all")
        for st in list(self.stats.values()):  # the server reads this from another thread while drafters run
            pooled.merge(st)
        return pooled

    def generator(self) -> Generator:
        planner = self.chain.planner if self.chain is not None else None
        return Generator(self.engine.ctx, self.engine.eog_ids, self.chain, self.spec.draft_max, self.spec.verify,
                         planner)

    def reset(self) -> None:
        """Empty every KV cache (a fresh run). The drafters keep their state: n-gram state is reset per request by
        `begin`, the ngram-mod pool and the planner's estimates stay (a new session starts them cold)."""
        for ctx in self.engine.contexts:
            ctx.clear()

    def renew(self, keep_stats: bool = False, **spec_changes) -> Session:
        """A cold session on the same engine, as a fresh process would start (empty caches, fresh drafters and
        planner, a cost model that knows only the calibration), with `spec_changes` applied to the settings; this
        one is closed. `keep_stats` carries the drafter counters over (the server's totals never go back). Why the
        cost model too: what one configuration's steps taught it changed how the next one planned (compare_peers
        renews per configuration and prompt: draft-simple on code edits read 1.26x of plain after the n-gram runs
        had refined it, 0.99x from the calibration alone, as a user's process runs it)."""
        stats = self.stats
        self.close()
        self.reset()
        fresh = Session(replace(self.engine, costs=self.engine.costs.cold()), replace(self.spec, **spec_changes),
                        self.make_drafters)
        if keep_stats and fresh.chain is not None:
            fresh.chain.stats = stats
        return fresh

    def close(self) -> None:
        """Stop the target capturing features for this session's drafters."""
        self.engine.ctx.set_taps(())


def open_session(opts: EngineOptions) -> Session:
    """Load the models the options name and open a session with the options' speculation settings: how every
    command and script gets its session."""
    return Session(build_engine(opts), implied_spec(opts))


def build_chain(engine: Engine, spec: SpecParams, make_drafters: DrafterMaker | None = None) -> Chain | None:
    """Fresh drafters (empty n-gram state, cleared draft caches) for the spec types, in the registry's priority
    order (or those `make_drafters` builds); with --draft-max auto, a fresh planner for them on the engine's cost
    model."""
    n_seq = engine.ctx.n_seq
    inputs = DrafterInputs(spec, n_seq, engine.ctx, engine.draft_ctx, engine.mtp_ctx, engine.eagle3_ctx,
                           engine.dflash_ctx, engine.draft_bridge)
    drafters = make_drafters(inputs) if make_drafters is not None else build_drafters(spec.types, inputs)
    if not drafters:
        return None
    planner = Planner(engine.costs, spec.draft_max, engine.ctx.ragged) if spec.adaptive else None
    return Chain(drafters, n_seq, planner, spec.select)
