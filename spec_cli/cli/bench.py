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
  spec-cli bench -m qwen2.5-coder-1.5b --spec-accept 0.9,0.8/0.6 --draft-max 4,auto -n 64   # synthetic acceptance
  spec-cli bench -m qwen2.5-coder-0.5b -p 0 -n 64 -r 10 --baseline-cmd main/.venv/bin/spec-cli   # paired CI gate
  spec-cli bench -o jsonl --baseline main.jsonl --max-regression 10     # against a stored run (unpaired)
"""

from __future__ import annotations

import signal
import sys
from contextlib import contextmanager

import typer
from rich.console import Console

from spec_cli.bench.printers import format_rows
from spec_cli.cli.options import with_options
from spec_cli.errors import UsageError
from spec_cli.options import BENCH, NO_EFFECT


@with_options(*BENCH)
def bench(opts: dict, given: dict) -> None:
    """Benchmark prompt processing, generation, speculative decoding sweeps and verify cost (llama-bench).

    Tests: for every combination of the engine lists (-m, --dtype, -ngl, -dev, -b, -ub, -fa, -t) and each depth
    -d, one pp test per -p, one tg test per -n, one pg test per -pg and one --verify-cost test; with a speculative
    sweep, per prompt set, --temp and -n, one plain test plus one per combination of the speculative lists
    (settings a chain does not read add none). Each test runs -r times after a warmup, a speculative test once per
    prompt of its set in each repetition. The number of tests and timed runs is printed before anything loads;
    on a terminal a progress bar follows it. With --baseline-cmd, -r pairs of runs of the two builds instead.
    -o jsonl writes each test's rows as soon as it finishes (a speculative group's together); stopped by ^C or
    SIGTERM, bench writes the rows of the tests that finished in the chosen format and exits 130 / 143.
    """
    from spec_cli.bench.compare import load_results
    from spec_cli.bench.paired import MIN_PAIRS, parse_command
    from spec_cli.bench.params import from_flags

    output, output_err = opts["output"], opts["output_err"]
    params = from_flags(opts)
    _warn_ignored(params)
    reference = load_results(opts["baseline"]) if opts["baseline"] else None  # a bad baseline fails before a run
    baseline_cmd = parse_command(opts["baseline_cmd"]) if opts["baseline_cmd"] else None
    if baseline_cmd and params.repetitions < MIN_PAIRS:
        raise UsageError(f"--baseline-cmd needs -r {MIN_PAIRS} or more (pairs of runs: with fewer, no count of "
                         "slower pairs is unlikely enough by chance)")
    err = Console(stderr=True)
    gates: list[Gate] = []
    counted = reference  # the rows the exact counters are compared with: the paired baseline's, else the file's
    # jsonl rows are written as their tests finish: an hour-long sweep stopped by anything keeps what it measured
    streamed = output == "jsonl" and not baseline_cmd
    if baseline_cmd:
        rows, counted, speed = _run_paired(opts, given, baseline_cmd, err)
        gates.append(speed)
    else:
        rows = _run_here(params, opts, err, streamed)
    _write_rows(rows, output, output_err, streamed)
    if opts["plot"]:
        from spec_cli.bench.plot import plot_rows

        plot_rows(rows, opts["plot"])
        err.print(f"plot written to {opts['plot']}", highlight=False)
    if reference is not None:
        gates.append(_stored_gate(rows, reference, opts["max_regression"]))
    if counted is not None:
        gates.append(_counter_gate(rows, counted))
    # every gate's report, then the verdicts with the failures last (a failed run's last line says why)
    for text, _, _ in gates:
        sys.stderr.write(text)
    for _, verdict, failed in sorted(gates, key=lambda g: g[2]):
        sys.stderr.write(verdict + "\n" if verdict else "")
    if any(failed for _, _, failed in gates):
        raise typer.Exit(1)


def _write(stream, text: str) -> None:
    stream.write(text)
    stream.flush()


def _write_rows(rows: list[dict], output: str, output_err: str | None, streamed: bool) -> None:
    """The rows on stdout (unless they were streamed there already) and on stderr."""
    if not streamed:
        _write(sys.stdout, format_rows(rows, output))
    if output_err:
        _write(sys.stderr, format_rows(rows, output_err))


def _run_here(params, opts: dict, err: Console, streamed: bool) -> list[dict]:
    """The grid in this process. Stopped by ^C or SIGTERM, it writes the finished tests' rows and exits 130 / 143."""
    from spec_cli.bench.runner import run_bench
    from spec_cli.cli.bench_report import BenchReport

    output = opts["output"]
    report = BenchReport(err, params.repetitions, lines=opts["progress"], verbose=opts["verbose"],
                         stream=(lambda done: _write(sys.stdout, format_rows(done, output))) if streamed else None)
    try:
        with report.bar, _sigterm_as_interrupt():
            return [r.to_dict() for r in run_bench(params, report)]
    except KeyboardInterrupt as stop:
        _write_rows(report.done, output, opts["output_err"], streamed)
        err.print(f"bench: stopped; the {len(report.done)} rows of the tests that finished are written",
                  markup=False, highlight=False)
        raise typer.Exit(143 if isinstance(stop, _Terminated) else 130) from None


