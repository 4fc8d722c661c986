"""Bench parameters as lists and their Cartesian product (llama-bench's `cmd_params` / `get_cmd_params_instances`).

Every parameter is a list. Numeric flags accept llama-bench's value syntax: comma lists (`1,2,4`), the flag
repeated, and integer ranges `first-last` (step 1), `first-last+step` and `first-last*mult`; `last` is included only
when reached exactly; `--draft-max` also takes `auto` (the adaptive draft length). Instances follow llama-bench's nested order, model outermost so a model is loaded once, then
placement (dtype, layers, devices), batch sizes, flash attention, threads; depth is the innermost engine loop and
inside it come the tests: pp per n_prompt, tg per n_gen, pg per pair, then the verify-cost test.

Speculative tests (prompt sets through the shared generator) run once per engine instance, not per depth: for each
prompt set, temperature and generation length, first the plain run, then every speculative case in the order
spec type, draft model (with its -ngld and -devd), draft max, draft min, draft p-min, verify mode, then the
`--spec-ngram-*` settings of the chain's n-gram drafters. Settings a chain does not read (the draft model's without
draft-simple, another drafter's n-gram settings) make no extra runs and are left empty in its rows.

`--spec-type` means what it means in every other command: a comma list is ONE chain (`ngram-mod,draft-simple`).
Sweep values of it are separated by `;` or given by repeating the flag: llama-bench's convention for values that
contain commas themselves (its `-ot` separates instances by `;`), and its convention that a repeated flag adds values.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field
from pathlib import Path

from spec_cli.bench import DRAFT_MODEL_FIELDS, NGRAM_FIELDS, SWEPT_CASE_FIELDS
from spec_cli.errors import UsageError
from spec_cli.model.catalog import registry_entry
from spec_cli.model.compiled import check_mode
from spec_cli.options import BENCH_OPTIONS, DEFAULT_GPU_LAYERS, parse_gpu_layers
from spec_cli.runtime.draft_files import draft_kind
from spec_cli.speculative.adaptive import AUTO, parse_draft_max
from spec_cli.speculative.chain import check_select, parse_spec_types
from spec_cli.speculative.mtp import check_rollback
from spec_cli.speculative.verify import VERIFY_MODES

_RANGE = re.compile(r"^(\d+)(?:-(\d+)(?:([+*])(\d+))?)?$")
FLASH_ATTN = {"auto": -1, "-1": -1, "off": 0, "0": 0, "false": 0, "on": 1, "1": 1, "true": 1}
OUTPUT_FORMATS = ("md", "csv", "json", "jsonl", "sql", "none")


def parse_values(text: str) -> list[int]:
    """llama-bench's integer list syntax: `512`, `1,2,4`, `1-32+4` (1,5,...,29), `1-64*2` (1,2,...,64)."""
    out: list[int] = []
    for item in text.split(","):
        m = _RANGE.match(item.strip())
        if not m:
            raise UsageError(f"invalid value '{item.strip()}' in '{text}' (use N, N-M, N-M+STEP or N-M*MULT)")
        first = int(m.group(1))
        last = int(m.group(2)) if m.group(2) is not None else first
        op, step = m.group(3) or "+", int(m.group(4)) if m.group(4) is not None else 1
        if last < first:
            raise UsageError(f"invalid range '{item.strip()}': it must increase")
        i = first
        while i <= last:
            out.append(i)
            nxt = i + step if op == "+" else i * step
            if nxt <= i:  # +0, *1 or 0*N would never end
                raise UsageError(f"invalid range '{item.strip()}': the step must make it increase")
            i = nxt
    return out


def parse_int_list(values: list[str] | None, default: list[int], flag: str) -> list[int]:
    """Repeated flags and comma lists of ints."""
    if not values:
        return list(default)
    out: list[int] = []
    for value in values:
        for item in value.split(","):
            try:
                out.extend(parse_values(item.strip()))
            except UsageError as e:
                raise UsageError(f"{flag}: {e}") from None
    return out


def parse_gpu_layers_list(values: list[str] | None, default: list[int], flag: str) -> list[int]:
    """-ngl / -ngld sweep values: the integer syntax plus llama.cpp's -1, auto and all (every block: -1)."""
    out: list[int] = []
    for item in parse_str_list(values, []):
        out += parse_values(item) if _RANGE.match(item) else [parse_gpu_layers(item, flag)]
    return out or list(default)


