"""Prompt sets for speculative tests: built-in sets by task kind and user files (`--prompts FILE.jsonl`).

Speculation speeds up text that repeats its context (code edits, extraction) far more than free writing, so a
sweep must say what it ran on. Built-in sets live in `spec_cli/text/prompts/<name>.jsonl`, a few prompts each, written
for this project; placeholders `{{source:module.attr}}` and `{{doc:module.attr}}` are filled at run time with the
source or docstring of a Python standard-library object (via `inspect`), so nothing is downloaded and the files
stay small.

A line is `{"id": ..., "messages": [{"role": ..., "content": ...}, ...]}` (rendered with the model's chat
template) or `{"id": ..., "prompt": "raw text"}` (tokenized as is).
"""

from __future__ import annotations

import builtins
import importlib
import importlib.util
import inspect
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from spec_cli.errors import SpecCliError
from spec_cli.options import PROMPT_SETS

BUILTIN_DIR = Path(__file__).resolve().parent / "prompts"
PLACEHOLDER = re.compile(r"\{\{(source|doc):([\w.]+)\}\}")


@dataclass
class Prompt:
    id: str
    messages: list[dict] | None = None
    text: str | None = None


@dataclass
class PromptSet:
    name: str
    prompts: list[Prompt]


def load_prompt_set(name_or_path: str) -> PromptSet:
    """A built-in set by name (options.PROMPT_SETS), or a .jsonl file (its set name is the file's stem)."""
    path = BUILTIN_DIR / f"{name_or_path}.jsonl" if name_or_path in PROMPT_SETS else Path(name_or_path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise SpecCliError(f"cannot read prompt file {path}: {e}") from None
    prompts = [_parse_line(line, path, i + 1) for i, line in enumerate(lines) if line.strip()]
    if not prompts:
        raise SpecCliError(f"{path}: no prompts")
    return PromptSet(path.stem, prompts)


def render_tokens(prompt: Prompt, tokenizer) -> list[int]:
    """Token ids of a prompt: messages through the chat template (a plain `role: content` layout when the model
    has none, e.g. a base model), raw text as it is."""
    if prompt.text is not None:
        return tokenizer.encode(prompt.text, add_special=True, parse_special=False)
    if tokenizer.chat_template:
        text = tokenizer.apply_chat_template(prompt.messages, True)
        return tokenizer.encode(text, add_special=True, parse_special=True)
    text = "".join(f"{m['role']}: {m['content']}\n\n" for m in prompt.messages) + "assistant:"
    return tokenizer.encode(text, add_special=True, parse_special=False)


def _parse_line(line: str, path: Path, lineno: int) -> Prompt:
    where = f"{path}:{lineno}"
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise SpecCliError(f"{where}: invalid JSON ({e.msg})") from None
    if not isinstance(obj, dict) or ("messages" in obj) == ("prompt" in obj):
        raise SpecCliError(f"{where}: expected an object with either 'messages' or 'prompt'")
    pid = str(obj.get("id", lineno))
    if "prompt" in obj:
        if not isinstance(obj["prompt"], str) or not obj["prompt"]:
            raise SpecCliError(f"{where}: 'prompt' must be a non-empty string")
        return Prompt(pid, text=expand(obj["prompt"]))
    messages = obj["messages"]
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise SpecCliError(f"{where}: 'messages' must be a list of {{role, content}} strings")
    return Prompt(pid, messages=[{"role": m["role"], "content": expand(m["content"])} for m in messages])


def expand(text: str) -> str:
    """Fill `{{source:mod.attr}}` / `{{doc:mod.attr}}` from the running Python's standard library."""

    def fill(m: re.Match) -> str:
        obj = _lookup(m.group(2))
        try:
            return (inspect.getsource(obj) if m.group(1) == "source" else inspect.getdoc(obj) or "").rstrip()
        except (OSError, TypeError) as e:
            raise SpecCliError(f"cannot read the {m.group(1)} of {m.group(2)}: {e}") from None

    return PLACEHOLDER.sub(fill, text)


def _lookup(dotted: str):
    parts = dotted.split(".")
    if parts[0] not in sys.stdlib_module_names and not hasattr(builtins, parts[0]):
        raise SpecCliError(f"'{dotted}' is not in the standard library (placeholders read stdlib objects only)")
    obj, rest = builtins, parts
    for i in range(len(parts), 0, -1):  # the longest importable module prefix, then attributes
        try:
            obj, rest = importlib.import_module(".".join(parts[:i])), parts[i:]
            break
        except ImportError:
            continue
    try:
        for attr in rest:
            obj = getattr(obj, attr)
    except AttributeError:
        raise SpecCliError(f"no object '{dotted}' in this Python's standard library") from None
    return obj


def quoted_stdlib_files() -> set[Path]:
    """Standard-library files quoted by the built-in prompt sets ({{source:...}} / {{doc:...}}): never trained on,
    so acceptance measured on those sets is measured on unseen text."""
    files = set()
    for path in sorted(BUILTIN_DIR.glob("*.jsonl")):
        for _, dotted in PLACEHOLDER.findall(path.read_text(encoding="utf-8")):
            parts = dotted.split(".")
            for i in range(len(parts), 0, -1):  # the longest module prefix defines the file
                try:
                    spec = importlib.util.find_spec(".".join(parts[:i]))
                except (ImportError, ValueError):
                    continue
                if spec is not None and spec.origin and spec.origin.endswith(".py"):
                    files.add(Path(spec.origin).resolve())
                    break
    return files
