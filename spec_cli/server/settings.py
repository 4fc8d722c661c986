"""What `spec-cli server` serves with besides the engine: the flags the routes, the request guard and the HTTP
protocol read."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

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
    slot_save_path: Path | None = None  # the directory of slot files (None: no slot actions)
