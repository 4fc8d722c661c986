"""`spec-cli server` ~ llama-server: OpenAI-compatible and llama.cpp-native HTTP API with -np slots.

Examples:
  spec-cli server -m qwen2.5-coder-0.5b -np 4 --spec-type ngram-mod --metrics
  spec-cli server -m qwen2.5-coder-1.5b -md qwen2.5-coder-0.5b --port 8081 --api-key secret -a coder

-np splits -c evenly: each slot holds n_ctx / np tokens (prompt + generation). The default -np is 4, as
llama-server's "auto"; a prompt longer than a slot's context is refused with a 400 naming both numbers.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from spec_cli.cli.options import with_options
from spec_cli.errors import SpecCliError
from spec_cli.options import MODEL, SAMPLING, SERVER, SPEC


@with_options(MODEL, SAMPLING, SPEC, SERVER)
def server(opts: dict) -> int:
    """Serve the model over HTTP (llama-server): /v1/chat/completions, /v1/completions, /completion, ...

    SIGTERM or SIGINT (^C) stops it: requests in flight get a few seconds to finish, then a 503; the exit status is
    0 after SIGTERM and 130 after SIGINT."""
    from spec_cli.cli.settings import engine_options, sampling_params
    from spec_cli.runtime.memory import SUFFIX_PART, size, suffix_store_estimate
    from spec_cli.runtime.session import open_session
    from spec_cli.server import ServerSettings, create_app
    from spec_cli.server.serve import serve

    host, port = opts["host"], opts["port"]
    settings = ServerSettings(alias=opts["alias"], api_key=opts["api_key"], metrics=opts["metrics"],
                              slots=opts["slots"], n_predict=opts["n_predict"], sampling=sampling_params(opts),
                              chat_template=opts["chat_template"],
                              allowed_hosts=[host, *(opts["allowed_hosts"] or "").split(",")],
                              max_body=opts["max_body_mib"] << 20,
                              read_timeout=opts["read_timeout"], slot_save_path=slot_dir(opts["slot_save_path"]))
    session = open_session(engine_options(opts, n_seq=opts["parallel"]))
    app = create_app(session, settings)
    engine, types = session.engine, ",".join(session.types) or "none"
    memory = app.state.memory
    used, store = memory["total"], ""
    if SUFFIX_PART in memory:  # empty at the start: what it holds at its bounds
        full = suffix_store_estimate(session.spec.suffix_cache_tokens, engine.ctx.n_seq, engine.ctx.n_ctx_seq)
        store = f", suffix store {size(full)} when full"
    print(f"spec-cli server: http://{host}:{port}  model {engine.target.gguf.path.name}, {opts['parallel']} slots of "
          f"{engine.ctx.n_ctx_seq} tokens, --spec-type {types}; memory: weights {size(used['weights'])}, KV cache "
          f"{size(used['kv'])}{store}", file=sys.stderr)
    return serve(app, host, port)


def slot_dir(value: str | None) -> Path | None:
    """--slot-save-path as an absolute directory, created if missing (a SpecCliError where it cannot be)."""
    if value is None:
        return None
    path = Path(value).expanduser().resolve()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SpecCliError(f"--slot-save-path {value}: cannot create the directory ({e.strerror})") from None
    if not os.access(path, os.R_OK | os.W_OK | os.X_OK):
        raise SpecCliError(f"--slot-save-path {value}: the directory is not readable and writable")
    return path
