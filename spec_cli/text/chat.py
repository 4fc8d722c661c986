"""Chat templates: render a model's Jinja chat template as HF transformers and llama.cpp's Jinja path do.

Same environment as transformers' `apply_chat_template` (sandboxed, trim_blocks + lstrip_blocks, loop controls,
`raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII text), plus a few builtin templates for models
whose GGUF carries none (`--chat-template chatml|gemma`).

A template is code and the server runs it on clients' messages, so a render is bounded: MAX_RENDER_SECONDS of
time (checked at every loop iteration, call, attribute or item access and intercepted operator) and
MAX_OUTPUT_CHARS of output and of any string or list it builds with `*`, `+`, `**`, `~`, a filter or a call.
Whatever a template raises (`1/0`, a bad operand, the bounds) is a SpecCliError, "chat template error: ...".
"""

from __future__ import annotations

import json
import math
import threading
import time
from datetime import datetime
from functools import lru_cache

import jinja2
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

from spec_cli.errors import SpecCliError

BUILTIN_TEMPLATES = {
    "chatml": (
        "{%- for message in messages -%}"
        "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
    ),
    # Gemma has no system role: a system message is prepended to the next user turn. No BOS here: the tokenizer
    # adds it (add_bos_token is true for Gemma).
    "gemma": (
        "{%- set ns = namespace(system='') -%}"
        "{%- for message in messages -%}"
        "{%- if message['role'] == 'system' -%}{%- set ns.system = message['content'] | trim + '\\n\\n' -%}"
        "{%- else -%}"
        "{{- '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\\n'"
        " + ns.system + message['content'] | trim + '<end_of_turn>\\n' -}}"
        "{%- set ns.system = '' -%}"
        "{%- endif -%}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}"
    ),
}


MAX_RENDER_SECONDS = 2.0  # real templates render in milliseconds, even for thousands of messages
MAX_OUTPUT_CHARS = 1 << 26  # far beyond any context window (a million tokens of 64 characters)


def resolve_template(name_or_source: str) -> str:
    """A builtin template's source by name, or the argument itself taken as Jinja source."""
    return BUILTIN_TEMPLATES.get(name_or_source, name_or_source)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    # jinja's own tojson escapes <, >, & and ' for HTML, which would change the prompt text
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Budget(threading.local):
    """The bounds of the render running on this thread (templates are compiled once and shared by threads)."""

    deadline = math.inf


_budget = _Budget()


def _tick() -> None:
    if time.monotonic() > _budget.deadline:
        raise SpecCliError(f"chat template error: rendering takes more than {MAX_RENDER_SECONDS:g} s")


def _sized(value):
    if isinstance(value, (str, list, tuple, dict)) and len(value) > MAX_OUTPUT_CHARS:
        raise SpecCliError(f"chat template error: a value longer than {MAX_OUTPUT_CHARS}")
    return value


def _bounded_iter(iterable):
    for item in iterable:
        _tick()
        yield item


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox with the bounds above hooked into its calls, attribute and item accesses and operators. `*`,
    `+` and `**` are checked before they compute (`'a' * 10**8` would build 100 MB in one step); intercepting
    them also stops jinja from computing them at compile time."""

    intercepted_binops = frozenset({"*", "+", "**"})

    def call_binop(self, context, operator, left, right):
        _tick()
        size = {"*": _product_size, "+": _sum_size, "**": _power_size}[operator](left, right)
        if size > MAX_OUTPUT_CHARS:
            raise SpecCliError(f"chat template error: {operator} would build a value longer than {MAX_OUTPUT_CHARS}")
        return super().call_binop(context, operator, left, right)

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja's own signature
        _tick()
        return _sized(super().call(__context, __obj, *args, **kwargs))

    def getattr(self, obj, attribute):
        _tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj, argument):
        _tick()
        return super().getitem(obj, argument)


def _product_size(left, right) -> int:
    if isinstance(left, int) and hasattr(right, "__len__"):
        left, right = right, left
    return len(left) * right if hasattr(left, "__len__") and isinstance(right, int) else 0


def _sum_size(left, right) -> int:
    return len(left) + len(right) if hasattr(left, "__len__") and hasattr(right, "__len__") else 0


def _power_size(base, exponent) -> int:
    """Decimal digits of an integer power, roughly (a huge one costs seconds to compute and print)."""
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0 and abs(base) > 1:
        return exponent * abs(base).bit_length() * 3 // 10
    return 0


class _Bounds(NodeTransformer):
    """Loops iterate through _bounded_iter and concatenations (`~`) and filter results go through _sized: the hooks
    jinja's sandbox has none for."""

    def visit_For(self, node: nodes.For) -> nodes.For:
        node = self.generic_visit(node)
        node.iter = _call("_bounded_iter", node.iter)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Call:
        return _call("_sized", self.generic_visit(node))

    def visit_Filter(self, node: nodes.Filter) -> nodes.Call:
        return _call("_sized", self.generic_visit(node))

    def visit_FilterBlock(self, node: nodes.FilterBlock) -> nodes.FilterBlock:
        block_filter = node.filter
        node = self.generic_visit(node)
        node.filter = block_filter  # the block applies it itself and needs the Filter node
        return node


def _call(function: str, arg: nodes.Expr) -> nodes.Call:
    return nodes.Call(nodes.Name(function, "load"), [arg], [], None, None, lineno=arg.lineno)


@lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    env = _BoundedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, _bounded_iter=_bounded_iter,
                       _sized=_sized)
    tree = env.parse(source)
    if tree.find((nodes.Extends, nodes.Include, nodes.Import, nodes.FromImport)):
        raise SpecCliError("chat template error: a chat template cannot extend, include or import other templates")
    return env.from_string(_Bounds().visit(tree))


def render_chat(template: str, messages: list[dict], add_generation_prompt: bool = True, bos_token: str = "",
                eos_token: str = "") -> str:
    _budget.deadline = time.monotonic() + MAX_RENDER_SECONDS
    try:
        out, n = [], 0
        for piece in _compile(template).generate(messages=messages, add_generation_prompt=add_generation_prompt,
                                                 bos_token=bos_token, eos_token=eos_token):
            n += len(piece)
            if n > MAX_OUTPUT_CHARS:
                raise SpecCliError(f"chat template error: the output passes {MAX_OUTPUT_CHARS} characters")
            out.append(piece)
        return "".join(out)
    except SpecCliError:
        raise
    except jinja2.TemplateError as e:
        raise SpecCliError(f"chat template error: {e}") from None
    except Exception as e:  # noqa: BLE001 - the template is code: whatever it raises (1/0, 'a' + 1) is its error
        raise SpecCliError(f"chat template error: {type(e).__name__}: {e}") from None
    finally:
        _budget.deadline = math.inf
