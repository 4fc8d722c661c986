"""`spec-cli lookup`, `lookup-create`, `lookup-merge`, `lookup-stats` ~ llama.cpp's examples/lookup tools.

Examples:
  spec-cli lookup-create -m qwen2.5-coder-0.5b -f corpus.txt -lcs static.bin
  spec-cli lookup -m qwen2.5-coder-0.5b -f prompt.txt --temp 0 --draft-max 8 -lcs static.bin -lcd dynamic.bin
  spec-cli lookup-merge a.bin b.bin merged.bin
  spec-cli lookup-stats -m qwen2.5-coder-0.5b -f text.txt -c 512 -lcs static.bin
"""

from __future__ import annotations

import sys

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from spec_cli.cli.options import with_options
from spec_cli.cli.output import memory_table, print_json, print_lookup_text_log, run_table, stderr
from spec_cli.errors import UsageError
from spec_cli.options import CHUNKS, LOG, MODEL, PROMPT, SAMPLING, SPEC, draft_bound, pick

DRAFT_MAX = pick(SPEC, "draft_max")
CACHES = pick(SPEC, "lookup_cache_static", "lookup_cache_dynamic")
MODEL_ONLY = pick(MODEL, "model")


@with_options(MODEL, PROMPT, LOG, SAMPLING, DRAFT_MAX, CACHES)
def lookup(
    opts: dict,
    color: bool = typer.Option(False, "--color", help="show tokens that came from accepted drafts in green"),
) -> None:
    """Lookup decoding: n-gram cache drafting from the prompt, -lcd and -lcs (llama-lookup); saves -lcd."""
    from spec_cli.cli.common import read_prompt, run_prompt
    from spec_cli.cli.settings import engine_options, sampling_params
    from spec_cli.runtime.engine import build_engine
    from spec_cli.runtime.lookup import lookup_figures, open_lookup_session, save_dynamic_cache
    from spec_cli.speculative.base import SpecParams

    draft_max, adaptive = draft_bound(opts["draft_max"])
    text = read_prompt(opts)
    sampling = sampling_params(opts)
    spec = SpecParams(lookup_cache_static=opts["lookup_cache_static"],
                      lookup_cache_dynamic=opts["lookup_cache_dynamic"], adaptive=adaptive)
    engine = build_engine(engine_options(opts))  # no spec types: the caches load in open_lookup_session, timed
    session, t_load_ms = open_lookup_session(engine, spec, draft_max)
    result = run_prompt(session, text, sampling, opts, color=color)
    if opts["lookup_cache_dynamic"]:
        save_dynamic_cache(session, result.sequence)
    summary = {**result.to_dict(session), **lookup_figures(session, result.sequence, t_load_ms)}
    if opts["json_output"]:
        print_json(summary)
        return
    sys.stdout.write("\n")
    if opts["log_format"] == "text":
        print_lookup_text_log(summary)
        return
    stderr.print()
    stderr.print(run_table(summary))
    stderr.print(memory_table(summary["memory"]))
    stderr.print(figures_table("lookup", summary))


@with_options(MODEL_ONLY)
def lookup_create(
    opts: dict,
    file: str = typer.Option(..., "-f", "--file", help="corpus text file"),
    lookup_cache_static: str = typer.Option(..., "-lcs", "--lookup-cache-static", help="static cache file to write"),
) -> None:
    """Build a static n-gram (bigram) cache from a corpus (llama-lookup-create); reads only the tokenizer."""
    from spec_cli.runtime.lookup import load_tokenizer, tokenize_corpus
    from spec_cli.runtime.lookup_offline import build_static_cache
    from spec_cli.speculative.ngram_cache_file import save_cache

    tokens = tokenize_corpus(load_tokenizer(opts["model"]), file)
    columns = (TextColumn("counting bigrams"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, console=stderr, transient=True) as progress:
        task = progress.add_task("", total=len(tokens))
        cache = build_static_cache(tokens, lambda done: progress.update(task, completed=done))
    save_cache(cache, lookup_cache_static)
    stderr.print(f"{len(tokens)} tokens, {len(cache)} bigrams -> {lookup_cache_static}")


def lookup_merge(
    files: list[str] = typer.Argument(..., help="input cache files, then the output file", show_default=False),
) -> None:
    """Add the counts of several n-gram cache files into one (llama-lookup-merge IN1 IN2 ... OUT)."""
    from spec_cli.runtime.lookup import merge_cache_files
    from spec_cli.speculative.ngram_cache_file import save_cache

    if len(files) < 3:
        raise UsageError("lookup-merge needs at least two input files and an output file: IN1 IN2 [...] OUT")
    merged = merge_cache_files(files[:-1])
    save_cache(merged, files[-1])
    stderr.print(f"merged {len(files) - 1} files, {len(merged)} n-grams -> {files[-1]}")


@with_options(MODEL_ONLY, CHUNKS, DRAFT_MAX, CACHES)
def lookup_stats(
    opts: dict,
    file: str = typer.Option(..., "-f", "--file", help="text to replay"),
    json_output: bool = typer.Option(False, "--json", help="print the figures as one JSON object"),
) -> None:
    """Offline lookup simulation: replay a text in chunks, drafting at every token (llama-lookup-stats)."""
    from spec_cli.runtime.lookup import load_tokenizer, simulate, tokenize_corpus

    draft_max, _ = draft_bound(opts["draft_max"])  # no target to time: auto drafts up to its bound
    tokens = tokenize_corpus(load_tokenizer(opts["model"]), file)
    figures = simulate(tokens, opts["ctx_size"], draft_max, opts["lookup_cache_static"], opts["lookup_cache_dynamic"])
    if json_output:
        print_json(figures)
    else:
        stderr.print(figures_table("lookup-stats", figures))


def figures_table(title: str, d: dict) -> Table:
    """llama-lookup's closing lines as a two-column table."""
    t = Table(title=title, title_justify="left", show_header=False)
    t.add_column("figure")
    t.add_column("value", justify="right")
    for key in ("n_draft", "n_predict", "n_drafted"):
        t.add_row(key, str(d[key]))
    t.add_row("t_draft_flat", f"{d['t_draft_flat_ms']:.2f} ms")
    t.add_row("t_draft", f"{d['t_draft_ms']:.2f} ms, {d['t_draft_us_per_token']:.2f} us per token, "
                         f"{d['draft_tokens_per_second']:.2f} tokens per second")
    t.add_row("n_accept", str(d["n_accept"]))
    t.add_row("accept", f"{d['accept']:.3f}%")
    return t
