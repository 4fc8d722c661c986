"""Runs the app under uvicorn, with a shutdown that ends the requests in flight cleanly.

uvicorn alone, on SIGTERM or SIGINT, waits for the requests in flight and then cancels them mid-response: a
plain-text 500, a stream cut with neither an error event nor [DONE], CancelledError tracebacks in the log. Here
new requests get the JSON 503 at once, the ones in flight `grace` seconds to finish, and then the rest end with
the 503 too (a stream with an error event, then [DONE] on the OpenAI routes) before uvicorn closes the
connections. `serve` returns the exit status: 0 after SIGTERM (a requested stop, as llama-server), 130 after
SIGINT (an interrupted command, as the other spec-cli commands).
"""

from __future__ import annotations

import asyncio
import functools
import signal
import time

import uvicorn
from fastapi import FastAPI

from spec_cli.server.connection import Connection

GRACE_SECONDS = 5.0


class Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, grace: float = GRACE_SECONDS):
        super().__init__(config)
        self.grace = grace
        self.exit_signal: int | None = None

    def handle_exit(self, sig: int, frame) -> None:
        # not uvicorn's own, which re-raises the signal once shut down: SIGINT then exits 0 or 130 by timing
        self.exit_signal = self.exit_signal or sig
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True  # a second ^C: stop waiting for anything
        else:
            self.should_exit = True

    async def shutdown(self, sockets=None) -> None:
        scheduler = self.config.app.state.scheduler
        scheduler.close()
        deadline = time.monotonic() + self.grace
        while not scheduler.idle and time.monotonic() < deadline and not self.force_exit:
            await asyncio.sleep(0.05)
        await asyncio.to_thread(scheduler.shutdown)  # fails what is left with the 503
        await super().shutdown(sockets)


def uvicorn_config(app: FastAPI, **kwargs) -> uvicorn.Config:
    """The app under uvicorn with the server's own connection protocol (connection.py)."""
    # uvicorn's own wait for the connections comes after the grace period: only responses still being written
    protocol = functools.partial(Connection, read_timeout=app.state.settings.read_timeout)
    return uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=GRACE_SECONDS, http=protocol, **kwargs)


def serve(app: FastAPI, host: str, port: int) -> int:
    """Serves until SIGTERM or SIGINT; returns the exit status."""
    server = Server(uvicorn_config(app, host=host, port=port))
    server.run()
    return 130 if server.exit_signal == signal.SIGINT else 0