def parse_draft_max_list(values: list[str] | None, default: list[int | str]) -> list[int | str]:
    """--draft-max sweep values: the integer syntax plus `auto`, kept as the string "auto" (so json/csv rows
    read back the same)."""
    out: list[int | str] = []
    for item in parse_str_list(values, []):
        out += [AUTO] if item.lower() == AUTO else parse_int_list([item], [], "--draft-max")
    return out or list(default)


def parse_float_list(values: list[str] | None, default: list[float], flag: str) -> list[float]:
    if not values:
        return list(default)
    try:
        return [float(item) for value in values for item in value.split(",") if item.strip()]
    except ValueError:
        raise UsageError(f"{flag}: expected comma-separated numbers, got {', '.join(values)}") from None


def parse_str_list(values: list[str] | None, default: list[str]) -> list[str]:
    if not values:
        return list(default)
    return [item.strip() for value in values for item in value.split(",") if item.strip()]


def parse_pairs(values: list[str] | None) -> list[tuple[int, int]]:
    """`-pg PP,TG`, repeatable."""
    out = []
    for value in values or []:
        parts = value.split(",")
        if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
            raise UsageError(f"-pg: expected PP,TG, got '{value}'")
        out.append((int(parts[0]), int(parts[1])))
    return out


def parse_flash_attn(values: list[str] | None) -> list[int]:
    out = []
    for item in parse_str_list(values, [BENCH_OPTIONS["flash_attn"].default]):
        if item.lower() not in FLASH_ATTN:
            raise UsageError(f"-fa: expected on, off, auto, 1, 0 or -1, got '{item}'")
        out.append(FLASH_ATTN[item.lower()])
    return out


def parse_spec_chains(values: list[str] | None) -> list[str]:
    """Sweep values of --spec-type: `;` or a repeated flag = another value, each a chain as everywhere else (comma
    list); canonical names in priority order, joined by ','. `none` is the plain run, which every speculative sweep
    includes anyway, so it is dropped here."""
    chains: list[str] = []
    for value in values or []:
        for item in value.split(";"):
            if "+" in item:  # the syntax of earlier versions, where a comma started the next sweep value
                raise UsageError(f"--spec-type '{item}': join a chain with ',' (ngram-mod,draft-simple) and separate "
                                 "sweep values with ';' or a repeated --spec-type")
            chain = ",".join(parse_spec_types(item))
            if chain and chain not in chains:
                chains.append(chain)
    return chains


def chain_types(chain: str) -> list[str]:
    """The drafter names of one sweep value of --spec-type ("none" = the plain run: no drafter)."""
    return [] if chain == "none" else chain.split(",")


def _default(name: str):
    """A sweep's default: one value, its flag's (spec_cli/options.py BENCH)."""
    return field(default_factory=lambda: [BENCH_OPTIONS[name].default])


