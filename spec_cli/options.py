"""Every flag of the commands, declared once: name, type, default, spellings (llama.cpp's, both generations of
names), help, bounds and the parser of its value.

The package's lowest layer (it imports nothing of spec_cli but errors), so that everything takes its defaults and
its checks from here: the engine's dataclasses (SamplingParams, SpecParams, EngineOptions, Context, TrainConfig),
the typer options of every command (cli/options.py `with_options`, which hands a command its flags' values parsed
and checked), bench's sweep axes and the defaults its printers hide (bench/params.py), and the bounds and parsers the
server checks requests with (server/protocol.py). A group is (help panel, options), in the order --help lists them;
`pick` takes the options a tool reads from one.

A flag's value is parsed once, here: `Opt.value` (one value, as typer converted it) and `Opt.values` (a bench sweep)
run the option's parser, then its bounds; a bad value is a UsageError that names the flag. The deep modules receive
typed values.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional

from spec_cli.errors import UsageError


class Invalid(Exception):
    """A parser's complaint: what the value must be ('a non-negative integer or auto'), and which part of it is
    wrong where that is not the whole value. `Opt.value` words it with the flag: `--draft-max must be ... (got 'x')`."""

    def __init__(self, expected: str, got: str | None = None):
        super().__init__(expected)
        self.got = got

    def usage(self, name: str, value: Any) -> UsageError:
        """The error of `name` (a flag) given `value`."""
        got = value if self.got is None else self.got
        return UsageError(f"{name} must be {self} (got {_quoted(got)})")


FLOAT32_MAX = 3.4028234663852886e38  # the largest float32: sampling and the kernels compute in float32
Parser = Callable[[Any], Any]  # a flag's value as typer converted it (str, int or list) -> what the engine takes


@dataclass(frozen=True)
class Opt:
    name: str  # the parameter: the key of the command's flag values, and the engine's field where the names agree
    annotation: Any
    default: Any  # as the command line would give it ("auto"): it goes through `parse` like a typed value
    flags: tuple[str, ...]
    help: str
    metavar: str | None = None  # None: typer's, from the annotation
    parse: Parser | None = None  # None: the value as typer converted it
    sweep: bool = False  # bench takes a list of values to sweep (comma lists, ranges, a repeated flag)
    split: str | None = ","  # what separates a sweep's values inside one flag (None: each flag is one value)
    # bounds, named as pydantic names them (the server's request fields take them as they are)
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None

    def bounds(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in ("ge", "gt", "le", "lt") if getattr(self, k) is not None}

    def within(self, value: float) -> bool:
        return ((self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
                and (self.le is None or value <= self.le) and (self.lt is None or value < self.lt))

    def bounds_text(self) -> str:
        """The bounds as error messages say them: '>= 0', '> 0', 'in [0, 1]', 'in (0, 1]'."""
        low = f"[{shown(self.ge)}" if self.ge is not None else f"({shown(self.gt)}"
        if self.le is None and self.lt is None:
            return (">= " if low[0] == "[" else "> ") + low[1:]
        high = f"{shown(self.le)}]" if self.le is not None else f"{shown(self.lt)})"
        return f"in {low}, {high}"

    def value(self, raw: Any, name: str | None = None) -> Any:
        """What a command reads from the value its flag was given (as typer converted it): parsed, then checked
        against the bounds; None (left out, no default) stays None. `name`: what a message calls the value, the
        flag unless a server request field that mirrors it."""
        if raw is None:
            return None
        try:
            return self.check(self.parse(raw) if self.parse else raw)
        except Invalid as e:
            raise e.usage(name or self.flags[0], raw) from None

    def check(self, value: Any) -> Any:
        """`value` if it is within the bounds (and, a float, within float32's range: the engine computes in float32,
        where a larger value is inf); else Invalid."""
        if isinstance(value, float) and not (math.isfinite(value) and abs(value) <= FLOAT32_MAX):
            raise Invalid(f"a finite number of float32's range (at most {FLOAT32_MAX:.4g})")
        if isinstance(value, (int, float)) and not self.within(value):
            raise Invalid(self.bounds_text())
        return value

    def values(self, texts: list[str] | None) -> list | None:
        """A bench sweep's values from its flag's strings (None where the flag was left out), in order: repeated
        flags, `split`-separated lists and, for values that parse, llama-bench's integer ranges N-M, N-M+STEP and
        N-M*MULT (the last value only where the steps reach it exactly)."""
        if not texts:
            return None
        parse = self.parse or _SWEPT.get(self.annotation, nonempty)
        whole = self.annotation in (int, Optional[int]) or self.parse in (gpu_layers, draft_max)  # ranges apply
        out: list = []
        for item in (i.strip() for t in texts for i in (t.split(self.split) if self.split else [t])):
            try:
                out += [self.check(parse(text)) for text in (_range(item) if whole else [item])]
            except Invalid as e:
                raise e.usage(self.flags[0], item) from None
        return out


def read_flags(options: dict[str, Opt], raw: dict[str, Any]) -> dict[str, Any]:
    """A command's flag values as typer gives them -> what the command reads: each one parsed and checked by its
    option (`Opt.value`; a bench sweep's strings by `Opt.values`)."""
    return {name: options[name].values(v) if options[name].sweep else options[name].value(v) for name, v in raw.items()}


def shown(value: Any) -> str:
    """A value as help and messages print it: floats without trailing zeros (0.75, 0, 1)."""
    return f"{value:g}" if isinstance(value, float) else str(value)


def _quoted(value: Any) -> str:
    return f"'{value}'" if isinstance(value, str) else shown(value)


def pick(group, *names: str):
    """A sub-group of a shared option group: the same flags and help, only the options a tool reads."""
    panel, opts = group
    return panel, [o for o in opts if o.name in names]


# --- parsers: one value (a string, or what typer converted it to) -> the engine's value, or Invalid ---------------


def _words(words: tuple[str, ...]) -> str:
    return f"{', '.join(words[:-1])} or {words[-1]}" if len(words) > 1 else words[0]


def choice(*words: str, aliases: dict[str, Any] | None = None) -> Parser:
    """One of `words`, in any case, or of `aliases` for the value each stands for."""
    known = {**{w: w for w in words}, **(aliases or {})}

    def parse(value: str) -> Any:
        word = str(value).strip().lower()
        if word not in known:
            raise Invalid(_words(words))
        return known[word]

    return parse


GPU_LAYERS_ALL = "auto"  # -ngl / -ngld default: every block on the GPU (no fitting to free memory)


def gpu_layers(value: str) -> int:
    """llama.cpp's N | auto | all for -ngl / -ngld; auto and all (and -1) put every block on the GPU: -1."""
    word = str(value).strip().lower()
    if word in (GPU_LAYERS_ALL, "all"):
        return -1
    if not re.fullmatch(r"-1|\d+", word):
        raise Invalid("a number of blocks, auto or all")
    return int(word)


AUTO = "auto"  # --draft-max auto: the adaptive draft length (speculative/adaptive.py)
DRAFT_MAX = 16  # llama.cpp's --draft-max: the draft length where no flag asks for one, and auto's upper bound


def draft_max(value: str | int) -> int | str:
    """A --draft-max value: a non-negative integer or `auto` (kept as the string, so bench rows read back)."""
    word = str(value).strip().lower()
    if word == AUTO:
        return AUTO
    if not word.isdigit():
        raise Invalid("a non-negative integer or auto")
    return int(word)


def draft_bound(value: int | str) -> tuple[int, bool]:
    """A parsed --draft-max as (upper bound on a draft, adaptive?): auto plans lengths up to DRAFT_MAX."""
    return (DRAFT_MAX, True) if value == AUTO else (int(value), False)


# llama.cpp's --draft-p-min: what `--draft-p-min auto` (the default) stops a draft below where no draft gate does
# (a fixed --draft-max; DFlash and DSpark blocks). Under --draft-max auto a token-by-token model drafter's gate
# (speculative/confidence.py) prices every token by its calibrated acceptance, and a floor of 0.75 on top threw away
# tokens it would have kept: the 0.5b drafting for the 1.5b on chat ran at 1.16x of plain with the floor and 1.40x
# without (docs/speculation.md, the draft gate).
DRAFT_P_MIN = 0.75


def draft_p_min(value: str | float) -> float | str:
    """A --draft-p-min value: a probability in [0, 1] or `auto` (kept as the string, so bench rows read back)."""
    word = str(value).strip().lower()
    if word == AUTO:
        return AUTO
    try:
        return float(word)
    except ValueError:
        raise Invalid("a probability in [0, 1] or auto") from None


def p_min_floor(value: float | str, gated: bool) -> float:
    """The top-1 probability a model drafter stops below, from a parsed --draft-p-min: `auto` is none where a draft
    gate stops the draft (`gated`), else DRAFT_P_MIN."""
    if value == AUTO:
        return 0.0 if gated else DRAFT_P_MIN
    return float(value)


def device(value: str) -> str:
    """-dev / -devd: auto | cpu | cuda | cuda:N, and llama.cpp's none (= cpu); lower-cased."""
    word = str(value).strip().lower()
    if not re.fullmatch(r"auto|cpu|none|cuda(:\d+)?", word):
        raise Invalid("auto, cpu, cuda or cuda:N")
    return word


DTYPES = ("auto", "q", "f32", "f16", "bf16")  # --dtype (model/loader.py weight_format)
dtype = choice(*DTYPES, aliases={"float32": "f32", "float16": "f16", "bfloat16": "bf16"})

# --spec-type's drafter types in llama.cpp's priority order (the order a chain asks its drafters in, whatever the
# command line says), each with its aliases. speculative/registry.py builds the drafters of these names; a type
# registered there at run time (a plugin's) is appended by `add_drafter_type`.
_DRAFTER_TYPES: dict[str, tuple[str, ...]] = {
    "ngram-simple": (), "ngram-map-k": (), "ngram-map-k4v": (), "ngram-mod": (), "ngram-cache": (), "suffix": (),
    "draft-simple": ("draft",), "draft-mtp": ("mtp",), "draft-eagle3": ("eagle3",), "draft-dflash": ("dflash",),
    "draft-dspark": ("dspark",),
}
_TYPE_NAME = re.compile(r"[a-z0-9][a-z0-9_.-]*")  # --spec-type values are lower-cased and split at commas


def add_drafter_type(name: str, aliases: tuple[str, ...] = ()) -> None:
    """Make `name` (and `aliases`) a --spec-type, asked after the types before it."""
    for n in (name, *aliases):
        if not _TYPE_NAME.fullmatch(n) or n == "none" or n in spec_type_names():
            raise ValueError(f"cannot register drafter type '{n}': taken, or not a lower-case name")
    _DRAFTER_TYPES[name] = tuple(aliases)


def drafter_types() -> list[str]:
    """The canonical names, in priority order."""
    return list(_DRAFTER_TYPES)


def spec_type_names() -> dict[str, str]:
    """Every name --spec-type accepts but `none` -> its canonical name: the types in priority order, then aliases."""
    return {**{n: n for n in _DRAFTER_TYPES}, **{a: n for n, aliases in _DRAFTER_TYPES.items() for a in aliases}}


def _spec_type_list() -> str:
    return ", ".join(["none", *("|".join((n, *aliases)) for n, aliases in _DRAFTER_TYPES.items())])


def spec_types(values: list[str] | str) -> list[str]:
    """--spec-type: comma lists, repeatable; `none` anywhere disables; canonical names in priority order."""
    known = spec_type_names()
    names: list[str] = []
    for raw in (r for value in ([values] if isinstance(values, str) else values) for r in value.split(",")):
        name = raw.strip().lower()
        if name and name != "none" and name not in known:
            raise Invalid(f"drafter types from {_spec_type_list()}", got=raw.strip())
        names += [known.get(name, name)] if name else []
    return [] if "none" in names else [n for n in _DRAFTER_TYPES if n in names]


def spec_chain(value: str) -> str:
    """One sweep value of bench's --spec-type: a chain as in every command, canonical names joined by ','
    ("" for none)."""
    if "+" in value:  # the syntax of earlier versions, where a comma started the next sweep value
        raise Invalid("chains of drafters joined with ',' (ngram-mod,draft-simple), separated by ';' or a repeated "
                      "--spec-type")
    return ",".join(spec_types(value))


PROMPT_SETS = ("code-edit", "summarize", "qa", "writing", "chat", "agentic")  # text/prompts/<name>.jsonl


def prompt_set(value: str) -> str:
    """A built-in prompt set's name or a .jsonl file (text/prompt_sets.py reads it)."""
    if value not in PROMPT_SETS and not Path(value).is_file():
        raise Invalid(f"a built-in set ({_words(PROMPT_SETS)}) or a .jsonl file")
    return value


def spec_accept(value: str) -> str:
    """bench --spec-accept: a conditional acceptance rate in [0, 1], or one per draft position joined by '/' (the
    last one for the positions after it); kept as text, canonical ('0.90/0.8' -> '0.9/0.8'), for the rows."""
    return "/".join(shown(r) for r in accept_rates(value))


def accept_rates(text: str) -> list[float]:
    """The rates of a --spec-accept value."""
    try:
        rates = [float(part) for part in str(text).split("/")]
    except ValueError:
        raise Invalid("a rate in [0, 1] or rates per draft position joined by / (0.9/0.8/0.6)") from None
    if not all(0.0 <= r <= 1.0 for r in rates):
        raise Invalid("rates in [0, 1]")
    return rates


def nonempty(value: str) -> str:
    if not value:
        raise Invalid("non-empty")
    return value


def _whole(value: str) -> int:
    if not re.fullmatch(r"-?\d+", value):
        raise Invalid("N, N-M, N-M+STEP or N-M*MULT")
    return int(value)


def _number(value: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise Invalid("a number") from None


_SWEPT: dict[Any, Parser] = {int: _whole, Optional[int]: _whole, float: _number}  # sweeps without their own parser
_RANGE = re.compile(r"(\d+)-(\d+)(?:([+*])(\d+))?")


def _range(item: str) -> list[str]:
    """llama-bench's `first-last`, `first-last+step` and `first-last*mult` as the numbers they stand for (last only
    where reached exactly); any other item as it is."""
    m = _RANGE.fullmatch(item)
    if not m:
        return [item]
    first, last, op, step = int(m[1]), int(m[2]), m[3] or "+", int(m[4] or 1)
    if last < first:
        raise Invalid("an increasing range")
    out = []
    while first <= last:
        out.append(str(first))
        nxt = first + step if op == "+" else first * step
        if nxt <= first:  # +0, *1 or 0*N would never end
            raise Invalid("a range whose step makes it increase")
        first = nxt
    return out


def pair(value: str) -> tuple[int, int]:
    """-pg PP,TG."""
    parts = value.split(",")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise Invalid("PP,TG")
    return int(parts[0]), int(parts[1])


# --- the flags -------------------------------------------------------------------------------------------------------

DEFAULT_GPU_LAYERS = gpu_layers(GPU_LAYERS_ALL)  # the -ngl / -ngld default as the loader takes it
RANDOM_SEED = -1  # llama.cpp LLAMA_DEFAULT_SEED (what `-s -1` parses to): pick a fresh seed per sampler
DRAFT_VOCAB = 32768  # tokens a draft model / trained MTP head drafts among (--draft-vocab, mtp-train --draft-vocab)
COMPILE_MODES = ("auto", "on", "off")  # --compile (model/compiled.py)
VERIFY_MODES = ("auto", "match", "rejection")  # --spec-verify (speculative/verify.py)
SELECT_MODES = ("priority", "gain")  # --spec-select (speculative/chain.py)
ROLLBACK_MODES = ("partial", "reeval")  # --spec-mtp-rollback (speculative/mtp.py)

MODEL = ("Model and context", [
    Opt("model", Optional[str], None, ("-m", "--model"), "GGUF file or models.toml name (default: the default model)"),
    Opt("ctx_size", int, 4096, ("-c", "--ctx-size"), "context size in tokens, split across sequences (0 = model's)",
        ge=0),
    Opt("batch_size", int, 2048, ("-b", "--batch-size"), "logical batch size (max rows per decode)", ge=1),
    Opt("ubatch_size", int, 512, ("-ub", "--ubatch-size"), "physical batch size (rows per forward)", ge=1),
    Opt("threads", Optional[int], None, ("-t", "--threads"), "CPU threads (default, or 0: torch's)", ge=0),
    Opt("n_gpu_layers", str, GPU_LAYERS_ALL, ("-ngl", "--n-gpu-layers", "--gpu-layers"),
        "blocks on the GPU, last first: N, or auto | all | -1 = every block", parse=gpu_layers),
    Opt("device", str, "auto", ("-dev", "--device"), "auto | cpu | cuda | cuda:N", parse=device),
    Opt("tensor_parallel", int, 1, ("-tp", "--tensor-parallel"),
        "shard the model over N ranks of torch.distributed (gloo on the CPU, NCCL on CUDA); the command spawns "
        "them, or torchrun --nproc-per-node N starts them", ge=1),
    Opt("dtype", str, "auto", ("--dtype",),
        "auto (q on the CPU, bf16 on CUDA) | q (GGUF weights kept quantized on the CPU, 3-4x faster than f32) | f32 | "
        "f16 | bf16", parse=dtype),
    Opt("compile", str, "auto", ("--compile",),
        "auto | on | off: the decode/verify step (target and draft model) through torch.compile, CUDA graphs on "
        "CUDA; auto = off where it has not measurably won (everywhere so far: README)", parse=choice(*COMPILE_MODES)),
])

SAMPLING = ("Sampling", [
    Opt("seed", int, RANDOM_SEED, ("-s", "--seed"), "RNG seed (-1 = random)", ge=RANDOM_SEED, lt=2**64),
    Opt("temp", float, 0.8, ("--temp", "--temperature"), "temperature; <= 0 is greedy"),
    Opt("top_k", int, 40, ("--top-k",), "top-k sampling (0 = off)", ge=0),
    Opt("top_p", float, 0.95, ("--top-p",), "top-p sampling (1.0 = off)", gt=0.0, le=1.0),
    Opt("min_p", float, 0.05, ("--min-p",), "min-p sampling (0.0 = off)", ge=0.0, le=1.0),
    Opt("repeat_penalty", float, 1.0, ("--repeat-penalty",), "penalize repeated tokens (1.0 = off)", gt=0.0),
    Opt("repeat_last_n", int, 64, ("--repeat-last-n",), "tokens considered by the penalties", ge=-1),
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


def _ngram(name: str, default: int, help: str, ge: int = 1) -> Opt:
    """A per-drafter n-gram setting: llama.cpp's flag is `--spec-` + the SpecParams field."""
    return _drafter_setting(name, int, default, help, ge=ge)


def _drafter_setting(name: str, annotation: Any, default: Any, help: str, **bounds) -> Opt:
    """A setting of one drafter type, whose SpecParams field starts with the type's name: the flag is `--spec-` +
    the field (bench sweeps these, and a chain without the type makes no runs of them)."""
    return Opt(name, annotation, default, ("--spec-" + name.replace("_", "-"),), help, **bounds)


SUFFIX_CACHE_TOKENS = 262144  # --spec-suffix-cache-tokens: 1 MiB of int32, a ~0.5 ms scan on a shared 2-core CPU


SPEC = ("Speculative decoding", [
    Opt("spec_type", Optional[list[str]], None, ("--spec-type",),
        f"drafters, comma list, repeatable: {_spec_type_list()}", parse=spec_types),
    Opt("spec_default", bool, False, ("--spec-default",),
        "llama.cpp's default speculative config: ngram-mod with its --spec-ngram-mod-* settings (added to any "
        "--spec-type chain)"),
    Opt("model_draft", Optional[str], None, ("-md", "--model-draft", "--spec-draft-model"),
        "draft (GGUF or name); alone it enables its file's kind: a model draft-simple, an EAGLE-3 head draft-eagle3, "
        "a model with NextN layers draft-mtp"),
    Opt("n_gpu_layers_draft", str, GPU_LAYERS_ALL, ("-ngld", "--n-gpu-layers-draft", "--gpu-layers-draft",
                                                    "--spec-draft-ngl"),
        "draft blocks on the GPU: N, or auto | all | -1 = every block", parse=gpu_layers),
    Opt("device_draft", Optional[str], None, ("-devd", "--device-draft", "--spec-draft-device"),
        "draft device (default: the target's; none = cpu)", parse=device),
    Opt("ctx_size_draft", int, 0, ("-cd", "--ctx-size-draft"), f"no effect: {NO_EFFECT['-cd']}", ge=0),
    Opt("threads_draft", Optional[int], None, ("-td", "--threads-draft", "--spec-draft-threads"),
        f"no effect: {NO_EFFECT['-td']}", ge=0),
    Opt("draft_max", str, AUTO, ("--draft-max", "--draft", "--draft-n", "--spec-draft-n-max"),
        "max draft tokens per step (N), or auto: per step the length that maximizes expected tokens/s from the "
        f"measured verify cost and each drafter's acceptance (at most {DRAFT_MAX})", parse=draft_max),
    Opt("draft_min", int, 0, ("--draft-min", "--draft-n-min", "--spec-draft-n-min"),
        "min draft tokens (else no draft)", ge=0),
    Opt("draft_p_min", str, AUTO, ("--draft-p-min", "--spec-draft-p-min"),
        f"a draft model or head stops below this top-1 probability; auto: where its next token stops paying under "
        f"--draft-max auto (its calibrated gate), else {shown(DRAFT_P_MIN)}", parse=draft_p_min, ge=0.0, le=1.0),
    Opt("draft_vocab", int, DRAFT_VOCAB, ("--draft-vocab", "--spec-draft-vocab"),
        "draft-simple drafts among the N tokens its vocabulary ranks most common plus every token of the requests "
        "(a small draft model's output matrix is much of its step); 0 = the whole vocabulary", ge=0),
    Opt("spec_verify", str, "auto", ("--spec-verify",), "auto | match | rejection", parse=choice(*VERIFY_MODES)),
    Opt("spec_select", str, "priority", ("--spec-select",),
        "which draft a step verifies: priority = llama.cpp's fixed order, first non-empty draft wins; gain = every "
        "n-gram drafter proposes, the draft with the most expected accepted tokens wins (model drafters are asked "
        "only where none proposed)", parse=choice(*SELECT_MODES)),
    Opt("spec_mtp_rollback", str, "partial", ("--spec-mtp-rollback",),
        "draft-mtp after a verify: partial = keep the head's KV rows of accepted draft tokens (as llama.cpp); "
        "reeval = re-decode them from the target's hidden states", parse=choice(*ROLLBACK_MODES)),
    _ngram("ngram_simple_size_n", 12, "ngram-simple pattern length"),
    _ngram("ngram_simple_size_m", 48, "ngram-simple draft length"),
    _ngram("ngram_simple_min_hits", 1, "ngram-simple min hits (unused, as llama.cpp)", ge=0),
    _ngram("ngram_map_k_size_n", 12, "ngram-map-k key length"),
    _ngram("ngram_map_k_size_m", 48, "ngram-map-k draft length"),
    _ngram("ngram_map_k_min_hits", 1, "ngram-map-k min hits", ge=0),
    _ngram("ngram_map_k4v_size_n", 12, "ngram-map-k4v key length"),
    _ngram("ngram_map_k4v_size_m", 48, "ngram-map-k4v draft length"),
    _ngram("ngram_map_k4v_min_hits", 1, "ngram-map-k4v min hits", ge=0),
    _ngram("ngram_mod_n_match", 24, "ngram-mod hashed n-gram length"),
    _ngram("ngram_mod_n_min", 48, "ngram-mod min draft length", ge=0),
    _ngram("ngram_mod_n_max", 64, "ngram-mod max draft length"),
    _drafter_setting("suffix_max_depth", int, 24, "suffix: most tokens of pattern + draft (the suffix trees' depth, "
                     "vLLM's suffix_decoding_max_tree_depth)", ge=2),
    _drafter_setting("suffix_max_spec_factor", float, 1.0, "suffix: a draft is at most this many times as long as "
                     "the pattern it matched (SuffixDecoding's max_spec_factor)", ge=0.0),
    _drafter_setting("suffix_min_token_prob", float, 0.1, "suffix: a draft stops where its estimated probability "
                     "(the product of continuation frequencies along it) falls below this (min_token_prob)",
                     ge=0.0, le=1.0),
    _drafter_setting("suffix_cache_tokens", int, SUFFIX_CACHE_TOKENS, "suffix: tokens of finished requests' outputs "
                     "every slot and request drafts from (the global tree), the oldest request dropped first; 0 = "
                     "each request's own prompt and output only", ge=0),
    Opt("lookup_cache_static", Optional[str], None, ("-lcs", "--lookup-cache-static"), "static n-gram cache file"),
    Opt("lookup_cache_dynamic", Optional[str], None, ("-lcd", "--lookup-cache-dynamic"), "dynamic n-gram cache file"),
])

PROMPT = ("Prompt and output", [
    Opt("prompt", Optional[str], None, ("-p", "--prompt"), "prompt text (special tokens like <|im_start|> are parsed)"),
    Opt("file", Optional[str], None, ("-f", "--file"), "read the prompt from a file"),
    Opt("n_predict", int, -1, ("-n", "--n-predict"), "tokens to generate (-1 = until end of generation or context)",
        ge=-1),
    Opt("conversation", bool, False, ("-cnv", "--conversation", "--chat"),
        "chat mode: apply the model's chat template (interactive when stdin is a terminal)"),
    Opt("chat_template", Optional[str], None, ("--chat-template",), "override the chat template (jinja or chatml|gemma)"),
    Opt("json_output", bool, False, ("--json",), "print one JSON object (text, timings, statistics) instead of streaming"),
])

LOG = ("Prompt and output", [
    Opt("log_format", str, "table", ("--log-format",), "end-of-run statistics: table (rich) | text (llama.cpp's lines)",
        parse=choice("table", "text")),
])

OPTIONS = {o.name: o for _, opts in (MODEL, SAMPLING, SPEC, PROMPT, LOG) for o in opts}


def default(name: str) -> Any:
    """The default of a shared option (the engine's dataclasses take theirs from here)."""
    return OPTIONS[name].default


def _swept(shared: str, **changes) -> Opt:
    """A shared option as a bench sweep axis; `changes`: bench's own name, spellings or help."""
    return replace(OPTIONS[shared], sweep=True, **changes)


DRAFTER_SETTINGS = ("ngram_", "suffix_")  # the prefixes of the model-free drafters' own settings (bench sweeps them)
BENCH_SEED = 42  # bench -s: every run and every configuration sees the same inputs
FLASH_ATTN = {"auto": -1, "-1": -1, "off": 0, "0": 0, "false": 0, "on": 1, "1": 1, "true": 1}  # llama-bench's -fa
OUTPUT_FORMATS = ("md", "csv", "json", "jsonl", "sql", "none")  # bench -o / -oe (bench/printers.py)

# `spec-cli bench`: its own flags and the shared ones it sweeps. A sweep's default is one value, shown in its help
BENCH = [
    ("Engine parameters (lists)", [
        Opt("model", str, None, ("-m", "--model"), "GGUF files or models.toml names (default: the default model)",
            sweep=True),
        Opt("n_prompt", int, 512, ("-p", "--n-prompt"), "pp test prompt lengths", sweep=True, ge=0),
        Opt("n_gen", int, 128, ("-n", "--n-gen"), "tg test lengths; in a speculative sweep, tokens generated per "
            "prompt", sweep=True, ge=0),
        Opt("n_pg", str, None, ("-pg",), "PP,TG: a prompt + generation test (repeatable)", parse=pair, sweep=True,
            split=None),
        Opt("n_depth", int, 0, ("-d", "--n-depth"), "tokens already in the KV cache", sweep=True, ge=0),
        _swept("batch_size", name="n_batch", help="logical batch size"),
        _swept("ubatch_size", name="n_ubatch", help="physical batch size"),
        _swept("threads", name="n_threads"),
        _swept("device", name="devices"),
        Opt("flash_attn", str, "auto", ("-fa", "--flash-attn"),
            f"on | off | auto: recorded in the rows, no effect: {NO_EFFECT['-fa']}",
            parse=choice(*FLASH_ATTN, aliases=FLASH_ATTN), sweep=True),
        _swept("n_gpu_layers"),
        _swept("dtype"),
        _swept("compile", help="auto | on | off: torch.compile / CUDA graphs for the decode step (compile time "
               "in the rows)"),
        OPTIONS["tensor_parallel"],  # one value: a command holds one group of ranks
    ]),
    ("Speculative sweep (lists)", [
        Opt("spec_type", str, None, ("--spec-type",), "drafter chains to sweep: a comma list is one chain as in "
            "every command (ngram-mod,draft-simple); ';' or a repeated flag starts the next value", parse=spec_chain,
            sweep=True, split=";"),
        Opt("model_draft", str, None, ("-md", "--model-draft"), "draft models (alone: sweeps draft-simple)",
            sweep=True),
        Opt("draft_max", int, DRAFT_MAX, ("--draft-max",), "max draft tokens, or auto: the adaptive draft length",
            parse=draft_max, sweep=True),
        _swept("draft_min", flags=("--draft-min",), help="min draft tokens"),
        _swept("draft_p_min", flags=("--draft-p-min",), help="draft-model p-min"),
        _swept("draft_vocab", flags=("--draft-vocab",), help="draft-simple's draft vocabulary (0 = all)"),
        _swept("spec_verify"),
        _swept("spec_select", help="priority | gain: how a chain picks the draft to verify"),
        _swept("spec_mtp_rollback", help="partial | reeval: draft-mtp's head KV after a verify"),
        Opt("temp", float, 0.0, ("--temp",), "sampling temperatures, 0 = greedy", sweep=True),
        Opt("prompts", str, None, ("--prompts",), "prompt set files (jsonl)", parse=prompt_set, sweep=True,
            split=None),
        Opt("prompt_set", str, "code-edit", ("--prompt-set",), f"built-in sets: {', '.join(PROMPT_SETS)}",
            parse=prompt_set, sweep=True),
        Opt("spec_accept", str, None, ("--spec-accept",), "synthetic acceptance: tests of a synthetic drafter whose "
            "drafts, of the planned lengths, the target accepts with these conditional rates per position (0.8, or "
            "0.9/0.8/0.6: the last rate for the positions after it), built from the target's own greedy continuation "
            "(spec_type synthetic; needs --temp 0)", metavar="P", parse=spec_accept, sweep=True),
        Opt("warm", bool, False, ("--warm",), "keep n-gram state across repetitions (default: cold)"),
        Opt("verify_cost", int, 0, ("--verify-cost",), "time target forwards of 1..K rows at each depth and print "
            "the break-even acceptance", metavar="K", ge=0),
        _swept("n_gpu_layers_draft"),
        _swept("device_draft"),
        *(_swept(o.name) for o in SPEC[1] if o.name.startswith(DRAFTER_SETTINGS)),
    ]),
    ("Run and output", [
        Opt("repetitions", int, 5, ("-r", "--repetitions"), "repetitions per test", ge=1),
        replace(OPTIONS["seed"], default=BENCH_SEED, ge=0, help="seed of the random tokens, of sampling and of "
                "--spec-accept's draws"),
        Opt("output", str, "md", ("-o", "--output"), "md | csv | json | jsonl | sql (stdout)",
            parse=choice(*OUTPUT_FORMATS)),
        Opt("output_err", Optional[str], None, ("-oe", "--output-err"), "second format on stderr",
            parse=choice(*OUTPUT_FORMATS)),
        Opt("no_warmup", bool, False, ("--no-warmup",), "skip the warmup runs"),
        Opt("verbose", bool, False, ("-v", "--verbose"), "log loads and samples on stderr"),
        Opt("progress", bool, False, ("--progress",), "one progress line per test on stderr when it is not a "
            "terminal (a terminal always gets a progress bar)"),
        Opt("delay", int, 0, ("--delay",), "seconds to wait before each test", ge=0),
        Opt("baseline", Optional[str], None, ("--baseline",), "json/jsonl of an earlier run to compare with"),
        Opt("baseline_cmd", Optional[str], None, ("--baseline-cmd",), "another build's spec-cli (a path or a "
            "quoted command line): run the tests with both builds in turn, -r pairs of runs, and exit 1 when a row "
            "is surely slower than --max-regression (a sign test on the pairs' median t/s ratio) or an exact "
            "counter of a greedy speculative row changed", metavar="CMD"),
        Opt("max_regression", float, 5.0, ("--max-regression",), "with --baseline-cmd / --baseline: exit 1 when a "
            "row is this much slower beyond the noise", metavar="PCT", ge=0.0),
        Opt("plot", Optional[str], None, ("--plot",), "draw the sweep / verify curve to this PNG"),
    ]),
]

BENCH_OPTIONS = {o.name: o for _, opts in BENCH for o in opts}

DEFAULT_PARALLEL = 4  # llama-server's -np auto


def api_key(value: str) -> str:
    """--api-key: a key a client can send as it is. An HTTP header value loses the whitespace around it (such a key
    would match no request) and cannot hold a control character."""
    if not value.strip() or value != value.strip() or not value.isprintable():
        raise Invalid("a key of printable characters without whitespace at either end")
    return value


def parallel(value: int) -> int:
    """-np: slots, -1 = auto."""
    if value == -1:
        return DEFAULT_PARALLEL
    if value < 1:
        raise Invalid("-1 (auto) or at least 1")
    return value


# `spec-cli server`: its own flags (with the MODEL, SAMPLING and SPEC groups)
SERVER = ("Server", [
    Opt("host", str, "127.0.0.1", ("--host",), "address to listen on"),
    Opt("port", int, 8080, ("--port",), "port to listen on", ge=1, le=65535),
    Opt("parallel", int, -1, ("-np", "--parallel"), f"slots (-1 = auto = {DEFAULT_PARALLEL})", parse=parallel),
    Opt("api_key", Optional[str], None, ("--api-key",), "require this key (Bearer or X-Api-Key) on every route but "
        "/health", parse=api_key),
    Opt("metrics", bool, False, ("--metrics",), "enable the Prometheus /metrics endpoint"),
    Opt("slots", bool, False, ("--slots/--no-slots",), "the /slots endpoint, which shows every slot's latest prompt "
        "and output to whoever may call the server (off by default, unlike llama-server)"),
    Opt("alias", Optional[str], None, ("-a", "--alias"), "model id shown by the API"),
    replace(OPTIONS["n_predict"], help="default generation limit of a request (-1 = until end of generation or the "
            "slot's context end)"),
    Opt("chat_template", Optional[str], None, ("--chat-template",), "override the chat template (jinja source or "
        "chatml|gemma)"),
    Opt("allowed_hosts", Optional[str], None, ("--allowed-hosts",), "Host header names to accept besides IP "
        "addresses, localhost and --host (comma list; * = any)"),
    Opt("max_body_mib", int, 8, ("--max-body-mib",), "largest request body in MiB (413 above it)", ge=1),
    Opt("read_timeout", float, 30.0, ("--read-timeout",), "seconds a request has to arrive whole, headers and body, "
        "from its first byte (and a new connection to send one): 408 and the connection closed after", gt=0.0),
    Opt("slot_save_path", Optional[str], None, ("--slot-save-path",), "directory of the slot files of POST "
        "/slots/{id}?action=save|restore|erase (created if missing; the slot actions are off without it)",
        metavar="DIR", parse=nonempty),
])

SERVER_OPTIONS = {o.name: o for o in SERVER[1]}

# Types a trained head's matrices are written in (draft-train --outtype; llama.cpp's converter's names). Q4_0, the
# EAGLE-3 default, costs a head for qwen2.5-coder-1.5b 0.08 of a target forward instead of Q8_0's 0.11, accepting
# 1.6 % fewer drafts (docs/training.md); DFlash keeps Q8_0 (one block of 8: 0.16 of a target forward).
HEAD_OUT_TYPES = ("f32", "f16", "q8_0", "q5_0", "q4_0")

# `spec-cli mtp-train`: train/mtp.py TrainConfig takes its defaults from here
MTP_TRAIN = ("Training", [
    replace(OPTIONS["model"], help="GGUF file or models.toml name (the frozen target)"),
    Opt("output", Path, ..., ("-o", "--output"), "GGUF to write: the model plus the trained NextN head"),
    Opt("steps", int, 1200, ("--steps",), "optimizer steps", ge=1),
    Opt("lr", float, 5e-4, ("--lr",), "peak learning rate (AdamW, warmup then cosine decay)", gt=0.0),
    Opt("seq_len", int, 256, ("--seq-len",), "tokens per training window", ge=1),
    Opt("batch", int, 4, ("--batch",), "windows per step", ge=1),
    Opt("data_tokens", int, 196608, ("--data-tokens",), "training tokens the target is run over (standard-library "
        "text + generations)", ge=1),
    Opt("gen_tokens", int, 98304, ("--gen-tokens",), "of which windows of the target's own chat answers (request "
        "half, greedy answer half); at most --data-tokens", ge=0),
    Opt("eval_tokens", int, 2048, ("--eval-tokens",), "held-out tokens for the acceptance estimate", ge=1),
    Opt("checkpoint_every", int, 50, ("--checkpoint-every",), "steps between checkpoints (OUTPUT's name with "
        ".ckpt.pt)", ge=1),
    Opt("draft_vocab", int, DRAFT_VOCAB, ("--draft-vocab",), "tokens the head drafts among, the training data's most "
        "frequent (0 = all)", ge=0),
    Opt("resume", bool, False, ("--resume",), "continue from OUTPUT's checkpoint and cached features"),
    Opt("outtype", str, "f32", ("--outtype",), f"the written head's matrices: {' | '.join(HEAD_OUT_TYPES)} (vectors "
        "float32; a matrix whose rows are not whole blocks f16)", parse=choice(*HEAD_OUT_TYPES)),
    Opt("seed", int, 0, ("-s", "--seed"), "data order and initialisation seed"),
    replace(OPTIONS["device"], help="auto (CUDA when present) | cpu | cuda | cuda:N"),
    OPTIONS["threads"],
    Opt("json_output", bool, False, ("--json",), "print the result as JSON on stdout"),
])

MTP_TRAIN_OPTIONS = {o.name: o for o in MTP_TRAIN[1]}

# `spec-cli draft-train --type eagle3|dflash|mtp` (mtp-train = --type mtp): MTP_TRAIN's flags, whose defaults are
# the MTP head's, where an EAGLE-3 head's or a DFlash drafter's differ these (train/eagle3.py and train/dflash.py read
# them through `train_default`): EAGLE-3's sized to train qwen2.5-coder-1.5b within 90 minutes on a 2-core CPU
# (docs/training.md), DFlash's qwen2.5-coder-1.5b within 2 hours
EAGLE3_TRAIN_DEFAULTS = {"steps": 450, "data_tokens": 163840, "gen_tokens": 131072, "eval_tokens": 8192,
                         "draft_vocab": 16000, "ttt_steps": 4, "outtype": "q4_0"}
DFLASH_TRAIN_DEFAULTS = {"steps": 1200, "lr": 6e-4, "data_tokens": 65536, "gen_tokens": 49152, "eval_tokens": 8192,
                         "draft_vocab": 32000, "block_size": 8, "draft_layers": 1, "anchors": 16, "outtype": "q8_0"}
TRAIN_DEFAULTS = {"eagle3": EAGLE3_TRAIN_DEFAULTS, "dflash": DFLASH_TRAIN_DEFAULTS, "mtp": {}}
HEAD_TYPES = tuple(TRAIN_DEFAULTS)


def layer_list(value: str) -> tuple[int, ...]:
    """--layers: a comma list of layer numbers."""
    try:
        layers = tuple(int(v) for v in value.split(","))
    except ValueError:
        raise Invalid("a comma list of layer numbers") from None
    if any(n < 0 for n in layers):
        raise Invalid("a comma list of layer numbers")
    return layers


def _per_type(o: Opt) -> Opt:
    """A training flag of draft-train: left out, the trained type's default."""
    defaults = {kind: shown(TRAIN_DEFAULTS[kind].get(o.name, o.default)) for kind in HEAD_TYPES}
    listed = ", ".join(f"{kind} {value}" for kind, value in defaults.items())
    return replace(o, annotation=Optional[o.annotation], default=None,
                   help=f"{o.help} (default: {listed if len(set(defaults.values())) > 1 else defaults['mtp']})")


_PER_TYPE = ("steps", "lr", "seq_len", "batch", "data_tokens", "gen_tokens", "eval_tokens", "checkpoint_every",
             "draft_vocab", "outtype", "seed")
DRAFT_TRAIN = ("Training", [
    Opt("kind", str, HEAD_TYPES[0], ("--type",), f"the head to train: {' | '.join(HEAD_TYPES)} (eagle3, dflash: a "
        "file of its own in llama.cpp's eagle3 / dflash layout, -md FILE drafts with it; mtp: the model plus a NextN "
        "head)", parse=choice(*HEAD_TYPES)),
    *(_per_type(o) if o.name in _PER_TYPE else
      replace(o, help="GGUF to write (eagle3, dflash: the drafter; mtp: the model plus the head)")
      if o.name == "output" else o
      for o in MTP_TRAIN[1]),
    Opt("layers", Optional[str], None, ("--layers",), "the target layers read (their inputs), comma list (default "
        "eagle3: 2, N/2, N-3 of the target's N, as llama.cpp's converter; dflash: five spread over 2..N-2, as "
        "SpecForge spreads them)", parse=layer_list),
])
EAGLE3_TRAIN = ("EAGLE-3", [
    Opt("ttt_steps", Optional[int], None, ("--ttt-steps",), "draft steps unrolled in training (the training-time "
        f"test; default {EAGLE3_TRAIN_DEFAULTS['ttt_steps']})", ge=1),
])
DFLASH_TRAIN = ("DFlash", [
    Opt("block_size", Optional[int], None, ("--block-size",), "tokens a block holds (the anchor and up to B - 1 "
        f"drafts; default {DFLASH_TRAIN_DEFAULTS['block_size']})", ge=2),
    Opt("draft_layers", Optional[int], None, ("--draft-layers",), "decoder layers of the drafter (default "
        f"{DFLASH_TRAIN_DEFAULTS['draft_layers']})", ge=1),
    Opt("anchors", Optional[int], None, ("--anchors",), "blocks trained per window and step (default "
        f"{DFLASH_TRAIN_DEFAULTS['anchors']})", ge=1),
])


def train_default(kind: str, name: str):
    """A training setting's default for head type `kind`: its own (TRAIN_DEFAULTS), else its flag's."""
    if name in TRAIN_DEFAULTS[kind]:
        return TRAIN_DEFAULTS[kind][name]
    return next(o.default for _, group in (MTP_TRAIN, DRAFT_TRAIN, EAGLE3_TRAIN, DFLASH_TRAIN) for o in group
                if o.name == name)


# `spec-cli lookup-stats`: the text is replayed in chunks of -c tokens
CHUNKS = ("Replay", [
    Opt("ctx_size", int, default("ctx_size"), ("-c", "--ctx-size"), "chunk size in tokens", ge=1),
])
