"""Chat templates: the sandboxed Jinja renderer, the builtin templates, and Tokenizer.apply_chat_template."""

from __future__ import annotations

from datetime import datetime

import pytest

from spec_cli.chat import BUILTIN_TEMPLATES, render_chat, resolve_template
from spec_cli.errors import SpecCliError
from spec_cli.tokenizer import Tokenizer
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
])
def test_template_errors_become_speccli_errors(template, message):
    with pytest.raises(SpecCliError, match=message):
        render_chat(template, CHAT[:1])


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