@dataclass
class BenchParams:
    """Every bench parameter; list fields are swept (Cartesian product), scalars apply to the whole run."""

    model: list[str] = field(default_factory=lambda: [""])  # "" = the default model
    n_prompt: list[int] = _default("n_prompt")
    n_gen: list[int] = _default("n_gen")
    n_pg: list[tuple[int, int]] = field(default_factory=list)
    n_depth: list[int] = _default("n_depth")
    n_batch: list[int] = _default("n_batch")
    n_ubatch: list[int] = _default("n_ubatch")
    n_threads: list[int] = field(default_factory=lambda: [0])  # 0 = torch's default, resolved by the runner
    n_gpu_layers: list[int] = field(default_factory=lambda: [DEFAULT_GPU_LAYERS])
    devices: list[str] = _default("devices")
    flash_attn: list[int] = field(default_factory=lambda: parse_flash_attn(None))  # recorded only (torch SDPA picks)
    dtype: list[str] = _default("dtype")
    compile: list[str] = _default("compile")  # --compile: auto | on | off (compiled.py)
    # speculative sweep
    spec_type: list[str] = field(default_factory=list)  # chains, canonical names joined by ','
    model_draft: list[str] = field(default_factory=list)
    n_gpu_layers_draft: list[int] = field(default_factory=lambda: [DEFAULT_GPU_LAYERS])
    devices_draft: list[str] = field(default_factory=lambda: [""])  # "" = the target's device
    draft_vocab: list[int] = _default("draft_vocab")
    draft_max: list[int | str] = _default("draft_max")  # ints and/or "auto"
    draft_min: list[int] = _default("draft_min")
    draft_p_min: list[float] = _default("draft_p_min")
    spec_verify: list[str] = _default("spec_verify")
    spec_select: list[str] = _default("spec_select")
    spec_mtp_rollback: list[str] = _default("spec_mtp_rollback")
    ngram: dict[str, list[int]] = field(default_factory=lambda: {f: [BENCH_OPTIONS[f].default] for f in NGRAM_FIELDS})
    temp: list[float] = _default("temp")  # greedy by default: reproducible, lossless speculation
    prompt_sets: list[str] = field(default_factory=list)  # built-in set names or .jsonl paths
    # which test kinds run
    random_tests: bool = True  # pp / tg / pg on random tokens
    verify_cost: int = BENCH_OPTIONS["verify_cost"].default  # K: time forwards of 1..K rows (0 = off)
    # run settings
    repetitions: int = BENCH_OPTIONS["repetitions"].default
    warmup: bool = not BENCH_OPTIONS["no_warmup"].default
    warm: bool = BENCH_OPTIONS["warm"].default  # keep n-gram state and caches across repetitions of a spec test
    delay: int = BENCH_OPTIONS["delay"].default
    tensor_parallel: int = BENCH_OPTIONS["tensor_parallel"].default  # -tp: one group of ranks for the whole run

    @property
    def speculative(self) -> bool:
        return bool(self.spec_type or self.prompt_sets)

    def validate(self) -> None:
        for name in ("n_prompt", "n_gen", "n_depth", "draft_min", "draft_vocab", "n_batch", "n_ubatch"):
            if not all(BENCH_OPTIONS[name].within(v) for v in getattr(self, name)):
                raise UsageError(f"{name} values must be {BENCH_OPTIONS[name].bounds_text()}")
        if not BENCH_OPTIONS["tensor_parallel"].within(self.tensor_parallel):
            raise UsageError(f"-tp must be {BENCH_OPTIONS['tensor_parallel'].bounds_text()}")
        for value in self.draft_max:
            parse_draft_max(value)
        if any(v < 0 for v in self.n_threads):
            raise UsageError("-t values must be >= 1")
        p_min = BENCH_OPTIONS["draft_p_min"]
        if not all(p_min.within(p) for p in self.draft_p_min):
            raise UsageError(f"--draft-p-min values must be {p_min.bounds_text()}")
        if any(v not in VERIFY_MODES for v in self.spec_verify):
            raise UsageError(f"--spec-verify values must be one of {', '.join(VERIFY_MODES)}")
        for value in self.spec_select:
            check_select(value)
        for value in self.spec_mtp_rollback:
            check_rollback(value)
        for value in self.compile:
            check_mode(value)
        if self.repetitions < 1:
            raise UsageError("-r must be at least 1")
        if self.verify_cost < 0:
            raise UsageError("--verify-cost must be >= 0")
        if self.speculative and not any(self.n_gen):
            raise UsageError("speculative tests need -n > 0 (tokens generated per prompt)")


@dataclass(frozen=True)
class Test:
    """One test of an instance: kind pp/tg/pg (random tokens), verify (k = 1..K rows), spec (prompt set)."""

    kind: str
    n_prompt: int = 0
    n_gen: int = 0
    n_depth: int = 0
    verify_k: int = 0  # kind "verify": the largest k
    prompt_set: str = ""
    temp: float = 0.0
    spec_type: str = "none"  # "none" = the plain run of the prompt set
    model_draft: str = ""
    n_gpu_layers_draft: int = DEFAULT_GPU_LAYERS
    devices_draft: str = ""
    draft_vocab: int = BENCH_OPTIONS["draft_vocab"].default
    draft_max: int | str = 0  # or "auto"
    draft_min: int = 0
    draft_p_min: float = 0.0
    spec_verify: str = BENCH_OPTIONS["spec_verify"].default
    spec_select: str = BENCH_OPTIONS["spec_select"].default
    spec_mtp_rollback: str = BENCH_OPTIONS["spec_mtp_rollback"].default
    ngram: tuple[tuple[str, int], ...] = ()  # (NGRAM_FIELDS name, value) of the chain's n-gram drafters only


