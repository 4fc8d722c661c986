"""The generating commands end to end on the tiny model: flags in --help, streamed text, JSON and llama.cpp-style
statistics, chat mode, and speculation that does not change greedy output."""

from __future__ import annotations

import io
import json
import shutil
import sys

import pytest
import torch

from spec_cli.cli import main
from spec_cli.cli.run import chat_loop
from spec_cli.errors import UsageError
from spec_cli.model.sampling import SamplingParams
from spec_cli.options import NO_EFFECT, OPTIONS
from spec_cli.runtime.engine import EngineOptions
from spec_cli.runtime.session import open_session

PROMPT = "abc abc abc abc abc abc abc abc"


def cli(capsys, monkeypatch, *args: str) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "argv", ["spec-cli", *args])
    code = 0
    try:
        main()
    except SystemExit as e:
        code = e.code or 0
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("command, flags", [
    ("run", ["-m", "-p", "-f", "-n", "-c", "-b", "-ub", "-t", "-ngl", "-dev", "-s", "--temp", "--top-k", "--top-p",
             "--min-p", "--repeat-penalty", "--repeat-last-n", "--ignore-eos", "--dtype", "-cnv", "--spec-type", "-md"]),
    ("speculative-simple", ["-md", "-ngld", "-devd", "-cd", "-td", "--draft-max", "--spec-draft-n-max", "--draft-min",
                            "--draft-p-min", "--spec-verify", "--spec-ngram-mod-n-match", "-lcs", "-lcd", "--color",
                            "--log-format", "--json"]),
    # bench sweeps the drafter flags the other commands have; its --dtype help is theirs (q on the CPU)
    ("bench", ["-ngld", "-devd", "--spec-ngram-simple-size-n", "--spec-ngram-map-k4v-min-hits",
               "--spec-ngram-mod-n-match", "--dtype", "auto (q on the CPU, bf16 on CUDA)"]),
])
def test_help_lists_llamacpp_flags(capsys, monkeypatch, command, flags):
    monkeypatch.setenv("COLUMNS", "200")
    code, out, _ = cli(capsys, monkeypatch, command, "--help")
    assert code == 0
    for flag in flags:
        assert flag in out, flag


def test_run_streams_prompt_then_continuation_and_summary(capsys, monkeypatch, tiny_model_path):
    code, out, err = cli(capsys, monkeypatch, "run", "-m", str(tiny_model_path), "-p", PROMPT, "-n", "12", "--temp", "0")
    assert code == 0, err
    assert out.startswith(PROMPT) and len(out) > len(PROMPT)
    assert "prompt" in err and "generation" in err


