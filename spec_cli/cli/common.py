"""Pieces the generating commands share: reading and tokenizing the prompt, streaming text, one result object."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from spec_cli.errors import SpecCliError, UsageError
from spec_cli.model.sampling import SamplingParams
from spec_cli.runtime.engine import Engine
from spec_cli.runtime.generate import Emitted, Sequence, generate
from spec_cli.runtime.memory import measured
from spec_cli.runtime.session import Session


def read_prompt(opts: dict, required: bool = True) -> str | None:
    if opts["prompt"] is not None and opts["file"] is not None:
        raise UsageError("give the prompt with -p or -f, not both")
    if opts["file"] is not None:
        try:
            return Path(opts["file"]).read_text(encoding="utf-8")
        except OSError as e:
            raise SpecCliError(f"cannot read prompt file {opts['file']}: {e.strerror}") from None
        except UnicodeDecodeError:
            raise SpecCliError(f"prompt file {opts['file']} is not UTF-8 text") from None
    if opts["prompt"] is None and required:
        raise UsageError("no prompt: pass -p TEXT or -f FILE")
    return opts["prompt"]


def prompt_tokens(engine: Engine, text: str, chat: bool, template: str | None) -> list[int]:
    """As llama-cli: BOS per the model's metadata, special tokens in the text recognized; in chat mode the
    text is the first user message rendered with the chat template."""
    tok = engine.tokenizer
    if chat:
        text = tok.apply_chat_template([{"role": "user", "content": text}], True, template)
    return tok.encode(text, add_special=True, parse_special=True)


class TextStream:
    """Writes committed tokens to stdout as complete UTF-8 text; accepted draft tokens optionally coloured."""

    GREEN, RESET = "\x1b[32m", "\x1b[0m"

    def __init__(self, engine: Engine, color: bool = False, out=None):
        self.decoder = engine.tokenizer.stream()
        self.color = color
        self.out = out or sys.stdout
        self.text: list[str] = []

    def echo(self, prompt: str) -> None:
        """llama-cli prints the raw prompt before the continuation."""
        self.out.write(prompt)
        self.out.flush()

    def __call__(self, e: Emitted) -> None:
        for tok, from_draft in zip(e.tokens, e.from_draft):
            piece = self.decoder.push(tok)
            self.text.append(piece)
            if piece:
                self.out.write(f"{self.GREEN}{piece}{self.RESET}" if self.color and from_draft else piece)
        self.out.flush()

    def close(self) -> str:
        tail = self.decoder.flush()
        if tail:
            self.text.append(tail)
            self.out.write(tail)
        self.out.flush()
        return "".join(self.text)


class TextCollector(TextStream):
    """Same as TextStream but keeps the text instead of printing it (--json)."""

    def __init__(self, engine: Engine):
        super().__init__(engine, out=_Null())


class _Null:
    def write(self, _):
        pass

    def flush(self):
        pass


@dataclass
class RunResult:
    text: str
    sequence: Sequence
    load_ms: float
    t_prompt_ms: float
    t_gen_ms: float
    n_prompt: int
    n_gen: int
    timings: dict = field(default_factory=dict)

    def to_dict(self, session: Session) -> dict:
        s, engine = self.sequence, session.engine
        out = {
            "content": self.text,
            "finish_reason": s.finish_reason,
            "model": str(engine.target.gguf.path),
            "load_ms": round(self.load_ms, 3),
            "prompt_n": self.n_prompt,
            "prompt_ms": round(self.t_prompt_ms, 3),
            "prompt_per_second": _rate(self.n_prompt, self.t_prompt_ms),
            "predicted_n": self.n_gen,
            "predicted_ms": round(self.t_gen_ms, 3),
            "predicted_per_second": _rate(self.n_gen, self.t_gen_ms),
            "memory": measured(engine, session.drafters),
        }
        if session.chain is not None:
            out.update(
                n_draft=session.n_draft,
                n_drafted=s.n_drafted,
                n_accept=s.n_accepted,
                accept=100.0 * s.n_accepted / s.n_drafted if s.n_drafted else 0.0,
                n_steps=s.n_steps,
                mean_acc_len=(s.n_steps + s.n_accepted) / s.n_steps if s.n_steps else 0.0,
                drafters=[st.to_dict() for st in session.stats.values()],
                time_split_ms={k: round(v, 3) for k, v in self.timings.items()},
            )
        if engine.draft_bridge is not None:  # a draft model with another vocabulary (vocab_bridge.py)
            out["draft_vocabulary"] = engine.draft_bridge.figures()
        return out


def _rate(n: int, ms: float) -> float:
    return round(n / ms * 1000.0, 3) if ms > 0 else 0.0


def run_once(session: Session, tokens: list[int], sampling: SamplingParams, n_predict: int, sink) -> RunResult:
    """Prefill + generate one sequence; timings as llama.cpp's: prompt eval, then generation after the first token."""
    gen, engine = session.generator(), session.engine
    t0 = time.perf_counter()
    seq = generate(gen, tokens, sampling, n_predict, on_emit=sink)
    total_ms = (time.perf_counter() - t0) * 1000
    text = sink.close()
    tm = gen.timings
    return RunResult(
        text=text, sequence=seq, load_ms=engine.target.load_ms + (engine.draft.load_ms if engine.draft else 0.0),
        t_prompt_ms=tm.t_prompt_ms, t_gen_ms=total_ms - tm.t_prompt_ms - tm.t_calibrate_ms - tm.t_compile_ms,
        n_prompt=tm.n_prompt, n_gen=seq.n_generated,
        timings={"draft": tm.t_draft_ms, "verify": tm.t_verify_ms, "accept": tm.t_accept_ms},
    )


def run_prompt(session: Session, text: str, sampling: SamplingParams, opts: dict, color: bool = False) -> RunResult:
    """One prompt of a command's flags (-p/-f, -cnv, --chat-template, -n, --json) through `run_once`: the text
    streams to stdout as it comes (echoing a raw prompt first) or is collected for --json."""
    engine = session.engine
    tokens = prompt_tokens(engine, text, opts["conversation"], opts["chat_template"])
    sink = TextCollector(engine) if opts["json_output"] else TextStream(engine, color=color)
    if not opts["conversation"]:
        sink.echo(text)
    return run_once(session, tokens, sampling, opts["n_predict"], sink)
