"""Every flag of the commands, declared once: name, type, default, spellings (llama.cpp's, both generations of
names), help and bounds.

The package's lowest layer (it imports nothing of spec_cli but errors), so that everything takes its defaults from
here: the engine's dataclasses (SamplingParams, SpecParams, EngineOptions, Context), the typer options of every
command (cli/options.py `with_options`), bench's sweep axes and the defaults its printers hide (bench/params.py),
and the bounds the server checks requests against (server/protocol.py). A group is (help panel, options), in the
order --help lists them; `pick` takes the options a tool reads from one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any, Optional

from spec_cli.errors import UsageError


@dataclass(frozen=True)
class Opt:
    name: str  # the parameter: the key of the command's flag values, and the engine's field where the names agree
    annotation: Any
    default: Any
    flags: tuple[str, ...]
    help: str
    metavar: str | None = None  # None: typer's, from the annotation
    sweep: bool = False  # bench takes a list of values to sweep (comma lists, ranges, a repeated flag)
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


def shown(value: Any) -> str:
    """A value as help and messages print it: floats without trailing zeros (0.75, 0, 1)."""
    return f"{value:g}" if isinstance(value, float) else str(value)


def pick(group, *names: str):
    """A sub-group of a shared option group: the same flags and help, only the options a tool reads."""
    panel, opts = group
    return panel, [o for o in opts if o.name in names]


GPU_LAYERS_ALL = "auto"  # -ngl / -ngld default: every block on the GPU (no fitting to free memory)


def parse_gpu_layers(value: str, flag: str) -> int:
    """llama.cpp's N | auto | all for -ngl / -ngld; auto and all (and -1) put every block on the GPU."""
    word = value.strip().lower()
    if word in (GPU_LAYERS_ALL, "all"):
        return -1
    if not re.fullmatch(r"-1|\d+", word):
        raise UsageError(f"{flag} must be a number of blocks, auto or all (got '{value}')")
    return int(word)


DEFAULT_GPU_LAYERS = parse_gpu_layers(GPU_LAYERS_ALL, "-ngl")  # the -ngl / -ngld default as the loader takes it
RANDOM_SEED = -1  # llama.cpp LLAMA_DEFAULT_SEED (what `-s -1` parses to): pick a fresh seed per sampler
DRAFT_MAX = 16  # llama.cpp's --draft-max: the draft length where no flag asks for one (SpecParams, bench)
DRAFT_VOCAB = 32768  # tokens a draft model / trained MTP head drafts among (--draft-vocab, mtp-train --draft-vocab)

