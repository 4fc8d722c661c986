"""`spec-cli speculative-simple` ~ llama-speculative-simple: one sequence, any --spec-type chain, end-of-run stats.

Examples:
  spec-cli speculative-simple -m qwen2.5-coder-1.5b -md qwen2.5-coder-0.5b -f prompt.txt --temp 0 --color
  spec-cli speculative-simple -p "..." --spec-type ngram-mod,draft -md qwen2.5-coder-0.5b --json
"""

from __future__ import annotations

import sys

import typer

from spec_cli.cli.options import with_options
from spec_cli.options import LOG, MODEL, PROMPT, SAMPLING, SPEC


@with_options(MODEL, PROMPT, LOG, SAMPLING, SPEC)
def speculative_simple(
    opts: dict,
    color: bool = typer.Option(False, "--color", help="show tokens that came from accepted drafts in green"),
) -> None:
    """Speculative decoding of one prompt with end-of-run statistics (llama-speculative-simple)."""
    from spec_cli.cli.common import read_prompt, run_prompt
    from spec_cli.cli.output import print_json, print_summary, print_text_log
    from spec_cli.cli.settings import engine_options, sampling_params
    from spec_cli.runtime.session import open_session

    text = read_prompt(opts)
    sampling = sampling_params(opts)
    session = open_session(engine_options(opts, speculative=True))
    summary = run_prompt(session, text, sampling, opts, color=color).to_dict(session)
    if opts["json_output"]:
        print_json(summary)
        return
    sys.stdout.write("\n")
    (print_text_log if opts["log_format"] == "text" else print_summary)(summary)