class _Terminated(KeyboardInterrupt):
    """SIGTERM (a CI job's timeout, `kill`): stops a bench as ^C does."""


@contextmanager
def _sigterm_as_interrupt():
    def stop(signum, frame):
        raise _Terminated

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _warn_ignored(params) -> None:
    """One line per llama.cpp flag given a value that changes nothing here (-fa; -ngl / -ngld on the CPU)."""
    from spec_cli.cli.settings import warn_cpu_layers, warn_no_effect
    from spec_cli.model.loader import torch_device

    if any(fa != -1 for fa in params.flash_attn):
        warn_no_effect("-fa", NO_EFFECT["-fa"])
    for flag, values, devices, which in (
            ("-ngl", params.n_gpu_layers, params.devices, "the model"),
            ("-ngld", params.n_gpu_layers_draft, [dd or d for dd in params.devices_draft for d in params.devices],
             "the draft model")):
        if any(torch_device(d).type == "cpu" for d in devices):
            warn_cpu_layers(flag, values, "cpu", which)


# a gate's outcome: (its report for stderr, its verdict line, whether it failed)
Gate = tuple[str, str, bool]


def _run_paired(opts: dict, given: dict, baseline_cmd: list[str],
                err: Console) -> tuple[list[dict], list[dict], Gate]:
    """-r pairs of runs and the sign test per row; `given`: the flags as typed, which each build parses itself.
    Returns the current build's rows (pooled over its runs, each with its pairs), the baseline build's rows and the
    speed gate."""
    from spec_cli.bench import paired

    n = opts["repetitions"]
    err.print(f"bench: {n} pairs of runs, one process per run of each build (baseline, current, then the other "
              "way round)", markup=False, highlight=False)
    current_runs, baseline_runs = paired.run_pairs(baseline_cmd, paired.child_args(given), n,
                                                   lambda line: err.print(line, markup=False, highlight=False))
    rows, base_rows = paired.pool(current_runs), paired.pool(baseline_runs)
    verdicts = paired.judge(current_runs, baseline_runs, opts["max_regression"])
    paired.attach_pairs(rows, verdicts, base_rows, baseline_cmd)
    return rows, base_rows, (paired.format_paired(verdicts, opts["max_regression"], baseline_cmd),
                             paired.paired_verdict(verdicts, opts["max_regression"]), paired.has_regression(verdicts))


def _stored_gate(rows: list[dict], reference: list[dict], max_regression: float) -> Gate:
    """--baseline FILE: the unpaired speed comparison."""
    from spec_cli.bench.compare import compare, comparison_verdict, format_comparison, has_regression

    result = compare(rows, reference, max_regression)
    return format_comparison(result), comparison_verdict(result, max_regression), has_regression(result)


def _counter_gate(rows: list[dict], baseline_rows: list[dict]) -> Gate:
    """Exact counters against the baseline's rows (the paired run's when there is one, else the stored file's), and
    greedy speculation against this run's plain rows."""
    from spec_cli.bench.counters import compare_counters, counters_verdict, format_counters, gated, lossless

    changed, notes = compare_counters(rows, baseline_rows)
    failures = lossless(rows) + changed
    n_gated = sum(bool(gated(r)) for r in rows)
    if not n_gated:
        return "", "", False  # nothing to compare exactly: no greedy speculative rows
    return format_counters(failures, notes), counters_verdict(failures, n_gated), bool(failures)
