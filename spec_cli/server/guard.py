"""The checks every request passes before a route sees it: who may call the server and what a request may carry.

- Framing: a request with both Content-Length and Transfer-Encoding is refused (400, connection closed): a proxy in
  front may have framed its body by the other header than this server would, and so let a second request through
  inside it (request smuggling).
- Host: a web page can reach a server on the loopback through a name of its own that it re-points at 127.0.0.1
  (DNS rebinding) and read /slots, which holds other clients' prompts and outputs. Such a request carries that
  name in its Host header, so only IP addresses, localhost (and *.localhost, which browsers keep on the loopback),
  the --host name and the --allowed-hosts names are accepted (403 otherwise). The header must be a host[:port]
  and nothing else, and present (HTTP/1.0 lets a client leave it out): 400 otherwise, unless --allowed-hosts '*'.
- API key (--api-key): every route but /health needs `Authorization: Bearer KEY` or `X-Api-Key: KEY` (llama.cpp),
  the key exactly, compared in constant time.
- POST bodies must be `Content-Type: application/json` (415 otherwise): a page on any site can make a browser
  POST a text/plain, form or untyped body without asking the server first (CORS "simple requests"), JSON it
  cannot.
- Body size (--max-body-mib): a larger body is refused (413) before it is read.

A refusal is a JSON error in OpenAI's shape, like every other error of the server.
"""

from __future__ import annotations

import hmac
import ipaddress
import re

from fastapi.responses import JSONResponse
from starlette.datastructures import Headers

from spec_cli.server.protocol import ApiError


class RequestGuard:
    """ASGI middleware: `hosts` are the accepted Host names besides IP addresses and localhost ("*" = any)."""

    PUBLIC = ("/health", "/v1/health")  # no API key needed

    def __init__(self, app, hosts: list[str], api_key: str | None, max_body: int):
        self.app, self.max_body = app, max_body
        self.hosts = {_host_name(h.strip()) or h.strip().lower() for h in hosts if h.strip()}
        self.key = api_key.encode() if api_key is not None else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self._refusal(scope, Headers(scope=scope))
        if refusal is not None:
            await JSONResponse(refusal.body(), refusal.status, headers=refusal.headers)(scope, receive, send)
            return
        await self.app(scope, self._limited(receive), send)

    def _refusal(self, scope, headers: Headers) -> ApiError | None:
        if "transfer-encoding" in headers and "content-length" in headers:
            return ApiError(400, "a request may carry Content-Length or Transfer-Encoding, not both",
                            headers={"Connection": "close"})  # where this body ends is in doubt: so is the next
        refusal = self._host_refusal(headers.get("host"))
        if refusal is not None:
            return refusal
        if self.key is not None and scope["path"] not in self.PUBLIC and not self._authorized(headers):
            return ApiError(401, "Invalid API Key", "authentication_error")
        if scope["method"] == "POST":
            media_type = headers.get("content-type", "").split(";")[0].strip().lower()
            if media_type != "application/json":
                return ApiError(415, "the request body must be sent as Content-Type: application/json "
                                f"(got {media_type or 'none'}; curl: -H 'Content-Type: application/json')")
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            return self._too_large()
        return None

    def _host_refusal(self, host: str | None) -> ApiError | None:
        if "*" in self.hosts:
            return None
        name = _host_name(host) if host is not None else None
        if name is None:
            return ApiError(400, "the Host header is missing" if host is None else
                            f"the Host header {host!r} is not a host name or address with an optional :port")
        if _is_ip(name) or name == "localhost" or name.endswith(".localhost") or name in self.hosts:
            return None
        return ApiError(403, f"Host {host!r} is not allowed (a guard against DNS rebinding): use an IP address "
                        "or localhost, or start the server with --allowed-hosts", "permission_error")

    def _authorized(self, headers: Headers) -> bool:
        auth = headers.get("authorization", "")
        given = auth[7:] if auth[:7].lower() == "bearer " else headers.get("x-api-key", "")
        return hmac.compare_digest(given.encode("latin-1"), self.key)  # the header's own bytes, nothing trimmed

    def _limited(self, receive):
        """`receive` that refuses a body (sent without a length, chunked) once it passes the limit."""
        n_bytes = 0

        async def receive_limited():
            nonlocal n_bytes
            message = await receive()
            n_bytes += len(message.get("body", b""))
            if n_bytes > self.max_body:
                raise self._too_large()
            return message

        return receive_limited

    def _too_large(self) -> ApiError:
        return ApiError(413, f"the request body is larger than {self.max_body} bytes (--max-body-mib)")


# RFC 9110 Host = uri-host [":" port], with a registered name of the letters, digits and "-._" that names use
_HOST = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+)(:[0-9]{0,5})?")


def _host_name(host: str) -> str | None:
    """A Host header's name: no port, no IPv6 brackets, no trailing dot, lower case; None when the header is not
    a host[:port]."""
    match = _HOST.fullmatch(host)
    if match is None:
        return None
    name = match[1]
    if name.startswith("["):
        name = name[1:-1]
        return name.lower() if _is_ip(name) and ":" in name else None
    return name.rstrip(".").lower() or None


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
        return True  # no name, nothing to re-point
    except ValueError:
        return False
