"""One client connection: uvicorn's HTTP/1.1 protocol (h11) with a deadline on receiving each request and JSON
errors where uvicorn's own are plain text.

- Deadline (--read-timeout): a request must arrive whole, headers and body, within `read_timeout` seconds of its
  first byte, and a new connection must send its first request within that time. uvicorn has no such bound, so a
  client that connects and sends nothing, half a request or one byte a minute holds its socket for as long as it
  likes. Here a partial request gets a 408 and its connection is closed (a route still reading that body sees a
  client that went away); a connection that sent nothing is closed.
- A client that closes the connection in the middle of a request is one log line, not a traceback.
- A request h11 cannot parse (a malformed request line or header, two Content-Length headers, an HTTP/1.1
  request without Host) is a JSON 400 in OpenAI's shape, as every other error of the server.
"""

from __future__ import annotations

import asyncio
import http
import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from spec_cli.server.protocol import error_body


class Connection(H11Protocol):
    def __init__(self, *args, read_timeout: float | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.read_timeout = read_timeout
        self.read_timer: asyncio.TimerHandle | None = None
        self.timed_out = False

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)
        self._start_timer()  # for the first request, the deadline counts from here

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch_request()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # the next request's bytes, already here, may be parsed now
        self._watch_request()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.timed_out and (self.conn.their_state is h11.SEND_BODY or self._partial_head()):
            self.logger.warning("%s closed the connection before its whole request had arrived", self._client())
        self._stop_timer()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:  # uvicorn's msg says no more than "Invalid HTTP request"
        self._send_error(400, "invalid HTTP request: its request line or headers could not be parsed")

    # --- the read deadline -------------------------------------------------------------------------------------

    def _watch_request(self) -> None:
        """Runs the deadline while part of a request has arrived and the rest has not."""
        if self.conn.their_state is h11.SEND_BODY or self._partial_head():
            if self.read_timer is None:
                self._start_timer()
        else:
            self._stop_timer()  # received whole; between requests uvicorn's keep-alive timeout closes an idle one

    def _partial_head(self) -> bool:
        return self.conn.their_state is h11.IDLE and bool(self.conn.trailing_data[0])

    def _timed_out(self) -> None:
        self.read_timer = None
        if self.transport.is_closing():
            return
        self.timed_out = True
        if self.conn.their_state is h11.IDLE and not self._partial_head():
            self.transport.close()  # a connection that never sent a request: nobody to answer
            return
        self.logger.warning("%s did not send its whole request within %g s (--read-timeout): 408, connection "
                            "closed", self._client(), self.read_timeout)
        cycle = self.cycle if self.conn.their_state is h11.SEND_BODY else None  # None: the head is incomplete
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True  # the route reading the body gets http.disconnect; what it sends is dropped
            cycle.message_event.set()
        if cycle is None or not cycle.response_started:
            self._send_error(408, f"the request did not arrive whole within {self.read_timeout:g} s (--read-timeout)")
        else:
            self.transport.close()

    def _start_timer(self) -> None:
        if self.read_timeout is not None:
            self.read_timer = self.loop.call_later(self.read_timeout, self._timed_out)

    def _stop_timer(self) -> None:
        if self.read_timer is not None:
            self.read_timer.cancel()
            self.read_timer = None

    # --- helpers -------------------------------------------------------------------------------------------------

    def _send_error(self, status: int, message: str) -> None:
        """A JSON error written past h11 (whose state may not allow a response here), then the connection closed."""
        body = json.dumps(error_body(status, message, "invalid_request_error")).encode()
        head = (f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
        self.transport.write(head.encode() + body)
        self.transport.close()

    def _client(self) -> str:
        return "%s:%d" % self.client if self.client else "a client"
