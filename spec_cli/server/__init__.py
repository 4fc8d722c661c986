"""`spec-cli server`: llama-server's HTTP API (OpenAI-compatible and native routes) over one engine thread.

protocol.py is the wire format, task.py what passes between a route and the engine thread, scheduler.py the
engine thread with its slots, guard.py the checks before any route, app.py the routes, serve.py the uvicorn run
with its graceful shutdown.
"""

from spec_cli.server.app import ServerSettings, create_app

__all__ = ["ServerSettings", "create_app"]
