"""The flag schema (spec_cli/options.py): a command run without flags gets the engine's defaults, bench's sweeps
default to one value each, bounds read as the error messages say them, and every value is parsed by its option:
a bad one is a UsageError that names the flag."""

from __future__ import annotations

import pytest

from spec_cli.bench.params import BenchParams, from_flags
from spec_cli.cli.settings import sampling_params, spec_params
from spec_cli.errors import UsageError
from spec_cli.model.sampling import SamplingParams
from spec_cli.options import (
    BENCH_OPTIONS,
    MODEL,
    OPTIONS,
    SAMPLING,
    SPEC,
    Opt,
    add_drafter_type,
    drafter_types,
    read_flags,
    spec_type_names,
)
from spec_cli.speculative import registry
from spec_cli.speculative.base import SpecParams


def test_no_flags_give_the_engine_defaults():
    options = {o.name: o for _, group in (MODEL, SAMPLING, SPEC) for o in group}
    opts = read_flags(options, {name: o.default for name, o in options.items()})
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


@pytest.mark.parametrize("name, raw, expected", [
    ("draft_max", "auto", "auto"), ("draft_max", "AUTO", "auto"), ("draft_max", "12", 12),
    ("n_gpu_layers", "all", -1), ("n_gpu_layers", "-1", -1), ("n_gpu_layers", "8", 8),
    ("device", "CUDA:1", "cuda:1"), ("device", "none", "none"), ("dtype", "float16", "f16"),
    ("spec_type", ["mtp,ngram-mod", "draft"], ["ngram-mod", "draft-simple", "draft-mtp"]),
    ("spec_type", ["ngram-mod", "none"], []), ("spec_verify", "Rejection", "rejection"), ("ctx_size", 0, 0),
])
def test_values_parse_once_here(name, raw, expected):
    assert OPTIONS[name].value(raw) == expected


@pytest.mark.parametrize("name, raw, start, end", [
    ("draft_max", "-3", "--draft-max must be a non-negative integer or auto", "(got '-3')"),
    ("spec_type", ["ngram-mod,bogus"], "--spec-type must be drafter types from none, ngram-simple", "(got 'bogus')"),
    ("device", "gpu", "-dev must be auto, cpu, cuda or cuda:N", "(got 'gpu')"),
    ("compile", "maybe", "--compile must be auto, on or off", "(got 'maybe')"),
    ("top_p", 0.0, "--top-p must be in (0, 1]", "(got 0)"),
    ("temp", float("inf"), "--temp must be a finite number", "(got inf)"),
])
def test_a_bad_value_names_its_flag(name, raw, start, end):
    with pytest.raises(UsageError) as e:
        OPTIONS[name].value(raw)
    assert str(e.value).startswith(start) and str(e.value).endswith(end)


def test_a_server_field_names_itself():
    with pytest.raises(UsageError, match="^speculative.types must be drafter types"):
        OPTIONS["spec_type"].value(["bogus"], "speculative.types")


def test_sweeps_parse_with_the_same_parsers():
    assert BENCH_OPTIONS["draft_max"].values(["1-8*2,auto"]) == [1, 2, 4, 8, "auto"]
    assert BENCH_OPTIONS["devices"].values(["cpu,CUDA"]) == ["cpu", "cuda"]
    assert BENCH_OPTIONS["n_threads"].values(["0-2"]) == [0, 1, 2]
    with pytest.raises(UsageError, match="^-t must be >= 0 .got '-2'."):
        BENCH_OPTIONS["n_threads"].values(["-2"])


def test_drafter_types_are_the_registrys():
    """options.py holds --spec-type's names, aliases and priority order; the registry a factory for each."""
    assert drafter_types()[:8] == ["ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache",
                                   "suffix", "draft-simple", "draft-mtp"]
    assert list(registry._FACTORIES) == drafter_types()
    assert spec_type_names()["mtp"] == "draft-mtp" and spec_type_names()["draft"] == "draft-simple"
    with pytest.raises(ValueError, match="taken"):
        add_drafter_type("ngram-mod")
    with pytest.raises(ValueError, match="not a lower-case name"):
        add_drafter_type("Big")
