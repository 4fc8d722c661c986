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
from dataclasses import dataclass, field
from pathlib import Path

from spec_cli.bench import DRAFT_MODEL_FIELDS, NGRAM_FIELDS, SWEPT_CASE_FIELDS
from spec_cli.errors import UsageError
from spec_cli.model.catalog import registry_entry
from spec_cli.options import AUTO, BENCH_OPTIONS, DEFAULT_GPU_LAYERS
from spec_cli.runtime.draft_files import HEAD_FILE_TYPES, draft_kind
from spec_cli.speculative.synthetic import NAME as SYNTHETIC


def swept(flags: dict, name: str, default: list) -> list:
    """A sweep's values (None: the flag was left out, `default` then)."""
    values = flags.get(name)
    return list(default) if values is None else values


def _default_value(name: str) -> list:
    """A sweep's default: one value, its flag's (spec_cli/options.py BENCH), parsed."""
    o = BENCH_OPTIONS[name]
    return [o.value(o.default)]


def spec_chains(chains: list[str] | None) -> list[str]:
    """The chains a --spec-type sweep runs (spec_cli/options.py `spec_chain`: canonical names in priority order,
    joined by ','): `none` is the plain run, which every speculative sweep includes anyway, so it is dropped here,
    and so are repeats."""
    return list(dict.fromkeys(c for c in chains or [] if c))


def chain_types(chain: str) -> list[str]:
    """The drafter names of one sweep value of --spec-type ("none" = the plain run: no drafter)."""
    return [] if chain == "none" else chain.split(",")


