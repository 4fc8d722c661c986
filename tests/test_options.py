"""The flag schema (spec_cli/options.py): a command run without flags gets the engine's defaults, bench's sweeps
default to one value each, and bounds read as the error messages say them."""

from __future__ import annotations

from spec_cli.bench.params import BenchParams, from_flags
from spec_cli.cli.options import sampling_params, spec_params
from spec_cli.model.sampling import SamplingParams
from spec_cli.options import MODEL, SAMPLING, SPEC, Opt
from spec_cli.speculative.base import SpecParams


def test_no_flags_give_the_engine_defaults():
    opts = {o.name: o.default for _, group in (MODEL, SAMPLING, SPEC) for o in group}
    assert sampling_params(opts) == SamplingParams()
    assert spec_params(opts) == SpecParams(adaptive=True)  # --draft-max auto: planned lengths up to the default


def test_bench_without_flags_is_its_defaults():
    assert from_flags({}) == BenchParams()


def test_bounds_text():
    def opt(**bounds) -> Opt:
        return Opt("x", float, 0.0, ("--x",), "", **bounds)

    assert opt(ge=0).bounds_text() == ">= 0"
    assert opt(gt=0.0).bounds_text() == "> 0"
    assert opt(ge=0.0, le=1.0).bounds_text() == "in [0, 1]"
    assert opt(gt=0.0, le=1.0).bounds_text() == "in (0, 1]"
    assert opt(ge=0.0, le=1.0).within(1.0) and not opt(gt=0.0, le=1.0).within(0.0)
