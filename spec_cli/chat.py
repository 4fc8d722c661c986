"""Chat templates: render a model's Jinja chat template as HF transformers and llama.cpp's Jinja path do.

Same environment as transformers' `apply_chat_template` (sandboxed, trim_blocks + lstrip_blocks, loop controls,
`raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII text), plus a few builtin templates for models
whose GGUF carries none (`--chat-template chatml|gemma`).
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

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


@lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
    return env.from_string(source)


def render_chat(template: str, messages: list[dict], add_generation_prompt: bool = True, bos_token: str = "",
                eos_token: str = "") -> str:
    try:
        return _compile(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=bos_token, eos_token=eos_token)
    except jinja2.TemplateError as e:
        raise SpecCliError(f"chat template error: {e}") from None
