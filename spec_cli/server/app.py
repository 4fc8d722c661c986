"""The FastAPI app of `spec-cli server`: routes.py's handlers mounted around one Scheduler (the engine thread).

OpenAI-compatible `/v1/models`, `/v1/completions`, `/v1/chat/completions` (SSE ending in `data: [DONE]`),
llama.cpp-native `/completion`, `/tokenize`, `/detokenize`, `/health`, `/props`, `/slots` (with --slots),
`/slots/{id}?action=save|restore|erase` (with --slot-save-path) and `/metrics` (with --metrics). A request passes
guard.py's checks first (Host, API key, framing, JSON content type, body size). Every error, including malformed JSON
and failed validation, is a JSON body in OpenAI's shape.
"""

from __future__ import annotations

import math
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from spec_cli.runtime.session import Session
from spec_cli.server import protocol as P
from spec_cli.server.guard import RequestGuard
from spec_cli.server.routes import ROUTES, ClientGone, Routes
from spec_cli.server.scheduler import Scheduler
from spec_cli.server.settings import ServerSettings


def create_app(session: Session, settings: ServerSettings | None = None) -> FastAPI:
    settings = settings or ServerSettings()
    scheduler = Scheduler(session)
    routes = Routes(scheduler, settings)

    @asynccontextmanager
    async def lifespan(_app):
        scheduler.start()
        yield
        scheduler.shutdown()

    app = FastAPI(title="spec-cli server", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.scheduler, app.state.settings = scheduler, settings
    app.state.memory = routes.memory  # the models' bytes, measured once (the start-up line reads them too)
    app.add_middleware(RequestGuard, hosts=settings.allowed_hosts, api_key=settings.api_key,
                       max_body=settings.max_body if settings.max_body is not None else math.inf)
    _install_error_handlers(app)
    for method, paths, name in ROUTES:
        for path in paths:
            app.add_api_route(path, getattr(routes, name), methods=[method])
    return app


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(P.ApiError)
    async def api_error(_request, e: P.ApiError):
        return JSONResponse(e.body(), e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request, e: StarletteHTTPException):
        kind = {401: "authentication_error", 404: "not_found_error"}.get(e.status_code, "invalid_request_error")
        return JSONResponse(P.error_body(e.status_code, str(e.detail), kind), e.status_code,
                            headers=getattr(e, "headers", None))

    @app.exception_handler(ClientGone)
    @app.exception_handler(ClientDisconnect)  # before its body arrived (connection.py logs it)
    async def gone(_request, _e):
        return Response(status_code=499)  # nobody reads it: the connection is closed

    @app.exception_handler(Exception)
    async def crash(_request, e: Exception):
        return JSONResponse(P.error_body(500, f"internal error: {type(e).__name__}: {e}", "server_error"), 500)