@dataclass(frozen=True)
class Instance:
    """One value of every engine parameter plus the test to run with them."""

    model: str
    dtype: str
    n_gpu_layers: int
    devices: str
    n_batch: int
    n_ubatch: int
    flash_attn: int
    n_threads: int
    compile: str  # innermost: compiled and eager runs of one setting side by side
    test: Test

    def engine_key(self) -> tuple:
        """What a loaded model depends on: tests sharing it reuse the model (llama-bench `equal_mparams`)."""
        return self.model, self.dtype, self.n_gpu_layers, self.devices


# engine parameters, in llama-bench's nesting order (outermost first)
ENGINE_FIELDS = tuple(f for f in Instance.__dataclass_fields__ if f != "test")


def instances(p: BenchParams) -> list[Instance]:
    p.validate()
    out = []
    for engine in itertools.product(*(getattr(p, f) for f in ENGINE_FIELDS)):
        tests = []
        for depth in p.n_depth:
            tests += _random_tests(p, depth) if p.random_tests else []
            if p.verify_cost:
                tests.append(Test("verify", n_depth=depth, verify_k=p.verify_cost))
        if p.speculative:
            tests += _spec_tests(p, engine[0])
        out += [Instance(*engine, test=t) for t in tests]
    return out


def _random_tests(p: BenchParams, depth: int) -> list[Test]:
    tests = [Test("pp", n_prompt=n, n_depth=depth) for n in p.n_prompt if n > 0]
    tests += [Test("tg", n_gen=n, n_depth=depth) for n in p.n_gen if n > 0]
    tests += [Test("pg", n_prompt=pp, n_gen=tg, n_depth=depth) for pp, tg in p.n_pg if pp or tg]
    return tests


def _spec_tests(p: BenchParams, model: str) -> list[Test]:
    lists = {f: getattr(p, f) or [""] for f in SWEPT_CASE_FIELDS}
    if any("draft-simple" in chain_types(c) for c in p.spec_type) and not p.model_draft:
        lists["model_draft"] = _listed_draft(model)
    tests: list[Test] = []
    for prompt_set, temp, n_gen in itertools.product(p.prompt_sets, p.temp, p.n_gen):
        if n_gen <= 0:
            continue
        tests.append(Test("spec", n_gen=n_gen, prompt_set=prompt_set, temp=temp))
        seen = set()
        cases = itertools.product(*lists.values()) if p.spec_type else []
        for case in cases:
            values = dict(zip(SWEPT_CASE_FIELDS, case))
            types = chain_types(values["spec_type"])
            if "draft-simple" not in types:  # settings a chain does not read make no duplicate runs
                # draft-eagle3 reads the -md file (and its device settings), not --draft-vocab
                unread = ("draft_vocab",) if "draft-eagle3" in types else DRAFT_MODEL_FIELDS
                values.update({f: Test.__dataclass_fields__[f].default for f in unread})
            if "draft-mtp" not in types:
                values["spec_mtp_rollback"] = Test.__dataclass_fields__["spec_mtp_rollback"].default
            # the n-gram settings of the chain's own drafters (ngram_mod_n_match belongs to ngram-mod)
            ngram = [f for f in NGRAM_FIELDS if f.startswith(tuple(t.replace("-", "_") + "_" for t in types))]
            for ngram_case in itertools.product(*(p.ngram[f] for f in ngram)):
                test = Test("spec", n_gen=n_gen, prompt_set=prompt_set, temp=temp, **values,
                            ngram=tuple(zip(ngram, ngram_case)))
                if test not in seen:
                    seen.add(test)
                    tests.append(test)
    return tests


def _md_kind(md: str) -> str:
    """The spec type -md drafts with: its file's kind (a models.toml name is a draft model; a missing file is
    reported when the run loads it)."""
    return draft_kind(md) if Path(md).is_file() else "draft-simple"


def _listed_draft(model: str) -> list[str]:
    """draft-simple without -md drafts with the model's models.toml `draft`, as in every command."""
    entry = registry_entry(model or None)
    if entry is None or entry.draft is None:
        raise UsageError("--spec-type draft-simple needs a draft model (-md FILE|NAME)")
    return [entry.draft]