MODEL = ("Model and context", [
    Opt("model", Optional[str], None, ("-m", "--model"), "GGUF file or models.toml name (default: the default model)"),
    Opt("ctx_size", int, 4096, ("-c", "--ctx-size"), "context size in tokens, split across sequences (0 = model's)",
        ge=0),
    Opt("batch_size", int, 2048, ("-b", "--batch-size"), "logical batch size (max rows per decode)", ge=1),
    Opt("ubatch_size", int, 512, ("-ub", "--ubatch-size"), "physical batch size (rows per forward)", ge=1),
    Opt("threads", Optional[int], None, ("-t", "--threads"), "CPU threads (default: torch's)"),
    Opt("n_gpu_layers", str, GPU_LAYERS_ALL, ("-ngl", "--n-gpu-layers", "--gpu-layers"),
        "blocks on the GPU, last first: N, or auto | all | -1 = every block"),
    Opt("device", str, "auto", ("-dev", "--device"), "auto | cpu | cuda | cuda:N"),
    Opt("tensor_parallel", int, 1, ("-tp", "--tensor-parallel"),
        "shard the model over N ranks of torch.distributed (gloo on the CPU, NCCL on CUDA); the command spawns "
        "them, or torchrun --nproc-per-node N starts them", ge=1),
    Opt("dtype", str, "auto", ("--dtype",),
        "auto (q on the CPU, bf16 on CUDA) | q (GGUF weights kept quantized on the CPU, 3-4x faster than f32) | f32 | f16 | bf16"),
    Opt("compile", str, "auto", ("--compile",),
        "auto | on | off: the decode/verify step (target and draft model) through torch.compile, CUDA graphs on "
        "CUDA; auto = off where it has not measurably won (everywhere so far: README)"),
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


def _ngram(name: str, default: int, help: str) -> Opt:
    """A per-drafter n-gram setting: llama.cpp's flag is `--spec-` + the SpecParams field."""
    return Opt(name, int, default, ("--spec-" + name.replace("_", "-"),), help)


SPEC = ("Speculative decoding", [
    Opt("spec_type", Optional[list[str]], None, ("--spec-type",),
        "drafters, comma list, repeatable: none, draft-simple|draft, draft-mtp|mtp, draft-eagle3|eagle3 (-md: an "
        "EAGLE-3 head), ngram-simple, ngram-map-k, ngram-map-k4v, ngram-mod, ngram-cache"),
    Opt("spec_default", bool, False, ("--spec-default",),
        "llama.cpp's default speculative config: ngram-mod with its --spec-ngram-mod-* settings (added to any "
        "--spec-type chain)"),
    Opt("model_draft", Optional[str], None, ("-md", "--model-draft", "--spec-draft-model"),
        "draft (GGUF or name); alone it enables its file's kind: a model draft-simple, an EAGLE-3 head draft-eagle3, "
        "a model with NextN layers draft-mtp"),
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
    Opt("draft_min", int, 0, ("--draft-min", "--draft-n-min", "--spec-draft-n-min"),
        "min draft tokens (else no draft)", ge=0),
    Opt("draft_p_min", float, 0.75, ("--draft-p-min", "--spec-draft-p-min"),
        "stop drafting below this probability", ge=0.0, le=1.0),
    Opt("draft_vocab", int, DRAFT_VOCAB, ("--draft-vocab", "--spec-draft-vocab"),
        "draft-simple drafts among the N tokens its vocabulary ranks most common plus every token of the requests "
        "(a small draft model's output matrix is much of its step); 0 = the whole vocabulary", ge=0),
    Opt("spec_verify", str, "auto", ("--spec-verify",), "auto | match | rejection"),
    Opt("spec_select", str, "priority", ("--spec-select",),
        "which draft a step verifies: priority = llama.cpp's fixed order, first non-empty draft wins; gain = every "
        "n-gram drafter proposes, the draft with the most expected accepted tokens wins (model drafters are asked "
        "only where none proposed)"),
    Opt("spec_mtp_rollback", str, "partial", ("--spec-mtp-rollback",),
        "draft-mtp after a verify: partial = keep the head's KV rows of accepted draft tokens (as llama.cpp); "
        "reeval = re-decode them from the target's hidden states"),
    _ngram("ngram_simple_size_n", 12, "ngram-simple pattern length"),
    _ngram("ngram_simple_size_m", 48, "ngram-simple draft length"),
    _ngram("ngram_simple_min_hits", 1, "ngram-simple min hits (unused, as llama.cpp)"),
    _ngram("ngram_map_k_size_n", 12, "ngram-map-k key length"),
    _ngram("ngram_map_k_size_m", 48, "ngram-map-k draft length"),
    _ngram("ngram_map_k_min_hits", 1, "ngram-map-k min hits"),
    _ngram("ngram_map_k4v_size_n", 12, "ngram-map-k4v key length"),
    _ngram("ngram_map_k4v_size_m", 48, "ngram-map-k4v draft length"),
    _ngram("ngram_map_k4v_min_hits", 1, "ngram-map-k4v min hits"),
    _ngram("ngram_mod_n_match", 24, "ngram-mod hashed n-gram length"),
    _ngram("ngram_mod_n_min", 48, "ngram-mod min draft length"),
    _ngram("ngram_mod_n_max", 64, "ngram-mod max draft length"),
    Opt("lookup_cache_static", Optional[str], None, ("-lcs", "--lookup-cache-static"), "static n-gram cache file"),
    Opt("lookup_cache_dynamic", Optional[str], None, ("-lcd", "--lookup-cache-dynamic"), "dynamic n-gram cache file"),
])

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

OPTIONS = {o.name: o for _, opts in (MODEL, SAMPLING, SPEC, PROMPT, LOG) for o in opts}


def default(name: str) -> Any:
    """The default of a shared option (the engine's dataclasses take theirs from here)."""
    return OPTIONS[name].default


def _swept(shared: str, **changes) -> Opt:
    """A shared option as a bench sweep axis; `changes`: bench's own name, spellings or help."""
    return replace(OPTIONS[shared], sweep=True, **changes)


# `spec-cli bench`: its own flags and the shared ones it sweeps. A sweep's default is one value, shown in its help
BENCH = [
    ("Engine parameters (lists)", [
        Opt("model", str, None, ("-m", "--model"), "GGUF files or models.toml names (default: the default model)",
            sweep=True),
        Opt("n_prompt", int, 512, ("-p", "--n-prompt"), "pp test prompt lengths", sweep=True, ge=0),
        Opt("n_gen", int, 128, ("-n", "--n-gen"), "tg test lengths; in a speculative sweep, tokens generated per "
            "prompt", sweep=True, ge=0),
        Opt("n_pg", str, None, ("-pg",), "PP,TG: a prompt + generation test (repeatable)", sweep=True),
        Opt("n_depth", int, 0, ("-d", "--n-depth"), "tokens already in the KV cache", sweep=True, ge=0),
        _swept("batch_size", name="n_batch", help="logical batch size"),
        _swept("ubatch_size", name="n_ubatch", help="physical batch size"),
        _swept("threads", name="n_threads"),
        _swept("device", name="devices"),
        Opt("flash_attn", str, "auto", ("-fa", "--flash-attn"),
            f"on | off | auto: recorded in the rows, no effect: {NO_EFFECT['-fa']}", sweep=True),
        _swept("n_gpu_layers"),
        _swept("dtype"),
        _swept("compile", help="auto | on | off: torch.compile / CUDA graphs for the decode step (compile time "
               "in the rows)"),
        OPTIONS["tensor_parallel"],  # one value: a command holds one group of ranks
    ]),
    ("Speculative sweep (lists)", [
        Opt("spec_type", str, None, ("--spec-type",), "drafter chains to sweep: a comma list is one chain as in "
            "every command (ngram-mod,draft-simple); ';' or a repeated flag starts the next value", sweep=True),
        Opt("model_draft", str, None, ("-md", "--model-draft"), "draft models (alone: sweeps draft-simple)",
            sweep=True),
        Opt("draft_max", int, DRAFT_MAX, ("--draft-max",), "max draft tokens, or auto: the adaptive draft length",
            sweep=True),
        _swept("draft_min", flags=("--draft-min",), help="min draft tokens"),
        _swept("draft_p_min", flags=("--draft-p-min",), help="draft-model p-min"),
        _swept("draft_vocab", flags=("--draft-vocab",), help="draft-simple's draft vocabulary (0 = all)"),
        _swept("spec_verify"),
        _swept("spec_select", help="priority | gain: how a chain picks the draft to verify"),
        _swept("spec_mtp_rollback", help="partial | reeval: draft-mtp's head KV after a verify"),
        Opt("temp", float, 0.0, ("--temp",), "sampling temperatures, 0 = greedy", sweep=True),
        Opt("prompts", str, None, ("--prompts",), "prompt set files (jsonl)", sweep=True),
        Opt("prompt_set", str, "code-edit", ("--prompt-set",), "built-in sets: code-edit, summarize, qa, writing, "
            "chat", sweep=True),
        Opt("warm", bool, False, ("--warm",), "keep n-gram state across repetitions (default: cold)"),
        Opt("verify_cost", int, 0, ("--verify-cost",), "time target forwards of 1..K rows at each depth and print "
            "the break-even acceptance", metavar="K"),
        _swept("n_gpu_layers_draft"),
        _swept("device_draft"),
        *(_swept(o.name) for o in SPEC[1] if o.name.startswith("ngram_")),
    ]),
    ("Run and output", [
        Opt("repetitions", int, 5, ("-r", "--repetitions"), "repetitions per test"),
        Opt("output", str, "md", ("-o", "--output"), "md | csv | json | jsonl | sql (stdout)"),
        Opt("output_err", Optional[str], None, ("-oe", "--output-err"), "second format on stderr"),
        Opt("no_warmup", bool, False, ("--no-warmup",), "skip the warmup runs"),
        Opt("verbose", bool, False, ("-v", "--verbose"), "log loads and samples on stderr"),
        Opt("progress", bool, False, ("--progress",), "one progress line per test on stderr when it is not a "
            "terminal (a terminal always gets a progress bar)"),
        Opt("delay", int, 0, ("--delay",), "seconds to wait before each test"),
        Opt("baseline", Optional[str], None, ("--baseline",), "json/jsonl of an earlier run to compare with"),
        Opt("max_regression", float, 5.0, ("--max-regression",), "with --baseline: exit 1 when a row is this much "
            "slower beyond the noise", metavar="PCT"),
        Opt("plot", Optional[str], None, ("--plot",), "draw the sweep / verify curve to this PNG"),
    ]),
]

BENCH_OPTIONS = {o.name: o for _, opts in BENCH for o in opts}
