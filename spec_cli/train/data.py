"""Training data of `spec-cli mtp-train` (mtp_train.py), read at run time, nothing downloaded: the Python standard
library's sources and its docs (pydoc_data.topics), cut into token windows, and the target's own greedy answers to
requests about snippets of it. Files are split by a hash of their name: held-out files are never trained on, and
the acceptance estimate is measured on them; the standard-library files the built-in prompt sets quote are left
out.
"""

from __future__ import annotations

import random
import sysconfig
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from spec_cli.errors import SpecCliError
from spec_cli.model.context import Context
from spec_cli.model.loader import LoadedModel
from spec_cli.model.sampling import SamplingParams
from spec_cli.runtime.generate import Generator
from spec_cli.text.prompt_sets import quoted_stdlib_files
from spec_cli.text.tokenizer import Tokenizer

HELD_OUT_MOD = 10  # one file in ten (by name hash) is held out
# requests the target answers about training snippets (its own generations in chat form); written for this tool
GEN_REQUESTS = (
    "Explain what this does, step by step.",
    "Rewrite this with clearer names and comments. Return the complete code.",
    "Write a short story in which a programmer runs into the problem this solves.",
    "Summarize this in a few sentences, then list its main points.",
    "Write unit tests for this.",
    "Write a friendly message to a teammate describing this change and asking for feedback.",
    "Point out possible bugs in this and return a corrected version.",
    "Write a blog post paragraph about the ideas behind this.",
    "Add type hints to this code. Return it complete, in one Python code block.",
    "Add docstrings and short comments where they help, change nothing else, and return the whole code.",
    "Make one small improvement to this code and return the complete result in a code block.",
    "Write a short poem inspired by what this code does.",
)


@dataclass
class Progress:
    """One progress report of a training run (every stage: data, features, the steps)."""

    stage: str  # "data" | "generate" | "features" | "train" | "eval"
    done: int
    total: int
    info: dict


ProgressFn = Callable[[Progress], None]


def stdlib_documents() -> list[tuple[str, str]]:
    """(name, text) of the standard library's .py sources (tests and prompt-set sources excluded) and of its
    pydoc topics, sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    excluded = quoted_stdlib_files()
    docs = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        parts = rel.split("/")[:-1]
        if parts and parts[0] == "site-packages" or {"test", "tests", "idle_test"} & set(parts):
            continue
        if path.resolve() in excluded:
            continue
        try:
            docs.append((rel, path.read_text(encoding="utf-8")))
        except (UnicodeDecodeError, OSError):
            continue
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distributions strip the docs
        topics = {}
    docs.extend((f"pydoc:{name}", text) for name, text in sorted(topics.items()))
    if not docs:
        raise SpecCliError(f"no standard-library sources found under {root}")
    return docs


def is_held_out(name: str) -> bool:
    return zlib.crc32(name.encode()) % HELD_OUT_MOD == 0


def token_windows(tokenizer: Tokenizer, docs: list[tuple[str, str]], seq_len: int, n_windows: int,
                  rng: random.Random) -> torch.Tensor:
    """[n_windows, seq_len] token windows cut from randomly ordered documents (each window within one document)."""
    order = list(range(len(docs)))
    rng.shuffle(order)
    windows: list[list[int]] = []
    for i in order:
        ids = tokenizer.encode(docs[i][1], add_special=False)
        for start in range(0, len(ids) - seq_len + 1, seq_len):
            windows.append(ids[start : start + seq_len])
        if len(windows) >= 4 * n_windows:  # enough to sample from without reading the whole library
            break
    if len(windows) < n_windows:
        raise SpecCliError(f"only {len(windows)} windows of {seq_len} tokens in the corpus, {n_windows} needed")
    rng.shuffle(windows)
    return torch.tensor(windows[:n_windows], dtype=torch.long)


def generation_prompts(tokenizer: Tokenizer, snippets: torch.Tensor, length: int) -> torch.Tensor:
    """[N, length] prompts for the target's own generations. With a chat template: a request about a snippet
    (rotating through GEN_REQUESTS), rendered as the model's chat, the snippet cut to fit; without: the snippet's
    first `length` tokens to continue."""
    if not tokenizer.chat_template:
        return snippets[:, :length]
    mark = "\x00SNIPPET\x00"
    prompts = []
    for i, snippet in enumerate(snippets.tolist()):
        content = GEN_REQUESTS[i % len(GEN_REQUESTS)] + "\n\n" + mark
        text = tokenizer.apply_chat_template([{"role": "user", "content": content}], True)
        before, after = text.split(mark)
        head = tokenizer.encode(before, add_special=True, parse_special=True)
        tail = tokenizer.encode(after, add_special=False, parse_special=True)
        n_snippet = length - len(head) - len(tail)
        if n_snippet < length // 4:  # a long chat preamble would leave nothing to talk about
            return snippets[:, :length]
        prompts.append(head + snippet[:n_snippet] + tail)
    return torch.tensor(prompts, dtype=torch.long)


def greedy_continuations(loaded: LoadedModel, prompts: torch.Tensor, n_new: int, progress: ProgressFn | None = None,
                         n_par: int = 32) -> torch.Tensor:
    """prompts [N, P] -> [N, P + n_new]: the target's own greedy continuations through the shared Generator, n_par
    sequences per step. No token counts as end-of-generation, so every continuation is n_new tokens long."""
    out = []
    N, P = prompts.shape
    greedy = SamplingParams(temp=0.0)
    for b0 in range(0, N, n_par):
        chunk = prompts[b0 : b0 + n_par].tolist()
        ctx = Context(loaded, n_ctx=len(chunk) * (P + n_new), n_seq=len(chunk), n_batch=len(chunk) * P)
        gen = Generator(ctx, eog_ids=set())
        for s, ids in enumerate(chunk):
            ids += gen.start(s, ids, greedy, n_predict=n_new).tokens
        for i in range(n_new):
            if i:
                for e in gen.step():
                    chunk[e.seq] += e.tokens
            if progress:
                progress(Progress("generate", b0 * n_new + (i + 1) * len(chunk), N * n_new, {}))
        out.extend(chunk)
    return torch.tensor(out, dtype=torch.long)
