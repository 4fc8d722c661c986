"""Chat templates: the sandboxed Jinja renderer, the builtin templates, and Tokenizer.apply_chat_template."""

from __future__ import annotations

import time
from datetime import datetime

import pytest

from spec_cli.errors import SpecCliError
from spec_cli.text import chat
from spec_cli.text.chat import BUILTIN_TEMPLATES, render_chat, resolve_template
from spec_cli.text.tokenizer import Tokenizer
from tests.tiny_vocab import tiny_bpe_metadata

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Bye"},
]


def _tiny(**changes) -> Tokenizer:
    meta = tiny_bpe_metadata()
    for key, value in changes.items():
        if value is None:
            meta.pop(key, None)
        else:
            meta[key] = value
    return Tokenizer.from_metadata(meta)


def test_chatml_builtin():
    turns = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in CHAT)
    assert render_chat(BUILTIN_TEMPLATES["chatml"], CHAT) == turns + "<|im_start|>assistant\n"
    assert render_chat(BUILTIN_TEMPLATES["chatml"], CHAT, add_generation_prompt=False) == turns


def test_gemma_builtin_folds_system_into_first_user_turn():
    text = render_chat(BUILTIN_TEMPLATES["gemma"], CHAT)
    assert text == ("<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
                    "<start_of_turn>model\nHello!<end_of_turn>\n"
                    "<start_of_turn>user\nBye<end_of_turn>\n"
                    "<start_of_turn>model\n")
    assert "system" not in text


def test_resolve_template():
    assert resolve_template("chatml") == BUILTIN_TEMPLATES["chatml"]
    assert resolve_template("{{ messages[0]['content'] }}") == "{{ messages[0]['content'] }}"


def test_trim_and_lstrip_blocks():
    template = ("{% for m in messages %}\n    {% if m.role == 'user' %}\n[{{ m.content }}]\n"
                "    {% endif %}\n{% endfor %}")
    assert render_chat(template, CHAT) == "[Hi]\n[Bye]\n"


def test_helpers_and_filters():
    msgs = [{"role": "user", "content": "<é & 'x'>"}]
    assert render_chat("{{ messages[0].content | tojson }}", msgs) == "\"<é & 'x'>\""  # no HTML escaping
    assert render_chat("{{ {'b': 1, 'a': 2} | tojson(sort_keys=True) }}", msgs) == '{"a": 2, "b": 1}'
    assert render_chat("{{ strftime_now('%Y') }}", msgs) in {str(datetime.now().year), str(datetime.now().year + 1)}
    assert render_chat("{% for m in messages %}{{ m.role }}{% break %}{% endfor %}", CHAT) == "system"
    assert render_chat("{{ bos_token }}|{{ eos_token }}", msgs, bos_token="<s>", eos_token="</s>") == "<s>|</s>"


@pytest.mark.parametrize("template, message", [
    ("{{ raise_exception('roles must alternate') }}", "roles must alternate"),
    ("{% for %}", "chat template error"),                                            # syntax error
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "chat template error"),      # sandbox: no escapes
    ("{% set _ = messages.append(1) %}", "chat template error"),                     # immutable inputs
    ("{{ messages[5].content }}", "chat template error"),                            # undefined
    ("{{ 1/0 }}", "ZeroDivisionError: division by zero"),                            # any exception it raises
    ("{{ 'a' + 1 }}", "TypeError"),
    ("{{ range(10**9)|list }}", "OverflowError: Range too big"),
    ("{% include 'x.jinja' %}", "cannot extend, include or import"),                 # no other templates
    ("{% from 'x.jinja' import y %}", "cannot extend, include or import"),
    ("{{ 'a' * 10**8 }}", "would build a value longer than"),                        # checked before computing
    ("{{ 10 ** 1000000000 }}", "would build a value longer than"),
    ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "RecursionError"),
])
def test_template_errors_become_speccli_errors(template, message):
    with pytest.raises(SpecCliError, match=message):
        render_chat(template, CHAT[:1])


