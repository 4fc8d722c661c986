"""`spec-cli bench` ~ llama-bench, plus speculative sweeps, the verify-cost curve, a baseline gate and plots.

Every numeric parameter takes comma lists, repeats and ranges (`-p 1-32+4`, `--draft-max 1-16*2`); the grid is
their Cartesian product in llama-bench's order. `--spec-type` is the exception: a comma list is one chain, as in
every other command, and sweep values are separated by `;` or given by repeating the flag. Results go to stdout in
the chosen format only; progress, verbose lines and the baseline comparison go to stderr.

Examples:
  spec-cli bench -m qwen2.5-coder-0.5b,qwen2.5-coder-1.5b -p 512 -n 128
  spec-cli bench -m qwen2.5-coder-1.5b --verify-cost 16 -d 0,512 -r 3
  spec-cli bench -m qwen2.5-coder-1.5b -md qwen2.5-coder-0.5b --spec-type 'ngram-simple;ngram-mod;draft-simple' \\
      --spec-type ngram-mod,draft-simple --draft-max 1-16*2,auto --prompt-set code-edit -n 64 -r 2 --plot sweep.png
  spec-cli bench -o jsonl --baseline main.jsonl --max-regression 10     # CI gate: exit 1 on a real slowdown
"""

from __future__ import annotations

import sys
from dataclasses import replace
from typing import Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.progress import Progress as RichProgress

from spec_cli.bench import NGRAM_FIELDS
from spec_cli.bench.params import OUTPUT_FORMATS, Instance, from_flags
from spec_cli.bench.runner import Progress, run_bench
from spec_cli.cli.options import MODEL, NO_EFFECT, SPEC, pick, warn_cpu_layers, warn_no_effect, with_options
from spec_cli.errors import UsageError
from spec_cli.loader import parse_device

_L = Optional[list[str]]  # repeatable flag whose values are comma lists / ranges
_ENGINE, _SPEC, _RUN = "Engine parameters (lists)", "Speculative sweep (lists)", "Run and output"


def _engine(*flags: str, help: str):
    return typer.Option(None, *flags, help=help, metavar="LIST", rich_help_panel=_ENGINE)


def _spec(*flags: str, help: str):
    return typer.Option(None, *flags, help=help, metavar="LIST", rich_help_panel=_SPEC)


class _Report(Progress):
    """The grid's size before anything loads (always), then a live bar over the timed runs on a terminal;
    elsewhere (CI logs) one line per test with --progress, like llama-bench's; loads and samples with -v."""

    def __init__(self, err: Console, repetitions: int, lines: bool, verbose: bool):
        self.err, self.repetitions, self.verbose = err, repetitions, verbose
        self.lines = lines and not err.is_terminal
        self.bar = RichProgress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                TimeElapsedColumn(), TimeRemainingColumn(), console=err, transient=True,
                                disable=not err.is_terminal)
        self.task = None
        self.n_tests = 0

    def start(self, tests: list[Instance], n_runs: int) -> None:
        self.n_tests = len(tests)
        self.task = self.bar.add_task("bench", total=n_runs)
        r = self.repetitions
        spec = " (a speculative run is one prompt of its set)" if any(i.test.kind == "spec" for i in tests) else ""
        self._print(f"bench: {len(tests)} tests, {r} repetition{'s' * (r != 1)} each: {n_runs} timed runs{spec}")

    def test(self, i: int, name: str) -> None:
        self.bar.update(self.task, description=f"bench {i + 1}/{self.n_tests} {name}")
        if self.lines:
            self._print(f"bench {i + 1}/{self.n_tests}: {name}")

    def runs_done(self, n: int = 1) -> None:
        self.bar.advance(self.task, n)

    def log(self, line: str) -> None:
        if self.verbose:
            self._print(line)

    def _print(self, line: str) -> None:
        self.err.print(line, markup=False, highlight=False, soft_wrap=True)


def _sweep(panel: str, group, *names: str):
    """Options every command has, as bench sweep lists: the same flags and help, the default said in the help."""
    return panel, [replace(o, annotation=_L, default=None, metavar="LIST",
                           help=o.help if o.default is None else f"{o.help} (default: {o.default})")
                   for o in pick(group, *names)[1]]


@with_options(_sweep(_ENGINE, MODEL, "n_gpu_layers", "dtype"),
              _sweep(_SPEC, SPEC, "n_gpu_layers_draft", "device_draft", *NGRAM_FIELDS))
