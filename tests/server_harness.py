"""A real uvicorn server on a free loopback port, run in a thread around a tiny-model session, and the
single-request greedy outputs the server's answers are compared with."""

from __future__ import annotations

import socket
import threading
import time

from spec_cli.model.sampling import SamplingParams
from spec_cli.options import default
from spec_cli.runtime.engine import EngineOptions
from spec_cli.runtime.generate import generate
from spec_cli.runtime.session import open_session
from spec_cli.server import ServerSettings, create_app
from spec_cli.server.serve import GRACE_SECONDS, Server, uvicorn_config
from spec_cli.speculative.base import SpecParams

N_CTX_SLOT = 256
GREEDY = SamplingParams(temp=0.0)
# small n-gram sizes so the drafters fire on short tiny-model outputs (as tests/test_generate.py)
SMALL_NGRAM = dict(ngram_simple_size_n=2, ngram_simple_size_m=8, ngram_mod_n_match=3, ngram_mod_n_min=1,
                   ngram_mod_n_max=8)
# prompts of the tiny byte-level vocabulary; several repeat themselves so n-gram drafters find matches
PROMPTS = [
    "the cat sat on the mat. the cat sat on the mat. the cat",
    "def f(x): return x\ndef f(x): return x\ndef",
    "Hello world Hello world Hello world",
    "1 2 3 4 1 2 3 4 1 2 3",
    "abc abc abc abc abc",
    "The quick brown fox jumps",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "aaaa bbbb aaaa bbbb aaaa",
]


def make_session(model, n_seq: int = 1, spec_types: str = "", draft=None, n_ctx_slot: int = N_CTX_SLOT,
                 draft_max: int = 6, n_ubatch: int = default("ubatch_size"), **spec_changes):
    """`spec_changes`: SpecParams fields besides SMALL_NGRAM's."""
    spec = SpecParams(types=[t for t in spec_types.split(",") if t], draft_max=draft_max,
                      **{"draft_p_min": 0.0, **SMALL_NGRAM, **spec_changes})
    return open_session(EngineOptions(model=str(model), model_draft=str(draft) if draft else None,
                                      n_ctx=n_ctx_slot * n_seq, n_seq=n_seq, device="cpu", n_ubatch=n_ubatch,
                                      spec=spec))


def greedy_reference(model, prompts: list[str], n_predict: int) -> dict[str, list[int]]:
    """Each prompt generated alone on a fresh single-sequence session without speculation."""
    session = make_session(model)
    out = {}
    for text in prompts:
        session.reset()
        tokens = session.engine.tokenizer.encode(text, add_special=True, parse_special=True)
        got: list[int] = []
        generate(session.generator(), tokens, GREEDY, n_predict, on_emit=lambda e: got.extend(e.tokens))
        out[text] = got
    return out


class LiveServer:
    """`with LiveServer(session, settings) as srv:` serves create_app(session, settings) at srv.url; leaving the
    block shuts it down as SIGTERM would."""

    def __init__(self, session, settings: ServerSettings | None = None, grace: float = GRACE_SECONDS):
        self.session = session
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.app = create_app(session, settings)
        self.server = Server(uvicorn_config(self.app, lifespan="on"), grace)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)
        self.sock.close()


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {name or name{labels}: value}."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out