def from_flags(flags: dict) -> BenchParams:
    """The command's raw flag values (lists of strings as typed, None when absent) -> BenchParams.

    Which kinds run: the pp/tg/pg tests by default; when a speculative sweep (`--spec-type`, `-md`, `--prompts`,
    `--prompt-set`) or `--verify-cost` is asked for, only if `-p`/`-pg` (or, without a sweep, `-n`) is given too,
    because in a sweep `-n` is the number of tokens generated per prompt."""
    spec_type = parse_spec_chains(flags.get("spec_type"))
    model_draft = parse_str_list(flags.get("model_draft"), [])
    if model_draft and not spec_type:  # -md alone drafts with its file's kind, as in every other command
        spec_type = sorted({_md_kind(md) for md in model_draft})
    prompt_sets = parse_str_list(flags.get("prompt_set"), []) + list(flags.get("prompts") or [])
    speculative = bool(spec_type or prompt_sets)
    d = BenchParams()
    verify_cost = flags.get("verify_cost") or d.verify_cost
    explicit = bool(flags.get("n_prompt") or flags.get("n_pg") or (flags.get("n_gen") and not speculative))
    return BenchParams(
        model=parse_str_list(flags.get("model"), d.model),
        n_prompt=parse_int_list(flags.get("n_prompt"), d.n_prompt, "-p"),
        n_gen=parse_int_list(flags.get("n_gen"), d.n_gen, "-n"),
        n_pg=parse_pairs(flags.get("n_pg")),
        n_depth=parse_int_list(flags.get("n_depth"), d.n_depth, "-d"),
        n_batch=parse_int_list(flags.get("n_batch"), d.n_batch, "-b"),
        n_ubatch=parse_int_list(flags.get("n_ubatch"), d.n_ubatch, "-ub"),
        n_threads=parse_int_list(flags.get("n_threads"), d.n_threads, "-t"),
        n_gpu_layers=parse_gpu_layers_list(flags.get("n_gpu_layers"), d.n_gpu_layers, "-ngl"),
        devices=parse_str_list(flags.get("devices"), d.devices),
        flash_attn=parse_flash_attn(flags.get("flash_attn")),
        dtype=parse_str_list(flags.get("dtype"), d.dtype),
        compile=parse_str_list(flags.get("compile"), d.compile),
        spec_type=spec_type,
        model_draft=model_draft,
        n_gpu_layers_draft=parse_gpu_layers_list(flags.get("n_gpu_layers_draft"), d.n_gpu_layers_draft, "-ngld"),
        devices_draft=parse_str_list(flags.get("device_draft"), d.devices_draft),
        draft_vocab=parse_int_list(flags.get("draft_vocab"), d.draft_vocab, "--draft-vocab"),
        draft_max=parse_draft_max_list(flags.get("draft_max"), d.draft_max),
        draft_min=parse_int_list(flags.get("draft_min"), d.draft_min, "--draft-min"),
        draft_p_min=parse_float_list(flags.get("draft_p_min"), d.draft_p_min, "--draft-p-min"),
        spec_verify=parse_str_list(flags.get("spec_verify"), d.spec_verify),
        spec_select=parse_str_list(flags.get("spec_select"), d.spec_select),
        spec_mtp_rollback=parse_str_list(flags.get("spec_mtp_rollback"), d.spec_mtp_rollback),
        ngram={f: parse_int_list(flags.get(f), d.ngram[f], "--spec-" + f.replace("_", "-")) for f in NGRAM_FIELDS},
        temp=parse_float_list(flags.get("temp"), d.temp, "--temp"),
        prompt_sets=prompt_sets or ([BENCH_OPTIONS["prompt_set"].default] if spec_type else []),
        random_tests=explicit or not (speculative or verify_cost),
        verify_cost=verify_cost,
        repetitions=flags.get("repetitions", d.repetitions),
        warmup=d.warmup and not flags.get("no_warmup"),
        warm=bool(flags.get("warm", d.warm)),
        delay=flags.get("delay") or d.delay,
        tensor_parallel=flags.get("tensor_parallel") or d.tensor_parallel,
    )


def default_values() -> dict:
    """What the rows of a run without flags record for each parameter (printers hide a column holding only these)."""
    d = BenchParams()
    single = {f: v[0] for f, v in vars(d).items() if isinstance(v, list) and len(v) == 1}
    return {**single, **{f: v[0] for f, v in d.ngram.items()}, "model_draft": Test.model_draft, "warm": d.warm}