def bench(
    opts: dict,
    model: _L = _engine("-m", "--model", help="GGUF files or models.toml names (default: the default model)"),
    n_prompt: _L = _engine("-p", "--n-prompt", help="pp test prompt lengths (default: 512)"),
    n_gen: _L = _engine("-n", "--n-gen", help="tg test lengths; in a speculative sweep, tokens generated per prompt "
                        "(default: 128)"),
    n_pg: _L = _engine("-pg", help="PP,TG: a prompt + generation test (repeatable)"),
    n_depth: _L = _engine("-d", "--n-depth", help="tokens already in the KV cache (default: 0)"),
    n_batch: _L = _engine("-b", "--batch-size", help="logical batch size (default: 2048)"),
    n_ubatch: _L = _engine("-ub", "--ubatch-size", help="physical batch size (default: 512)"),
    n_threads: _L = _engine("-t", "--threads", help="CPU threads (default: torch's)"),
    devices: _L = _engine("-dev", "--device", help="auto | cpu | cuda | cuda:N (default: auto)"),
    flash_attn: _L = _engine("-fa", "--flash-attn", help="on | off | auto: recorded in the rows, no effect: "
                             f"{NO_EFFECT['-fa']} (default: auto)"),
    spec_type: _L = _spec("--spec-type", help="drafter chains to sweep: a comma list is one chain as in every "
                          "command (ngram-mod,draft-simple); ';' or a repeated flag starts the next value"),
    model_draft: _L = _spec("-md", "--model-draft", help="draft models (alone: sweeps draft-simple)"),
    draft_max: _L = _spec("--draft-max", help="max draft tokens, or auto: the adaptive draft length (default: 16)"),
    draft_min: _L = _spec("--draft-min", help="min draft tokens (default: 0)"),
    draft_p_min: _L = _spec("--draft-p-min", help="draft-model p-min (default: 0.75)"),
    spec_verify: _L = _spec("--spec-verify", help="auto | match | rejection (default: auto)"),
    spec_select: _L = _spec("--spec-select", help="priority | gain: how a chain picks the draft to verify "
                            "(default: priority)"),
    temp: _L = _spec("--temp", help="sampling temperatures (default: 0 = greedy)"),
    prompts: _L = _spec("--prompts", help="prompt set files (jsonl)"),
    prompt_set: _L = _spec("--prompt-set", help="built-in sets: code-edit, summarize, qa, writing, chat "
                           "(default: code-edit)"),
    warm: bool = typer.Option(False, "--warm", help="keep n-gram state across repetitions (default: cold)",
                              rich_help_panel=_SPEC),
    verify_cost: int = typer.Option(0, "--verify-cost", metavar="K", help="time target forwards of 1..K rows at each "
                                    "depth and print the break-even acceptance", rich_help_panel=_SPEC),
    repetitions: int = typer.Option(5, "-r", "--repetitions", help="repetitions per test", rich_help_panel=_RUN),
    output: str = typer.Option("md", "-o", "--output", help="md | csv | json | jsonl | sql (stdout)",
                               rich_help_panel=_RUN),
    output_err: Optional[str] = typer.Option(None, "-oe", "--output-err", help="second format on stderr",
                                             rich_help_panel=_RUN),
    no_warmup: bool = typer.Option(False, "--no-warmup", help="skip the warmup runs", rich_help_panel=_RUN),
    verbose: bool = typer.Option(False, "-v", "--verbose", help="log loads and samples on stderr",
                                 rich_help_panel=_RUN),
    progress: bool = typer.Option(False, "--progress", help="one progress line per test on stderr when it is not a "
                                  "terminal (a terminal always gets a progress bar)",
                                  rich_help_panel=_RUN),
    delay: int = typer.Option(0, "--delay", help="seconds to wait before each test", rich_help_panel=_RUN),
    baseline: Optional[str] = typer.Option(None, "--baseline", help="json/jsonl of an earlier run to compare with",
                                           rich_help_panel=_RUN),
    max_regression: float = typer.Option(5.0, "--max-regression", metavar="PCT", help="with --baseline: exit 1 when "
                                         "a row is this much slower beyond the noise", rich_help_panel=_RUN),
    plot: Optional[str] = typer.Option(None, "--plot", help="draw the sweep / verify curve to this PNG",
                                       rich_help_panel=_RUN),
) -> None:
    """Benchmark prompt processing, generation, speculative decoding sweeps and verify cost (llama-bench).

    Tests: for every combination of the engine lists (-m, --dtype, -ngl, -dev, -b, -ub, -fa, -t) and each depth
    -d, one pp test per -p, one tg test per -n, one pg test per -pg and one --verify-cost test; with a speculative
    sweep, per prompt set, --temp and -n, one plain test plus one per combination of the speculative lists
    (settings a chain does not read add none). Each test runs -r times after a warmup, a speculative test once per
    prompt of its set in each repetition. The number of tests and timed runs is printed before anything loads;
    on a terminal a progress bar follows it.
    """
    flags = {**locals(), **opts}
    for name, fmt in (("-o", output), ("-oe", output_err)):
        if fmt is not None and fmt not in OUTPUT_FORMATS:
            raise UsageError(f"{name} must be one of {', '.join(OUTPUT_FORMATS)}")
    params = from_flags(flags)
    if any(fa != -1 for fa in params.flash_attn):
        warn_no_effect("-fa", NO_EFFECT["-fa"])
    for flag, values, devices, which in (
            ("-ngl", params.n_gpu_layers, params.devices, "the model"),
            ("-ngld", params.n_gpu_layers_draft, [dd or d for dd in params.devices_draft for d in params.devices],
             "the draft model")):
        if any(parse_device(d).type == "cpu" for d in devices):
            warn_cpu_layers(flag, values, "cpu", which)
    from spec_cli.bench.compare import compare, format_comparison, has_regression, load_results
    from spec_cli.bench.printers import format_rows

    reference = load_results(baseline) if baseline else None  # a bad baseline fails before a long run
    err = Console(stderr=True)
    report = _Report(err, params.repetitions, lines=progress, verbose=verbose)
    with report.bar:
        rows = [r.to_dict() for r in run_bench(params, report)]
    sys.stdout.write(format_rows(rows, output))
    sys.stdout.flush()
    if output_err:
        sys.stderr.write(format_rows(rows, output_err))
    if plot:
        from spec_cli.bench.plot import plot_rows

        plot_rows(rows, plot)
        err.print(f"plot written to {plot}", highlight=False)
    if reference is not None:
        result = compare(rows, reference, max_regression)
        sys.stderr.write(format_comparison(result, max_regression))
        if has_regression(result):
            raise typer.Exit(1)