def test_render_is_bounded_in_time_and_size(monkeypatch):
    monkeypatch.setattr(chat, "MAX_RENDER_SECONDS", 0.1)
    monkeypatch.setattr(chat, "MAX_OUTPUT_CHARS", 1000)
    for template in [
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",  # empty loops
        "{% set s = 'x' * 500 %}{% for a in s %}{% for b in s %}{% for c in s %}{% endfor %}{% endfor %}{% endfor %}",
        "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(40) }}",
    ]:
        t0 = time.monotonic()
        with pytest.raises(SpecCliError, match="rendering takes more than 0.1 s"):
            render_chat(template, CHAT)
        assert time.monotonic() - t0 < 1
    for template in [
        "{% for i in range(2000) %}x{% endfor %}",  # the output
        "{{ 'ab' * 600 }}", "{{ 'a' * 600 + 'b' * 600 }}", "{{ 10 ** 5000 }}",  # operators, before they compute
        # what a template builds step by step: concatenation, filters, calls
        "{% set ns = namespace(s='ab') %}{% for i in range(20) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
        "{% set ns = namespace(s='ab') %}{% for i in range(20) %}{% set ns.s = ns.s|replace('a', 'aa') %}{% endfor %}",
        "{% set ns = namespace(s='ab') %}{% for i in range(20) %}{% set ns.s = ns.s.replace('b', 'bb') %}{% endfor %}",
    ]:
        with pytest.raises(SpecCliError, match="longer than 1000|passes 1000 characters"):
            render_chat(template, CHAT)
    assert render_chat("{% for i in range(1000) %}x{% endfor %}", CHAT) == "x" * 1000


def test_bounds_keep_jinja_semantics():
    template = ("{% for m in messages if m.role != 'system' %}{{ loop.index }}/{{ loop.length }}:{{ m.role }}"
                "{{ '.' if loop.last else ',' }}{% else %}none{% endfor %}"
                "{% for x in [[1, [2]], [3]] recursive %}{{ x if x is number else loop(x) }}{% endfor %}"
                "{% filter upper %}{{ messages[0].content ~ '!' }}{% endfilter %}{{ [3, 1, 2]|sort|join }}{{ 2 ** 10 }}")
    assert render_chat(template, CHAT) == "1/3:user,2/3:assistant,3/3:user.123BE BRIEF.!1231024"
    assert render_chat("{% for m in [] %}{% else %}none{% endfor %}", CHAT) == "none"


def test_tokenizer_applies_model_template_or_override():
    tok = _tiny()
    user = [{"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(user) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.apply_chat_template(user, template_override="gemma").startswith("<start_of_turn>user\nHi")
    assert tok.apply_chat_template(user, template_override="{{ 'raw:' + messages[0].content }}") == "raw:Hi"
    ids = tok.encode(tok.apply_chat_template(user), parse_special=True)
    assert ids.count(next(i for i in range(tok.n_vocab) if tok.token_text(i) == "<|im_start|>")) == 2


def test_tokenizer_without_template():
    tok = _tiny(**{"tokenizer.chat_template": None})
    assert tok.chat_template is None
    with pytest.raises(SpecCliError, match="no chat template; pass --chat-template"):
        tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert tok.apply_chat_template([{"role": "user", "content": "Hi"}], template_override="chatml").endswith(
        "<|im_start|>assistant\n")


@pytest.mark.parametrize("add_bos", [True, False])
def test_template_bos_dropped_only_when_tokenizer_adds_it(add_bos):
    template = "{{ bos_token }}{{ messages[0].content }}{{ eos_token }}"
    tok = _tiny(**{"tokenizer.chat_template": template, "tokenizer.ggml.add_bos_token": add_bos})
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    bos = tok.token_text(tok.bos_id)
    assert text == ("" if add_bos else bos) + "Hi" + tok.token_text(tok.eos_id)
    assert tok.encode(text, parse_special=True).count(tok.bos_id) == 1  # one BOS either way
