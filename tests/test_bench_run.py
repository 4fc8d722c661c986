"""Bench end to end on the tiny model: every test kind runs in seconds and decodes what llama-bench would (depth
prefilled once, then rolled back to; prompt in n_batch chunks), the verify-cost curve is self-consistent, and a
speculative sweep reports consistent numbers: accepted <= drafted, cold repetitions identical, speed-up from the
plain rows of the same invocation. Plus the CLI (stdout carries only the chosen format), plots and prompt sets."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from spec_cli.bench import runner as runner_module
from spec_cli.bench.params import BenchParams, from_flags, spec_chains
from spec_cli.bench.printers import format_md
from spec_cli.bench.runner import Progress, run_bench
from spec_cli.bench.verify_cost import break_even_acceptance, expected_length
from spec_cli.cli import app
from spec_cli.errors import SpecCliError, UsageError
from spec_cli.model.context import Context
from spec_cli.model.gguf_file import GGUFFile
from spec_cli.options import BENCH_OPTIONS, PROMPT_SETS, read_flags
from spec_cli.text.prompt_sets import load_prompt_set, render_tokens
from spec_cli.text.tokenizer import Tokenizer
from tests.test_lookup_cli import cli
from tests.tiny_mtp import write_tiny_mtp_gguf


@pytest.fixture
def decodes(monkeypatch):
    """Records (rows, first position, rows with logits) of every target decode."""
    seen: list[tuple[int, int, int]] = []
    original = Context.decode

    def record(self, batch, hidden=False):
        seen.append((len(batch), batch.pos[0], sum(batch.logits)))
        return original(self, batch, hidden)

    monkeypatch.setattr(Context, "decode", record)
    return seen


@pytest.fixture
def prompt_file(tmp_path):
    path = tmp_path / "tiny-set.jsonl"
    lines = [{"id": "loop", "prompt": "Hello world, the world is here. Hello world, the world is"},
             {"id": "chat", "messages": [{"role": "user", "content": "def return the"}]}]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def tiny(path, **kw) -> BenchParams:
    return BenchParams(model=[str(path)], devices=["cpu"], **kw)


# --- pp / tg / pg -------------------------------------------------------------------------------------------

def test_random_tests_time_llama_bench_workloads(tiny_model_path, decodes):
    params = tiny(tiny_model_path, n_prompt=[6], n_gen=[2], n_pg=[(3, 1)], n_depth=[0, 5], n_batch=[4],
                  repetitions=2)
    rows = run_bench(params)
    assert [(r.test, r.n_prompt, r.n_gen, r.n_depth) for r in rows] == [
        ("pp", 6, 0, 0), ("tg", 0, 2, 0), ("pg", 3, 1, 0), ("pp", 6, 0, 5), ("tg", 0, 2, 5), ("pg", 3, 1, 5)]
    for r in rows:
        assert len(r.samples_ns) == 2 and all(ns > 0 for ns in r.samples_ns)
        assert r.samples_ts == pytest.approx([1e9 * (r.n_prompt + r.n_gen) / ns for ns in r.samples_ns])
        assert (r.device, r.dtype, r.backends) == ("cpu", "f32", "CPU")
        assert r.model_type.startswith("llama") and r.n_threads >= 1 and r.build_version
    # the decodes llama-bench makes, per test: warmup (a prompt pass at 0, one token), the depth once (n_batch 4
    # chunks), then per repetition the prompt from the depth in n_batch chunks with logits on each chunk's last
    # row, and single-token generation decodes
    depth = [(4, 0, 1), (1, 4, 1)]
    assert decodes == (
        [(4, 0, 1), (2, 4, 1)] + [(4, 0, 1), (2, 4, 1)] * 2  # pp6
        + [(1, 0, 1)] + [(1, 0, 1), (1, 1, 1)] * 2  # tg2
        + [(3, 0, 1), (1, 3, 1)] + [(3, 0, 1), (1, 3, 1)] * 2  # pp3+tg1
        + [(4, 0, 1), (2, 4, 1)] + depth + [(4, 5, 1), (2, 9, 1)] * 2  # pp6 @ d5
        + [(1, 0, 1)] + depth + [(1, 5, 1), (1, 6, 1)] * 2  # tg2 @ d5
        + [(3, 0, 1), (1, 3, 1)] + depth + [(3, 5, 1), (1, 8, 1)] * 2)  # pp3+tg1 @ d5


def test_no_warmup_decodes_only_timed_work(tiny_model_path, decodes):
    run_bench(tiny(tiny_model_path, n_prompt=[3], n_gen=[0], repetitions=3, warmup=False))
    assert decodes == [(3, 0, 1)] * 3


# --- verify cost --------------------------------------------------------------------------------------------

def test_verify_cost_curve(tiny_model_path, decodes):
    rows = run_bench(tiny(tiny_model_path, random_tests=False, verify_cost=3, n_depth=[4], repetitions=2))
    assert [(r.test, r.verify["verify_k"], r.n_depth) for r in rows] == [("verify", k, 4) for k in (1, 2, 3)]
    mean = {r.verify["verify_k"]: sum(r.samples_ns) / 2 for r in rows}
    for r in rows:
        k = r.verify["verify_k"]
        assert r.verify["cost_ratio"] == pytest.approx(mean[k] / mean[1])
        assert r.verify["break_even_len"] == r.verify["cost_ratio"]
        assert r.samples_ts == pytest.approx([1e9 * k / ns for ns in r.samples_ns])
    assert rows[0].verify["cost_ratio"] == 1.0 and rows[0].verify["break_even_acc"] == 0.0
    # depth once, warmup k = 1..3, then 2 interleaved rounds; every verify row wants logits, at depth 4
    assert decodes == [(4, 0, 1), (1, 4, 1), (2, 4, 2), (3, 4, 3)] * 1 + [(1, 4, 1), (2, 4, 2), (3, 4, 3)] * 2


@pytest.mark.parametrize("k", [2, 4, 8, 16])
def test_break_even_acceptance_inverts_the_expected_length(k):
    assert break_even_acceptance(1.0, k) == 0.0 and break_even_acceptance(0.7, k) == 0.0
    assert break_even_acceptance(k, k) is None and break_even_acceptance(k + 1.0, k) is None
    previous = 0.0
    for ratio in sorted({1.1, 1.5, (1 + k) / 2, k - 0.01}):
        acc = break_even_acceptance(ratio, k)
        assert expected_length(acc, k) == pytest.approx(ratio, rel=1e-9)
        assert previous < acc < 1.0  # a costlier verify needs a better drafter
        previous = acc
    assert expected_length(0.0, k) == 1.0 and expected_length(1.0, k) == k


# --- speculative sweeps -------------------------------------------------------------------------------------

def test_speculative_sweep_is_consistent(tiny_model_path, tiny_draft_path, prompt_file):
    params = tiny(tiny_model_path, random_tests=False, spec_type=["ngram-simple", "draft-simple"],
                  model_draft=[str(tiny_draft_path)], draft_max=[2, 3], prompt_sets=[str(prompt_file)], n_gen=[8],
                  draft_p_min=[0.0], repetitions=2)
    rows = run_bench(params)
    assert [(r.spec["spec_type"], r.spec["draft_max"]) for r in rows] == [
        ("none", 0), ("ngram-simple", 2), ("ngram-simple", 3), ("draft-simple", 2), ("draft-simple", 3)]
    plain = rows[0]
    assert plain.spec["speedup"] == 1.0 and plain.spec["n_drafted"] == 0
    generated = {round(ts * ns / 1e9) for r in rows for ts, ns in zip(r.samples_ts, r.samples_ns)}
    assert len(generated) == 1  # greedy speculation is lossless: every row generated the same tokens
    for r in rows:
        s = r.spec
        assert r.test == "spec" and s["prompt_set"] == "tiny-set" and s["n_prompts"] == 2 and r.device == "cpu"
        assert 0 <= s["n_accepted"] <= s["n_drafted"] <= s["draft_max"] * s["n_steps"]
        assert s["speedup"] == pytest.approx(r.avg_ts / plain.avg_ts)  # the plain row of this same invocation
        assert all(a >= b for a, b in zip(s["acc_per_pos"], s["acc_per_pos"][1:]))
        assert len(s["acc_per_pos"]) <= s["draft_max"]
        if s["n_drafted"]:
            assert s["acceptance"] == pytest.approx(100 * s["n_accepted"] / s["n_drafted"])
            assert 1.0 <= s["mean_acc_len"] <= 1 + s["draft_max"]
        assert s["tokens_per_step"] >= 1.0
    drafted = [r for r in rows if r.spec["spec_type"] == "draft-simple"]
    assert all(r.spec["n_drafted"] > 0 for r in drafted)  # the noisy draft model always proposes at p_min 0
    assert all(r.spec["model_draft"] == str(tiny_draft_path) for r in drafted)
    assert all(r.spec["model_draft"] == "" for r in rows[1:3])


def test_cold_repetitions_start_from_scratch(tiny_model_path, tiny_draft_path, prompt_file):
    def counts(reps, warm=False):
        params = tiny(tiny_model_path, random_tests=False, spec_type=["draft-simple"],
                      model_draft=[str(tiny_draft_path)], draft_max=[3], draft_p_min=[0.0],
                      prompt_sets=[str(prompt_file)], n_gen=[6], repetitions=reps, warm=warm)
        s = run_bench(params)[1].spec
        return s["n_drafted"], s["n_accepted"], s["n_steps"], s["warm"]

    one, two = counts(1), counts(2)
    assert two[:3] == tuple(2 * x for x in one[:3])  # pooled over two identical cold repetitions
    assert counts(1, warm=True)[3] is True


def test_mtp_and_chains_build_their_engine_like_every_command(tmp_path, prompt_file):
    """bench assembles its engine the way build_engine does: draft-mtp gets the model's NextN head (it used to
    fail on a missing MTP context), and a chain (comma list) runs as one drafter chain."""
    mtp = write_tiny_mtp_gguf(tmp_path / "tiny-mtp.gguf")
    chains = spec_chains(BENCH_OPTIONS["spec_type"].values(["mtp;ngram-simple,mtp"]))
    rows = run_bench(tiny(mtp, random_tests=False, spec_type=chains,
                          draft_max=[2], draft_p_min=[0.0], prompt_sets=[str(prompt_file)], n_gen=[8], repetitions=1))
    assert [r.spec["spec_type"] for r in rows] == ["none", "draft-mtp", "ngram-simple,draft-mtp"]
    assert rows[1].spec["n_drafted"] > 0
    generated = {round(ts * ns / 1e9) for r in rows for ts, ns in zip(r.samples_ts, r.samples_ns)}
    assert len(generated) == 1  # lossless
    with pytest.raises(SpecCliError, match="MTP"):  # a model without a head: one clear error
        run_bench(tiny(tmp_path / "tiny-mtp-base.gguf", random_tests=False, spec_type=["draft-mtp"],
                       prompt_sets=[str(prompt_file)], n_gen=[4], repetitions=1))


def test_drafter_settings_sweep_like_the_other_commands_flags(tiny_model_path, tiny_draft_path, prompt_file,
                                                              monkeypatch):
    """--spec-ngram-*, -ngld and -devd: swept, handed to the drafters, recorded only on rows whose chain reads them."""
    built = []
    original = runner_module.assemble_engine
    monkeypatch.setattr(runner_module, "assemble_engine", lambda opts, *a: built.append(opts.spec) or original(opts, *a))
    flags = {"model": [str(tiny_model_path)], "devices": ["cpu"],
             "spec_type": ["ngram-simple;ngram-mod", "draft-simple"], "model_draft": [str(tiny_draft_path)],
             "ngram_mod_n_match": ["8,16"], "ngram_simple_size_n": ["2"], "n_gpu_layers_draft": ["0"],
             "device_draft": ["none"], "prompt_set": [str(prompt_file)], "n_gen": ["4"], "repetitions": 1}
    params = from_flags(read_flags(BENCH_OPTIONS, flags))
    rows = [r.to_dict() for r in run_bench(params)]
    got = [(r["spec_type"], r["ngram_simple_size_n"], r["ngram_mod_n_match"], r["ngram_mod_n_min"], r["model_draft"],
            r["n_gpu_layers_draft"], r["devices_draft"]) for r in rows]
    draft = str(tiny_draft_path)
    assert got == [("none", None, None, None, "", -1, ""), ("ngram-simple", 2, None, None, "", -1, ""),
                   ("ngram-mod", None, 8, 48, "", -1, ""), ("ngram-mod", None, 16, 48, "", -1, ""),
                   ("draft-simple", None, None, None, draft, 0, "none")]
    assert [(s.ngram_simple_size_n, s.ngram_mod_n_match) for s in built] == [(12, 24), (2, 24), (12, 8), (12, 16),
                                                                              (12, 24)]
    header, _, *cells = format_md(rows).split("\n\n")[0].splitlines()
    cols = [c.strip() for c in header.split("|")[1:-1]]
    assert {"ngram_simple_size_n", "ngram_mod_n_match", "ngld", "devd"} <= set(cols)
    assert "ngram_mod_n_min" not in cols  # one value, the default: hidden as llama-bench hides it
    assert [c.split("|")[1 + cols.index("ngram_mod_n_match")].strip() for c in cells] == ["-", "-", "8", "16", "-"]


def test_plain_only_prompt_set_run(tiny_model_path, prompt_file):
    rows = run_bench(tiny(tiny_model_path, random_tests=False, prompt_sets=[str(prompt_file)], n_gen=[4],
                          temp=[0.0, 0.8], repetitions=1))
    assert [(r.spec["spec_type"], r.spec["temp"], r.spec["speedup"]) for r in rows] == [("none", 0.0, 1.0),
                                                                                        ("none", 0.8, 1.0)]


# --- progress ---------------------------------------------------------------------------------------------

class Recorder(Progress):
    def __init__(self):
        self.events = []

    def start(self, tests, n_runs):
        self.events.append(("start", len(tests), n_runs))

    def test(self, i, name):
        self.events.append(("test", i))

    def runs_done(self, n=1):
        self.events.append(("runs", n))


def test_progress_announces_the_grid_then_counts_every_timed_run(tiny_model_path, prompt_file):
    recorder = Recorder()
    params = tiny(tiny_model_path, n_prompt=[4], n_gen=[2], verify_cost=2, spec_type=["ngram-simple"],
                  prompt_sets=[str(prompt_file)], repetitions=2)
    params.random_tests = True
    run_bench(params, recorder)
    start, *rest = recorder.events
    # pp, tg, verify, then plain + ngram-simple over the set's 2 prompts: 3 x 2 + 2 x 2 x 2 runs
    assert start == ("start", 5, 14)
    # the spec tests of one target run round-robin, a prompt each, the order turning by one at every prompt
    assert [e[1] for e in rest if e[0] == "test"] == [0, 1, 2] + [3, 4, 4, 3] * 2
    assert sum(e[1] for e in rest if e[0] == "runs") == 14
    spec_runs = [e for e in rest[rest.index(("test", 3)):] if e[0] == "runs"]
    assert spec_runs == [("runs", 1)] * 8  # one tick per prompt: a long speculative test moves the bar
    assert [e[0] for e in rest[rest.index(("test", 3)):]] == ["test", "runs"] * 8


def test_spec_tests_interleave_only_with_the_tests_of_their_plain_row(tiny_model_path, prompt_file):
    """Each temperature has its own plain row: its tests run round-robin together, then the next temperature's."""
    recorder = Recorder()
    run_bench(tiny(tiny_model_path, random_tests=False, spec_type=["ngram-simple"], prompt_sets=[str(prompt_file)],
                   n_gen=[2], temp=[0.0, 0.8], repetitions=1), recorder)
    assert [e[1] for e in recorder.events if e[0] == "test"] == [0, 1, 1, 0, 2, 3, 3, 2]


