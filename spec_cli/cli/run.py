"""`spec-cli run` ~ llama-cli: generate from a prompt, or chat (-cnv), with any speculative flags.

Examples:
  spec-cli run -m qwen2.5-coder-0.5b -p "def fibonacci(n):" -n 64 --temp 0
  spec-cli run -p "Write a haiku about the sea" -cnv --spec-type ngram-mod
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from spec_cli.cli.options import with_options
from spec_cli.options import MODEL, PROMPT, SAMPLING, SPEC

if TYPE_CHECKING:
    from spec_cli.runtime.session import Session


@with_options(MODEL, PROMPT, SAMPLING, SPEC)
def run(opts: dict) -> None:
    """Generate text from a prompt (llama-cli). Streams to stdout, then a summary on stderr."""
    from spec_cli.cli.common import read_prompt, run_prompt
    from spec_cli.cli.output import print_json, print_summary
    from spec_cli.cli.settings import engine_options, sampling_params
    from spec_cli.runtime.session import open_session

    interactive = opts["conversation"] and sys.stdin.isatty() and not opts["json_output"]
    text = read_prompt(opts, required=not interactive)
    sampling = sampling_params(opts)
    session = open_session(engine_options(opts))
    if interactive:
        chat_loop(session, text, sampling, opts)
        return
    summary = run_prompt(session, text, sampling, opts).to_dict(session)
    if opts["json_output"]:
        print_json(summary)
    else:
        sys.stdout.write("\n")
        print_summary(summary)


def chat_loop(session: Session, first: str | None, sampling, opts: dict) -> None:
    """Interactive conversation: the KV cache keeps the common prefix of the re-rendered chat between turns."""
    from spec_cli.cli.common import TextStream
    from spec_cli.cli.output import stderr
    from spec_cli.runtime.generate import generate

    engine = session.engine
    tok = engine.tokenizer
    messages: list[dict] = []
    cached: list[int] = []
    gen = session.generator()
    message = first
    while True:
        if message is None:
            try:
                message = input("\n> ")
            except EOFError:
                return
            if message.strip() in ("/exit", "/quit"):
                return
        messages.append({"role": "user", "content": message})
        text = tok.apply_chat_template(messages, True, opts["chat_template"])
        tokens = tok.encode(text, add_special=True, parse_special=True)
        n_cached = 0
        while n_cached < min(len(cached), len(tokens)) and cached[n_cached] == tokens[n_cached]:
            n_cached += 1
        sink = TextStream(engine)
        seq = generate(gen, tokens, sampling, opts["n_predict"], on_emit=sink, n_cached=n_cached)
        reply = sink.close()
        sys.stdout.write("\n")  # end the reply's line: the note goes to stderr, on the same terminal
        cached = seq.tokens
        messages.append({"role": "assistant", "content": reply})
        stderr.print(f"[dim]{seq.n_generated} tokens[/dim]")
        message = None
