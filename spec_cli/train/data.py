"""Training data of `spec-cli draft-train` (cli/draft_train.py), read at run time, nothing downloaded: the Python
standard library's sources and its docs (pydoc_data.topics), cut into token windows, and the target's own greedy
answers to requests. Files are split by a hash of their name: held-out files are never trained on, and the acceptance
estimate is measured on them; the standard-library files the built-in prompt sets quote are left out.
"""

from __future__ import annotations

import functools
import hashlib
import random
import sysconfig
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from itertools import chain
from pathlib import Path

import torch

from spec_cli.errors import SpecCliError
from spec_cli.model.batch import Batch
from spec_cli.model.context import Context
from spec_cli.model.loader import LoadedModel
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


def stdlib_root() -> Path:
    """The standard library's directory, links resolved."""
    return Path(sysconfig.get_paths()["stdlib"]).resolve()


@functools.cache
def stdlib_documents() -> tuple[tuple[str, str], ...]:
    """(name, text) of the standard library's .py sources (tests and prompt-set sources excluded) and of its
    pydoc topics, sorted (read once per process)."""
    root = stdlib_root()
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
    return tuple(docs)


def sources_fingerprint(texts: Iterable[str]) -> str:
    """A digest of what a run's data is made from (the standard library's documents, then `texts`: its requests),
    part of its features cache's key: a run resumed after either changed (another release, another Python) builds
    its data again."""
    digest = hashlib.sha256()
    for text in chain((text for doc in stdlib_documents() for text in doc), texts):
        digest.update(text.encode())
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def is_held_out(name: str) -> bool:
    return zlib.crc32(name.encode()) % HELD_OUT_MOD == 0


def token_windows(tokenizer: Tokenizer, docs: list[tuple[str, str]], seq_len: int, n_windows: int,
                  rng: random.Random) -> torch.Tensor:
    """[n_windows, seq_len] token windows, each within one document, spread over as many documents as there are
    windows: one window per document in a random order, another pass over them where that is not enough. (Taken
    whole, a few long files made a sample: held-out estimates of 16 windows read three codec tables.)"""
    order = list(range(len(docs)))
    rng.shuffle(order)
    left: list[list[list[int]]] = []  # per document read: its windows not taken yet, in a random order
    windows: list[list[int]] = []
    for i in order:
        ids = tokenizer.encode(docs[i][1], add_special=False)
        cuts = [ids[start : start + seq_len] for start in range(0, len(ids) - seq_len + 1, seq_len)]
        if cuts:
            rng.shuffle(cuts)
            windows.append(cuts.pop())
            left.append(cuts)
        if len(windows) == n_windows:
            break
    while len(windows) < n_windows and any(left):
        for cuts in left:
            if cuts and len(windows) < n_windows:
                windows.append(cuts.pop())
    if len(windows) < n_windows:
        raise SpecCliError(f"only {len(windows)} windows of {seq_len} tokens in the corpus, {n_windows} needed")
    rng.shuffle(windows)
    return torch.tensor(windows, dtype=torch.long)


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
    """prompts [N, P] -> [N, P + n_new]: the target's own greedy continuations, n_par sequences per step. No token
    counts as end-of-generation, so every continuation is n_new long."""
    return greedy_answers(loaded, prompts.tolist(), prompts.shape[1] + n_new, progress=progress, n_par=n_par).tokens


@dataclass
class Answers:
    """Windows of a prompt and the target's greedy answer (CPU tensors)."""

    tokens: torch.Tensor  # [N, T] int64
    features: torch.Tensor | None  # [N, T, len(taps), D] the tapped layers' inputs at every position (taps given)
    answered: torch.Tensor  # [N, T] bool: the target chose the next token (answer positions, up to its end of text)


def greedy_answers(loaded: LoadedModel, prompts: list[list[int]], length: int, taps: tuple[int, ...] = (),
                   eog: frozenset[int] = frozenset(), progress: ProgressFn | None = None, n_par: int = 32,
                   store: torch.dtype | None = None) -> Answers:
    """Each prompt (shorter than `length`) followed by the target's greedy answer up to `length` tokens, n_par
    sequences per decode; with `taps` the target features of every position are kept too (from the very decodes
    that generate: the last token is decoded for its features). Tokens after an end-of-generation token in `eog`
    are the target's continuation all the same, but not `answered`."""
    N = len(prompts)
    tokens = torch.zeros(N, length, dtype=torch.long)
    answered = torch.zeros(N, length, dtype=torch.bool)
    features = None
    for g0 in range(0, N, n_par):
        group = [list(p) for p in prompts[g0 : g0 + n_par]]
        if min(map(len, group)) < 1 or max(map(len, group)) >= length:
            raise SpecCliError(f"generation prompts must hold 1 to {length - 1} tokens")
        ctx = Context(loaded, n_ctx=len(group) * (length + 1), n_seq=len(group), n_batch=len(group) * length)
        ctx.set_taps(taps)
        rows = _generate_group(ctx, group, length, taps, progress, (g0 * length, N * length))
        if taps:
            if features is None:
                features = torch.zeros(N, length, len(taps), loaded.config.n_embd, dtype=store or rows.dtype)
            features[g0 : g0 + len(group)] = rows
        for i, seq in enumerate(group):
            tokens[g0 + i] = torch.tensor(seq)
            n_prompt = len(prompts[g0 + i])
            ends = [p for p in range(n_prompt, length) if seq[p] in eog]
            answered[g0 + i, n_prompt - 1 : (ends[0] if ends else length - 1)] = True
    return Answers(tokens, features, answered)


def _generate_group(ctx: Context, seqs: list[list[int]], length: int, taps: tuple[int, ...],
                    progress: ProgressFn | None, done_total: tuple[int, int]) -> torch.Tensor | None:
    """Extend every sequence in place to `length` tokens by greedy decoding on ctx (one sequence per cache
    sequence, ctx tapping `taps`); -> the features of `taps` at every position [n, length, len(taps), D] (the last
    token decoded for its features), None without taps."""
    decode_last = bool(taps)
    feats = [[None] * length for _ in seqs] if taps else None
    batch = Batch()
    for s, seq in enumerate(seqs):
        for p, tok in enumerate(seq):
            batch.add(tok, p, s, p == len(seq) - 1)
    while len(batch):
        out = ctx.decode(batch)
        flagged = [i for i, f in enumerate(batch.logits) if f]
        best = out.logits.argmax(-1).tolist()
        if feats is not None:
            tapped = ctx.features_of(taps)
            for i, (s, p) in enumerate(zip(batch.seq_ids, batch.pos)):
                feats[s][p] = tapped[i]
        step = Batch()
        for k, i in enumerate(flagged):
            s = batch.seq_ids[i]
            if len(seqs[s]) < length:
                seqs[s].append(best[k])
            if len(seqs[s]) < length or (decode_last and batch.pos[i] < length - 1):
                step.add(seqs[s][-1], batch.pos[i] + 1, s, len(seqs[s]) < length)
        batch = step
        if progress:
            progress(Progress("generate", done_total[0] + sum(map(len, seqs)), done_total[1], {}))
    return torch.stack([torch.stack(f) for f in feats]) if feats is not None else None


def cached(path: Path, key: dict, resume: bool, build: Callable[[], dict]) -> dict:
    """`build()`'s tensors, read back from `path` when resuming with the same data settings (`key`), else built and
    saved there (a run resumed with other settings builds its data again)."""
    saved = torch.load(path) if resume and path.exists() else None
    if saved is not None and saved["key"] == key:
        return saved["data"]
    data = build()
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"key": key, "data": data}, path)
    return data