# --- CLI --------------------------------------------------------------------------------------------------

runner = CliRunner()


def test_cli_stdout_carries_only_the_format(tiny_model_path):
    result = runner.invoke(app, ["bench", "-m", str(tiny_model_path), "-p", "4", "-n", "2", "-r", "1", "-dev", "cpu",
                                 "-o", "json", "-oe", "md", "--no-warmup", "-fa", "on"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert [(r["test"], r["n_prompt"], r["n_gen"], r["flash_attn"]) for r in rows] == [("pp", 4, 0, 1), ("tg", 0, 2, 1)]
    assert "| model" in result.stderr and "| model" not in result.stdout
    assert result.stderr.count("warning: -fa has no effect") == 1  # recorded in the rows, changes nothing


def test_cli_baseline_gate(tiny_model_path, tmp_path):
    args = ["bench", "-m", str(tiny_model_path), "-p", "0", "-n", "2", "-r", "3", "-dev", "cpu", "-o", "jsonl",
            "--no-warmup"]
    first = runner.invoke(app, args)
    assert first.exit_code == 0, first.output
    rows = [json.loads(line) for line in first.stdout.splitlines()]
    assert [r["test"] for r in rows] == ["tg"]
    for scale, code, word in ((0.01, 0, "ok:"), (100.0, 1, "FAIL:")):  # a far slower / far faster baseline
        baseline = tmp_path / f"base{scale}.jsonl"
        baseline.write_text("".join(json.dumps({**r, "samples_ts": [t * scale for t in r["samples_ts"]]}) + "\n"
                                    for r in rows))
        result = runner.invoke(app, args + ["--baseline", str(baseline), "--max-regression", "10"])
        assert result.exit_code == code, result.output
        assert word in result.stderr and json.loads(result.stdout.splitlines()[0])["test"] == "tg"


def bench_cli(capsys, monkeypatch, *args: str) -> tuple[int, str, str]:
    return cli(monkeypatch, capsys, "bench", *args)


@pytest.mark.parametrize("terminal", [False, True])
def test_cli_prints_the_grid_size_first_and_a_bar_only_on_a_terminal(capsys, monkeypatch, tiny_model_path,
                                                                    prompt_file, terminal):
    monkeypatch.setattr(Console, "is_terminal", property(lambda self: terminal))
    monkeypatch.setenv("COLUMNS", "200")
    code, out, err = bench_cli(capsys, monkeypatch, "-m", str(tiny_model_path), "-dev", "cpu", "--spec-type",
                               "ngram-simple", "--prompts", str(prompt_file), "-n", "2", "-r", "2", "-o", "csv")
    assert code == 0, err
    first = err.splitlines()[0] if not terminal else err
    assert "bench: 2 tests, 2 repetitions each: 8 timed runs (a speculative run is one prompt of its set)" in first
    assert ("━" in err) is terminal  # the bar's
    if terminal:
        # the last frame: every run counted; the order turns by one per prompt, so the set's second prompt ran
        # ngram-simple's first and plain's last
        assert "bench 1/2" in err and "8/8" in err


@pytest.mark.parametrize("stop, output, code", [(signal.SIGTERM, "jsonl", 143), (signal.SIGINT, "md", 130)])
def test_a_stopped_bench_writes_the_rows_of_the_tests_that_finished(tiny_model_path, stop, output, code):
    """A sweep stopped in its second test (a CI job's timeout sends SIGTERM, a user ^C) through the installed
    script: the first test's row is written (jsonl as soon as its test finished), no traceback, 128 + the signal.
    The second test runs ~5 s; a row of 1000 samples fits in the pipe's buffer, so nothing blocks before the stop."""
    script = Path(sys.executable).with_name("spec-cli")
    proc = subprocess.Popen([script, "bench", "-m", str(tiny_model_path), "-dev", "cpu", "-p", "4,500", "-n", "0",
                             "-r", "1000", "--no-warmup", "--progress", "-o", output], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    try:
        for line in proc.stderr:  # the second test starts after the first one's row is out
            if line.startswith("bench 2/2"):
                break
        if output == "jsonl":
            streamed = json.loads(proc.stdout.readline())
            assert (streamed["test"], streamed["n_prompt"]) == ("pp", 4)
        proc.send_signal(stop)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == code, err
    assert "Traceback" not in err and "bench: stopped; the 1 rows of the tests that finished are written" in err
    if output == "md":
        assert "pp4" in out and "pp500" not in out
    else:
        assert out == ""  # the row was streamed before the stop, and written once


def test_cli_usage_errors(tiny_model_path):
    for args in (["-p", "8-1"], ["-o", "xml"], ["--spec-type", "draft-simple"], ["-fa", "sometimes"]):
        result = runner.invoke(app, ["bench", "-m", str(tiny_model_path), *args])
        assert isinstance(result.exception, UsageError), args


# --- plots ------------------------------------------------------------------------------------------------

def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    from spec_cli.bench.plot import plot_rows

    def spec(spec_type, dmax, ts, speedup, pos):
        return {"test": "spec", "model_type": "tiny", "spec_type": spec_type, "model_draft": "", "prompt_set": "qa",
                "temp": 0.0, "draft_max": dmax, "avg_ts": ts, "stddev_ts": 0.5, "speedup": speedup,
                "acc_per_pos": pos}

    rows = [spec("none", 0, 10.0, 1.0, [])] + [spec("ngram-mod", d, 10.0 + d, 1 + d / 10, [0.9, 0.5][:d])
                                              for d in (1, 2, 4)]
    rows += [{"test": "verify", "model_type": "tiny", "device": "cpu", "n_depth": 0, "verify_k": k,
              "cost_ratio": 1 + 0.3 * (k - 1)} for k in (1, 2, 3)]
    path = tmp_path / "sweep.png"
    plot_rows(rows, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
    with pytest.raises(SpecCliError, match="--plot"):
        plot_rows([{"test": "pp"}], tmp_path / "empty.png")


# --- prompt sets ------------------------------------------------------------------------------------------

def test_builtin_prompt_sets_render(tiny_model_path):
    tok = Tokenizer.from_metadata(GGUFFile(tiny_model_path).metadata)
    for name in PROMPT_SETS:
        ps = load_prompt_set(name)
        assert ps.name == name and 4 <= len(ps.prompts) <= 8
        for p in ps.prompts:
            text = json.dumps(p.messages)
            assert "{{" not in text  # every standard-library placeholder was filled
            assert len(render_tokens(p, tok)) > 10
    code = load_prompt_set("code-edit").prompts[0].messages[0]["content"]
    assert "def rgb_to_hls" in code  # source read from the running Python's colorsys


@pytest.mark.parametrize("line", ['{"id": 1}', "not json", '{"messages": []}', '{"prompt": "{{source:os.nope}}"}',
                                  '{"prompt": "{{source:numpy.array}}"}'])
def test_bad_prompt_files(tmp_path, line):
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(SpecCliError):
        load_prompt_set(str(path))


def test_unknown_prompt_set():
    with pytest.raises(UsageError, match="--prompt-set must be a built-in set .*code-edit"):
        BENCH_OPTIONS["prompt_set"].values(["poetry-slam"])
