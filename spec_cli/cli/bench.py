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

import typer
from rich.console import Console

from spec_cli.cli.options import with_options
from spec_cli.options import BENCH, NO_EFFECT


@with_options(*BENCH)
def bench(opts: dict) -> None:
    """Benchmark prompt processing, generation, speculative decoding sweeps and verify cost (llama-bench).

    Tests: for every combination of the engine lists (-m, --dtype, -ngl, -dev, -b, -ub, -fa, -t) and each depth
    -d, one pp test per -p, one tg test per -n, one pg test per -pg and one --verify-cost test; with a speculative
    sweep, per prompt set, --temp and -n, one plain test plus one per combination of the speculative lists
    (settings a chain does not read add none). Each test runs -r times after a warmup, a speculative test once per
    prompt of its set in each repetition. The number of tests and timed runs is printed before anything loads;
    on a terminal a progress bar follows it.
    """
    from spec_cli.bench.compare import compare, format_comparison, has_regression, load_results
    from spec_cli.bench.params import from_flags
    from spec_cli.bench.printers import format_rows
    from spec_cli.bench.runner import run_bench
    from spec_cli.cli.bench_report import BenchReport
    from spec_cli.cli.settings import warn_cpu_layers, warn_no_effect
    from spec_cli.model.loader import torch_device

    output, output_err = opts["output"], opts["output_err"]
    params = from_flags(opts)
    if any(fa != -1 for fa in params.flash_attn):
        warn_no_effect("-fa", NO_EFFECT["-fa"])
    for flag, values, devices, which in (
            ("-ngl", params.n_gpu_layers, params.devices, "the model"),
            ("-ngld", params.n_gpu_layers_draft, [dd or d for dd in params.devices_draft for d in params.devices],
             "the draft model")):
        if any(torch_device(d).type == "cpu" for d in devices):
            warn_cpu_layers(flag, values, "cpu", which)
    baseline = opts["baseline"]
    reference = load_results(baseline) if baseline else None  # a bad baseline fails before a long run
    err = Console(stderr=True)
    report = BenchReport(err, params.repetitions, lines=opts["progress"], verbose=opts["verbose"])
    with report.bar:
        rows = [r.to_dict() for r in run_bench(params, report)]
    sys.stdout.write(format_rows(rows, output))
    sys.stdout.flush()
    if output_err:
        sys.stderr.write(format_rows(rows, output_err))
    if opts["plot"]:
        from spec_cli.bench.plot import plot_rows

        plot_rows(rows, opts["plot"])
        err.print(f"plot written to {opts['plot']}", highlight=False)
    if reference is not None:
        result = compare(rows, reference, opts["max_regression"])
        sys.stderr.write(format_comparison(result, opts["max_regression"]))
        if has_regression(result):
            raise typer.Exit(1)
