"""draft-dflash through the installed `spec-cli` script and the server: `draft-train --type dflash` on a tiny model,
then `speculative-simple -md drafter.gguf` (the type inferred from the file) equal to plain decoding, alone and
chained under --draft-max auto; bad or foreign drafters, flags of another type and -tp are one-line errors with the
project's exit codes; a bench sweep and a server with slots and per-request types run it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from gguf import GGUFReader

from tests.head_checks import bench_sweep, server_types
from tests.test_eagle3_cli import PROMPT, spec_cli
from tests.tiny_dflash import write_tiny_dflash
from tests.tiny_eagle3 import rewritten
from tests.tiny_gguf import write_tiny_gguf


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    target = write_tiny_gguf(d / "target.gguf", arch="llama", seed=11, n_layer=4)
    drafter = d / "dflash.gguf"
    run = spec_cli("draft-train", "--type", "dflash", "-m", str(target), "-o", str(drafter), "--steps", "20",
                   "--seq-len", "32", "--batch", "4", "--data-tokens", "1024", "--gen-tokens", "512", "--eval-tokens",
                   "256", "--draft-vocab", "150", "--lr", "3e-3", "--block-size", "4", "--draft-layers", "2",
                   "--anchors", "8", "--layers", "1,3", "-dev", "cpu", "-t", "1", "--json")
    return d, target, drafter, run


def test_draft_train_writes_a_drafter_and_reports_its_acceptance(files):
    _, _, drafter, run = files
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    assert result["steps"] == 20 and Path(result["out_path"]) == drafter
    assert 0 <= result["acc_after"] <= 1 and result["mean_len_after"] >= 1
    stages = [line.split(" ")[0] for line in run.stderr.splitlines()]
    assert {"generate", "features", "train", "eval"} <= set(stages) and "Traceback" not in run.stderr
    reader = GGUFReader(str(drafter))
    assert reader.fields["general.architecture"].contents() == "dflash"
    assert reader.fields["dflash.block_size"].contents() == 4 and reader.fields["dflash.block_count"].contents() == 2
    assert [int(v) for v in reader.fields["dflash.target_layers"].contents()] == [1, 3]


def test_speculative_simple_with_the_trained_drafter_equals_plain(files):
    _, target, drafter, _ = files
    common = ["-m", str(target), "-p", PROMPT, "-n", "24", "--temp", "0", "--ignore-eos", "-t", "1", "--json"]
    plain = spec_cli("run", *common)
    spec = spec_cli("speculative-simple", *common, "-md", str(drafter), "--draft-max", "8", "--draft-p-min", "0",
                    "-devd", "cpu", "-ngld", "0")  # the type from the file; the drafter's device flags as llama.cpp's
    assert plain.returncode == 0 and spec.returncode == 0, spec.stderr
    out = json.loads(spec.stdout)
    assert out["content"] == json.loads(plain.stdout)["content"]
    assert [d["name"] for d in out["drafters"]] == ["draft-dflash"] and out["n_drafted"] > 0
    assert max(len(d["n_acc_tokens_per_pos"]) for d in out["drafters"]) <= 3  # clamped to block_size - 1
    chained = spec_cli("speculative-simple", *common, "-md", str(drafter), "--spec-type", "ngram-mod,draft-dflash",
                       "--draft-max", "auto", "--spec-select", "gain")
    assert chained.returncode == 0, chained.stderr
    assert json.loads(chained.stdout)["content"] == json.loads(plain.stdout)["content"]


def test_bad_drafters_other_types_flags_and_tp_are_one_line_errors(files, tmp_path):
    d, target, drafter, _ = files
    wide = write_tiny_gguf(tmp_path / "wide.gguf", seed=1, n_layer=4, dims={"n_embd": 128, "n_ff": 128})
    foreign = write_tiny_dflash(tmp_path / "foreign.gguf", wide, target_hidden=128).path
    broken = rewritten(drafter, tmp_path / "broken.gguf", drop=("fc.weight",))
    gen = ["speculative-simple", "-m", str(target), "-p", PROMPT, "-n", "4", "--temp", "0", "-t", "1"]
    train = ["draft-train", "-m", str(target), "-o", str(tmp_path / "x.gguf")]
    for args, code, text in (
            ([*gen, "-md", str(foreign)], 1, "this target's hidden size is 64"),
            ([*gen, "-md", str(broken)], 1, "must read"),
            ([*gen, "-md", str(drafter), "--spec-type", "draft-eagle3"], 2, "is a DFlash draft"),
            ([*gen, "--spec-type", "draft-dflash"], 2, "needs a DFlash draft"),
            ([*gen, "-md", str(drafter), "-tp", "2"], 2, "draft-dflash reads the target's hidden states"),
            ([*train, "--type", "eagle3", "--block-size", "4"], 2, "--block-size applies to --type dflash only"),
            ([*train, "--type", "mtp", "--layers", "1,2"], 2, "--layers applies to --type eagle3 and dflash only"),
            ([*train, "--outtype", "q3_k"], 2, "--outtype")):
        run = spec_cli(*args)
        assert run.returncode == code and text in run.stderr, (args, run.stderr)
        assert "Traceback" not in run.stderr and len(run.stderr.strip().splitlines()) == 1, run.stderr


def test_a_bench_sweep_runs_draft_dflash(files):
    d, target, md, _ = files
    bench_sweep(spec_cli, target, md, "draft-dflash", d, PROMPT, "--draft-max", "3,auto", "--draft-p-min", "0")


def test_server_slots_and_per_request_types(files):
    _, target, md, _ = files
    server_types(target, md, "draft-dflash", PROMPT)