def _default(name: str):
    return field(default_factory=lambda: _default_value(name))


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
    n_gpu_layers: list[int] = _default("n_gpu_layers")
    devices: list[str] = _default("devices")
    flash_attn: list[int] = _default("flash_attn")  # recorded only (torch SDPA picks)
    dtype: list[str] = _default("dtype")
    compile: list[str] = _default("compile")  # --compile: auto | on | off (compiled.py)
    # speculative sweep
    spec_type: list[str] = field(default_factory=list)  # chains, canonical names joined by ','
    model_draft: list[str] = field(default_factory=list)
    n_gpu_layers_draft: list[int] = _default("n_gpu_layers_draft")
    devices_draft: list[str] = field(default_factory=lambda: [""])  # "" = the target's device
    draft_vocab: list[int] = _default("draft_vocab")
    draft_max: list[int | str] = _default("draft_max")  # ints and/or "auto"
    draft_min: list[int] = _default("draft_min")
    draft_p_min: list[float] = _default("draft_p_min")
    spec_verify: list[str] = _default("spec_verify")
    spec_select: list[str] = _default("spec_select")
    spec_mtp_rollback: list[str] = _default("spec_mtp_rollback")
    ngram: dict[str, list[int]] = field(default_factory=lambda: {f: _default_value(f) for f in NGRAM_FIELDS})
    spec_accept: list[str] = field(default_factory=list)  # --spec-accept: the synthetic chain's rates, as text
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
    seed: int = BENCH_OPTIONS["seed"].default  # random tokens, sampling, --spec-accept's draws
    tensor_parallel: int = BENCH_OPTIONS["tensor_parallel"].default  # -tp: one group of ranks for the whole run

    @property
    def speculative(self) -> bool:
        return bool(self.spec_type or self.prompt_sets)

    def validate(self) -> None:
        """What no one flag's parser can check (theirs ran in `from_flags`)."""
        if self.speculative and not any(self.n_gen):
            raise UsageError("speculative tests need -n > 0 (tokens generated per prompt)")
        if self.spec_accept and any(t > 0 for t in self.temp):
            raise UsageError("--spec-accept drafts the target's greedy continuation: it needs --temp 0")


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
    spec_type: str = "none"  # "none" = the plain run of the prompt set; SYNTHETIC = the --spec-accept drafter
    spec_accept: str | None = None  # the synthetic drafter's acceptance rates (options.spec_accept's text)
    model_draft: str = ""
    n_gpu_layers_draft: int = DEFAULT_GPU_LAYERS
    devices_draft: str = ""
    draft_vocab: int = BENCH_OPTIONS["draft_vocab"].default
    draft_max: int | str = 0  # or "auto"
    draft_min: int = 0
    draft_p_min: float | str = AUTO
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
                # a head file's drafter (draft-eagle3, draft-dflash) reads -md (and its device settings), not
                # --draft-vocab
                unread = ("draft_vocab",) if set(types) & set(HEAD_FILE_TYPES) else DRAFT_MODEL_FIELDS
                values.update({f: Test.__dataclass_fields__[f].default for f in unread})
            if "draft-mtp" not in types:
                values["spec_mtp_rollback"] = Test.__dataclass_fields__["spec_mtp_rollback"].default
            if types != [SYNTHETIC]:
                values["spec_accept"] = None
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
    """The command's flag values (spec_cli/options.py `read_flags`: a sweep's as a list, None when absent) ->
    BenchParams.

    Which kinds run: the pp/tg/pg tests by default; when a speculative sweep (`--spec-type`, `-md`, `--prompts`,
    `--prompt-set`) or `--verify-cost` is asked for, only if `-p`/`-pg` (or, without a sweep, `-n`) is given too,
    because in a sweep `-n` is the number of tokens generated per prompt."""
    d = BenchParams()
    spec_type = spec_chains(flags.get("spec_type"))
    model_draft = swept(flags, "model_draft", [])
    if model_draft and not spec_type:  # -md alone drafts with its file's kind, as in every other command
        spec_type = sorted({_md_kind(md) for md in model_draft})
    spec_accept = swept(flags, "spec_accept", [])
    spec_type += [SYNTHETIC] if spec_accept else []  # its tests: one per rate (the chains' tests have none)
    prompt_sets = swept(flags, "prompt_set", []) + swept(flags, "prompts", [])
    speculative = bool(spec_type or prompt_sets)
    verify_cost = flags.get("verify_cost") or d.verify_cost
    explicit = bool(flags.get("n_prompt") or flags.get("n_pg") or (flags.get("n_gen") and not speculative))
    lists = {name: swept(flags, name, getattr(d, name)) for name in _LISTS}
    return BenchParams(
        **lists, spec_type=spec_type, model_draft=model_draft, spec_accept=list(dict.fromkeys(spec_accept)),
        n_pg=swept(flags, "n_pg", []),
        devices_draft=swept(flags, "device_draft", d.devices_draft),
        ngram={f: swept(flags, f, d.ngram[f]) for f in NGRAM_FIELDS},
        prompt_sets=prompt_sets or ([BENCH_OPTIONS["prompt_set"].default] if spec_type else []),
        random_tests=explicit or not (speculative or verify_cost),
        verify_cost=verify_cost,
        repetitions=flags.get("repetitions", d.repetitions),
        warmup=d.warmup and not flags.get("no_warmup"),
        warm=bool(flags.get("warm", d.warm)),
        delay=flags.get("delay") or d.delay,
        tensor_parallel=flags.get("tensor_parallel") or d.tensor_parallel,
        seed=flags.get("seed", d.seed),
    )


# the sweeps whose BenchParams field has the flag's name
_LISTS = ("model", "n_prompt", "n_gen", "n_depth", "n_batch", "n_ubatch", "n_threads", "n_gpu_layers", "devices",
          "flash_attn", "dtype", "compile", "n_gpu_layers_draft", "draft_vocab", "draft_max", "draft_min",
          "draft_p_min", "spec_verify", "spec_select", "spec_mtp_rollback", "temp")


def default_values() -> dict:
    """What the rows of a run without flags record for each parameter (printers hide a column holding only these)."""
    d = BenchParams()
    single = {f: v[0] for f, v in vars(d).items() if isinstance(v, list) and len(v) == 1}
    return {**single, **{f: v[0] for f, v in d.ngram.items()}, "model_draft": Test.model_draft, "warm": d.warm}
