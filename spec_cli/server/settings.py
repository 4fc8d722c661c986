"""What `spec-cli server` serves with besides the engine: the flags the routes, the request guard and the HTTP
protocol read."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from spec_cli.errors import UsageError
from spec_cli.model.sampling import SamplingParams
from spec_cli.options import default


@dataclass
class ServerSettings:
    alias: str | None = None  # model id in responses (default: the GGUF file name)
    api_key: str | None = None
    metrics: bool = False
    slots: bool = False  # /slots shows every slot's prompt and output: off unless asked for (--slots)
    n_predict: int = default("n_predict")  # when a request sets no limit
    sampling: SamplingParams = field(default_factory=SamplingParams)  # defaults for request sampling fields
    chat_template: str | None = None  # override of the GGUF's template (jinja source or a builtin name)
    allowed_hosts: list[str] = field(default_factory=list)  # Host names besides IP addresses and localhost
    max_body: int | None = None  # bytes a request body may have (None = no limit)
    read_timeout: float | None = None  # seconds a request's headers and body may take to arrive (None = no limit)

    def __post_init__(self):
        if self.api_key is not None:
            check_api_key(self.api_key)
        if self.max_body is not None and self.max_body < 1:
            raise UsageError("--max-body-mib must be at least 1")
        if self.read_timeout is not None and not 0 < self.read_timeout < math.inf:
            raise UsageError("--read-timeout must be a number of seconds above 0")


def check_api_key(key: str) -> None:
    """A key a client can send as it is: an HTTP header value loses the whitespace around it (so such a key would
    match no request), and a control character cannot be sent at all."""
    if not key.strip():
        raise UsageError("--api-key is empty (or only whitespace): give a key, or leave the flag out to serve "
                         "without one")
    if key != key.strip():
        raise UsageError(f"--api-key {key!r} starts or ends with whitespace, which no client can send in a header")
    if not key.isprintable():
        raise UsageError(f"--api-key {key!r} holds a non-printable character")
