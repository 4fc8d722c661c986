"""`spec-cli server`: llama-server's HTTP API (OpenAI-compatible and native routes) over one engine thread.

protocol.py is the wire format, task.py what passes between a route and the engine thread, scheduler.py the
engine thread with its slots, guard.py the checks before any route, settings.py the server's flags, routes.py the
handlers (props.py the /props body, slot_actions.py the slot files' route), app.py the app that mounts them,
connection.py a client connection (uvicorn's HTTP/1.1 with a read deadline), serve.py the uvicorn run with its
graceful shutdown.
"""

from spec_cli.server.app import create_app
from spec_cli.server.settings import ServerSettings

__all__ = ["ServerSettings", "create_app"]
