"""`spec-cli server` ~ llama-server: OpenAI-compatible and llama.cpp-native HTTP API with -np slots.

Examples:
  spec-cli server -m qwen2.5-coder-0.5b -np 4 --spec-type ngram-mod --metrics
  spec-cli server -m qwen2.5-coder-1.5b -md qwen2.5-coder-0.5b --port 8081 --api-key secret -a coder

-np splits -c evenly: each slot holds n_ctx / np tokens (prompt + generation). The default -np is 4, as
llama-server's "auto"; a prompt longer than a slot's context is refused with a 400 naming both numbers.
"""

from __future__ import annotations

import sys
from typing import Optional

import typer

from spec_cli.cli.options import engine_options, sampling_params, with_options
from spec_cli.errors import UsageError
from spec_cli.options import MODEL, SAMPLING, SPEC, default
from spec_cli.runtime.session import open_session

DEFAULT_PARALLEL = 4  # llama-server's -np auto


@with_options(MODEL, SAMPLING, SPEC)
def server(
    opts: dict,
    host: str = typer.Option("127.0.0.1", "--host", help="address to listen on"),
    port: int = typer.Option(8080, "--port", help="port to listen on"),
    parallel: int = typer.Option(-1, "-np", "--parallel", help=f"slots (-1 = auto = {DEFAULT_PARALLEL})"),
    api_key: Optional[str] = typer.Option(None, "--api-key", help="require this key (Bearer or X-Api-Key) "
                                          "on every route but /health"),
    metrics: bool = typer.Option(False, "--metrics", help="enable the Prometheus /metrics endpoint"),
    slots: bool = typer.Option(False, "--slots/--no-slots", help="enable the /slots endpoint, which shows every "
                               "slot's latest prompt and output to whoever may call the server (off by default, "
                               "unlike llama-server)"),
    alias: Optional[str] = typer.Option(None, "-a", "--alias", help="model id shown by the API"),
    n_predict: int = typer.Option(default("n_predict"), "-n", "--n-predict", help="default generation limit of a "
                                  "request (-1 = until end of generation or the slot's context end)"),
    chat_template: Optional[str] = typer.Option(None, "--chat-template", help="override the chat template "
                                                "(jinja source or chatml|gemma)"),
    allowed_hosts: Optional[str] = typer.Option(None, "--allowed-hosts", help="Host header names to accept "
                                                "besides IP addresses, localhost and --host (comma list; * = any)"),
    max_body_mib: int = typer.Option(8, "--max-body-mib", help="largest request body in MiB (413 above it)"),
    read_timeout: float = typer.Option(30.0, "--read-timeout", help="seconds a request has to arrive whole, "
                                       "headers and body, from its first byte (and a new connection to send one): "
                                       "408 and the connection closed after"),
) -> int:
    """Serve the model over HTTP (llama-server): /v1/chat/completions, /v1/completions, /completion, ...

    SIGTERM or SIGINT (^C) stops it: requests in flight get a few seconds to finish, then a 503; the exit status is
    0 after SIGTERM and 130 after SIGINT."""
    from spec_cli.server import ServerSettings, create_app
    from spec_cli.server.serve import serve

    if parallel == -1:
        parallel = DEFAULT_PARALLEL
    if parallel < 1:
        raise UsageError("-np must be at least 1 (or -1 = auto)")
    if not 0 < port < 65536:
        raise UsageError("--port must be in 1..65535")
    if n_predict < -1:
        raise UsageError("-n must be >= -1")
    settings = ServerSettings(alias=alias, api_key=api_key, metrics=metrics, slots=slots,
                              n_predict=n_predict, sampling=sampling_params(opts), chat_template=chat_template,
                              allowed_hosts=[host, *(allowed_hosts or "").split(",")], max_body=max_body_mib << 20,
                              read_timeout=read_timeout)
    session = open_session(engine_options(opts, n_seq=parallel))
    app = create_app(session, settings)
    engine, types = session.engine, ",".join(session.types) or "none"
    print(f"spec-cli server: http://{host}:{port}  model {engine.target.gguf.path.name}, {parallel} slots of "
          f"{engine.ctx.n_ctx_seq} tokens, --spec-type {types}", file=sys.stderr)
    return serve(app, host, port)