def test_speculation_keeps_greedy_output_through_the_cli(capsys, monkeypatch, tiny_model_path, tiny_draft_path):
    base = ["-m", str(tiny_model_path), "-p", PROMPT, "-n", "24", "--temp", "0", "--json"]
    code, out, err = cli(capsys, monkeypatch, "run", *base)
    assert code == 0, err
    plain = json.loads(out)
    code, out, err = cli(capsys, monkeypatch, "speculative-simple", *base, "-md", str(tiny_draft_path),
                         "--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "2", "--draft-p-min", "0")
    assert code == 0, err
    spec = json.loads(out)
    assert spec["content"] == plain["content"]
    assert spec["predicted_n"] == plain["predicted_n"] == 24
    names = [d["name"] for d in spec["drafters"]]
    assert names == ["ngram-simple", "draft-simple"]  # llama.cpp's priority order, -md alone added draft-simple
    assert spec["n_accept"] <= spec["n_drafted"] and spec["n_drafted"] > 0
    assert sum(d["n_acc_tokens"] for d in spec["drafters"]) == spec["n_accept"]


def test_llamacpp_text_log(capsys, monkeypatch, tiny_model_path):
    code, out, err = cli(capsys, monkeypatch, "speculative-simple", "-m", str(tiny_model_path), "-p", PROMPT, "-n", "16",
                         "--temp", "0", "--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "2",
                         "--log-format", "text")
    assert code == 0, err
    for line in ("encoded", "decoded", "n_draft   = auto", "n_predict = 16", "n_drafted =", "n_accept  =", "accept    =",
                 "statistics     ngram-simple: #calls(b,g,a) ="):
        assert line in err, line


def test_chat_mode_applies_the_template(capsys, monkeypatch, tiny_model_path):
    code, out, err = cli(capsys, monkeypatch, "run", "-m", str(tiny_model_path), "-p", "hello", "-cnv", "-n", "4",
                         "--temp", "0", "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["prompt_n"] > len("hello")  # <|im_start|>user ... <|im_start|>assistant


def test_prompt_from_file(capsys, monkeypatch, tmp_path, tiny_model_path):
    prompt = tmp_path / "p.txt"
    prompt.write_text(PROMPT)
    code, out, err = cli(capsys, monkeypatch, "run", "-m", str(tiny_model_path), "-f", str(prompt), "-n", "3",
                         "--temp", "0", "--json")
    assert code == 0, err
    assert json.loads(out)["predicted_n"] == 3
    code, _, err = cli(capsys, monkeypatch, "run", "-m", str(tiny_model_path), "-f", str(prompt), "-p", "x")
    assert code == 2 and "not both" in err


@pytest.fixture
def tiny_registry(tmp_path, monkeypatch, tiny_model_path, tiny_draft_path):
    """A models.toml naming the tiny models, both in the cache: `tiny` (the default model; draft tiny-draft, default
    spec type draft-simple) and `tiny-draft` (no defaults)."""
    models = tmp_path / "cache" / "models"
    models.mkdir(parents=True)
    toml = 'default_model = "tiny"\ndefault_draft = "tiny-draft"\ntest_model = "tiny"\n'
    for name, path, extra in (("tiny", tiny_model_path, 'draft = "tiny-draft"\ndefault_spec_type = "draft-simple"\n'),
                              ("tiny-draft", tiny_draft_path, "")):
        shutil.copy(path, models / f"{name}.gguf")
        toml += (f'[models.{name}]\narch = "llama"\nsize = {path.stat().st_size}\nsha256 = "{"0" * 64}"\n{extra}'
                 'packages = [{ name = "unused", version = "1", member = "unused" }]\n')
    (tmp_path / "models.toml").write_text(toml)
    monkeypatch.setattr("spec_cli.model.catalog.REGISTRY_PATH", tmp_path / "models.toml")
    monkeypatch.setenv("SPEC_CLI_CACHE", str(tmp_path / "cache"))


def test_speculative_simple_applies_the_models_toml_defaults(capsys, monkeypatch, tiny_registry):
    """No flags on the default model: its default_spec_type with its listed draft (not a plain run, #25345)."""
    # a fixed draft length: under the default auto the planner's timings decide how much is drafted
    base = ["-p", PROMPT, "-n", "12", "--temp", "0", "--draft-p-min", "0", "--draft-max", "4", "--json"]
    code, out, err = cli(capsys, monkeypatch, "speculative-simple", *base)
    assert code == 0, err
    spec = json.loads(out)
    assert [d["name"] for d in spec["drafters"]] == ["draft-simple"] and spec["n_drafted"] > 0
    code, out, err = cli(capsys, monkeypatch, "run", *base)
    assert code == 0, err
    assert "drafters" not in json.loads(out)  # run speculates only when asked
    assert json.loads(out)["content"] == spec["content"]
    # asked for draft-simple without -md, any command drafts with the listed draft
    code, out, err = cli(capsys, monkeypatch, "run", "-m", "tiny", "--spec-type", "draft-simple", *base)
    assert code == 0, err
    assert json.loads(out)["n_drafted"] == spec["n_drafted"]


def test_speculative_simple_without_a_drafter_is_a_usage_error(capsys, monkeypatch, tiny_registry, tiny_model_path):
    for model, why in (("tiny-draft", "tiny-draft lists no draft"), (str(tiny_model_path), "a GGUF path has no")):
        code, out, err = cli(capsys, monkeypatch, "speculative-simple", "-m", model, "-p", PROMPT, "-n", "4")
        assert code == 2 and out == ""
        assert err.startswith("error: nothing to speculate with: give --spec-type") and why in err


@pytest.mark.parametrize("value, expected", [("auto", -1), ("all", -1), ("ALL", -1), ("-1", -1), ("0", 0), ("28", 28)])
def test_gpu_layers_take_llamacpp_words(value, expected):
    assert OPTIONS["n_gpu_layers_draft"].value(value) == expected


@pytest.mark.parametrize("value", ["-2", "many", "1.5", ""])
def test_gpu_layers_reject_other_values(value):
    with pytest.raises(UsageError, match="-ngld must be a number of blocks, auto or all"):
        OPTIONS["n_gpu_layers_draft"].value(value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only warnings")
def test_llamacpp_flags_without_effect_warn_once(capsys, monkeypatch, tiny_model_path, tiny_draft_path):
    base = ["-m", str(tiny_model_path), "-md", str(tiny_draft_path), "-p", PROMPT, "-n", "4", "--temp", "0", "--json"]
    code, out, err = cli(capsys, monkeypatch, "speculative-simple", *base, "-ngl", "2", "-ngld", "all", "-cd", "256",
                         "-td", "2")
    assert code == 0, err
    assert [line for line in err.splitlines() if line.startswith("warning:")] == [
        f"warning: -cd has no effect: {NO_EFFECT['-cd']}", f"warning: -td has no effect: {NO_EFFECT['-td']}",
        "warning: -ngl 2 has no effect: the model runs on the CPU (no CUDA device)"]
    code, out, err = cli(capsys, monkeypatch, "speculative-simple", *base, "-ngld", "1", "-ngl", "auto")
    assert code == 0, err
    assert err.splitlines() == ["warning: -ngld 1 has no effect: the draft model runs on the CPU (no CUDA device)"]
    code, out, err = cli(capsys, monkeypatch, "run", *base[:2], "-p", PROMPT, "-ngl", "few")
    assert code == 2 and "-ngl must be a number of blocks, auto or all (got 'few')" in err


def test_spec_default_is_llamacpps_ngram_mod(capsys, monkeypatch, tiny_model_path):
    base = ["-m", str(tiny_model_path), "-p", PROMPT, "-n", "4", "--temp", "0", "--json", "--spec-default"]
    for extra, drafters in (([], ["ngram-mod"]), (["--spec-type", "ngram-simple"], ["ngram-simple", "ngram-mod"])):
        code, out, err = cli(capsys, monkeypatch, "speculative-simple", *base, *extra)
        assert code == 0, err
        assert [d["name"] for d in json.loads(out)["drafters"]] == drafters


def test_chat_note_starts_its_own_line(monkeypatch, tiny_model_path):
    """-cnv on a terminal: the reply streams to stdout, the token-count note to stderr; on the terminal they share,
    the note must not land on the reply's line."""
    terminal = io.StringIO()
    monkeypatch.setattr(sys, "stdout", terminal)
    monkeypatch.setattr(sys, "stderr", terminal)
    monkeypatch.setattr("builtins.input", lambda prompt: (_ for _ in ()).throw(EOFError))
    session = open_session(EngineOptions(model=str(tiny_model_path), device="cpu"))
    chat_loop(session, "hello", SamplingParams(temp=0.0), {"chat_template": None, "n_predict": 6})
    *reply, note, end = terminal.getvalue().split("\n")
    assert note == "6 tokens" and end == "" and "".join(reply)


@pytest.mark.parametrize("log_format", ["text", "table"])
def test_lookup_log_format(capsys, monkeypatch, tiny_model_path, log_format):
    code, out, err = cli(capsys, monkeypatch, "lookup", "-m", str(tiny_model_path), "-p", PROMPT, "-n", "8", "--temp",
                         "0", "--log-format", log_format)
    assert code == 0, err
    text_lines = ("encoded", "decoded", "n_draft      = auto", "n_predict    = 8", "n_drafted    =", "t_draft_flat =",
                  "t_draft      =", "n_accept     =", "accept       =", "load time =")
    assert all((line in err) is (log_format == "text") for line in text_lines), err
    code, _, err = cli(capsys, monkeypatch, "lookup", "-m", str(tiny_model_path), "-p", PROMPT, "--log-format", "xml")
    assert code == 2 and "--log-format must be table or text" in err
