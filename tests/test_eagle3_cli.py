"""draft-eagle3 through the installed `spec-cli` script and the server: `draft-train --type eagle3` on a tiny model,
then `speculative-simple -md head.gguf` (the type inferred from the file) equal to plain decoding; -md's kind decides
the type (eagle3, dflash, a model with NextN layers, a plain model); bad or foreign heads and -tp are
one-line errors with the project's exit codes; a bench sweep and a server with slots and per-request types run it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter

from spec_cli.errors import UsageError
from spec_cli.runtime.engine import EngineOptions, implied_spec
from spec_cli.speculative.base import SpecParams
from tests.head_checks import bench_sweep, server_types
from tests.tiny_eagle3 import rewritten, write_tiny_eagle3
from tests.tiny_gguf import write_tiny_gguf
from tests.tiny_mtp import write_tiny_mtp_gguf

SCRIPT = Path(sys.executable).with_name("spec-cli")
PROMPT = "the cat sat on the mat. the cat sat on the mat. the cat"


def spec_cli(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    target = write_tiny_gguf(d / "target.gguf", arch="llama", seed=11, n_layer=4)
    head = d / "head.gguf"
    run = spec_cli("draft-train", "--type", "eagle3", "-m", str(target), "-o", str(head), "--steps", "20",
                   "--seq-len", "32", "--batch", "4", "--data-tokens", "1024", "--gen-tokens", "512", "--eval-tokens",
                   "256", "--draft-vocab", "150", "--lr", "3e-3", "--ttt-steps", "2", "--outtype", "q4_0", "-dev",
                   "cpu", "-t", "1", "--json")
    return d, target, head, run


def test_draft_train_writes_a_head_and_reports_its_acceptance(files):
    _, _, head, run = files
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    assert result["steps"] == 20 and Path(result["out_path"]) == head
    assert 0 <= result["acc_after"] <= 1 and result["mean_len_after"] >= 1
    parts = result["acc_parts"]  # the held-out answers' and the held-out code's, apart: the whole is their mean
    assert set(parts) == {"answers", "code"}
    assert min(parts.values()) - 1e-9 <= result["acc_after"] <= max(parts.values()) + 1e-9
    stages = [line.split(" ")[0] for line in run.stderr.splitlines()]
    assert {"generate", "features", "train", "eval"} <= set(stages) and "Traceback" not in run.stderr
    reader = GGUFReader(str(head))
    assert reader.fields["general.architecture"].contents() == "eagle3"
    # --outtype q4_0: the matrices in Q4_0 blocks (the next test drafts with them), the vectors float32
    types = {t.name: t.tensor_type for t in reader.tensors if t.name != "d2t"}
    assert {n for n, t in types.items() if t == GGMLQuantizationType.Q4_0} >= {"fc.weight", "blk.0.ffn_up.weight"}
    assert types["output_norm.weight"] == GGMLQuantizationType.F32
    assert set(types.values()) == {GGMLQuantizationType.Q4_0, GGMLQuantizationType.F32}


def test_speculative_simple_with_the_trained_head_equals_plain(files):
    _, target, head, _ = files
    common = ["-m", str(target), "-p", PROMPT, "-n", "24", "--temp", "0", "--ignore-eos", "-t", "1", "--json"]
    plain = spec_cli("run", *common)
    spec = spec_cli("speculative-simple", *common, "-md", str(head), "--draft-max", "3", "-devd", "cpu", "-ngld",
                    "0")  # the type from the file; the head's device flags as llama.cpp's
    assert plain.returncode == 0 and spec.returncode == 0, spec.stderr
    out = json.loads(spec.stdout)
    assert out["content"] == json.loads(plain.stdout)["content"]
    assert [d["name"] for d in out["drafters"]] == ["draft-eagle3"] and out["n_drafted"] > 0
    chained = spec_cli("speculative-simple", *common, "-md", str(head), "--spec-type", "ngram-mod,draft-eagle3",
                       "--draft-max", "auto", "--spec-select", "gain")
    assert chained.returncode == 0, chained.stderr
    assert json.loads(chained.stdout)["content"] == json.loads(plain.stdout)["content"]


def test_the_type_comes_from_the_draft_file(files, tmp_path):
    d, target, head, _ = files
    mtp = write_tiny_mtp_gguf(tmp_path / "mtp.gguf")
    dflash = tmp_path / "dflash.gguf"
    writer = GGUFWriter(str(dflash), "dflash")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()

    def types(md, spec_types=()):
        return implied_spec(EngineOptions(model=str(target), model_draft=str(md),
                                          spec=SpecParams(types=list(spec_types)))).types

    assert types(head) == ["draft-eagle3"] and types(target) == ["draft-simple"] and types(mtp) == ["draft-mtp"]
    assert types(head, ["ngram-mod"]) == ["ngram-mod", "draft-eagle3"]
    assert types(target, ["draft-mtp"]) == ["draft-mtp", "draft-simple"]  # the target's own head + a draft model
    assert types(dflash) == ["draft-dflash"]
    with pytest.raises(UsageError, match="is an EAGLE-3 draft"):
        types(head, ["draft-simple"])
    with pytest.raises(UsageError, match="is a draft model"):
        types(target, ["draft-eagle3"])


def test_a_mtp_head_from_the_draft_file_is_lossless(tmp_path):
    """-md naming a model file with NextN layers (mtp-train's output): the head from it, the target from -m."""
    mtp = write_tiny_mtp_gguf(tmp_path / "mtp.gguf")
    base = mtp.with_name(mtp.stem + "-base.gguf")
    common = ["-m", str(base), "-p", PROMPT, "-n", "16", "--temp", "0", "--ignore-eos", "-t", "1", "--json"]
    plain, spec = spec_cli("run", *common), spec_cli("speculative-simple", *common, "-md", str(mtp))
    assert spec.returncode == 0, spec.stderr
    out = json.loads(spec.stdout)
    assert out["content"] == json.loads(plain.stdout)["content"] and out["drafters"][0]["name"] == "draft-mtp"


def test_bad_heads_and_tp_are_one_line_errors(files, tmp_path):
    d, target, head, _ = files
    wide = write_tiny_gguf(tmp_path / "wide.gguf", seed=1, n_layer=4, dims={"n_embd": 128, "n_ff": 128})
    foreign = write_tiny_eagle3(tmp_path / "foreign.gguf", wide, target_hidden=128).path
    broken = rewritten(head, tmp_path / "broken.gguf", drop=("fc.weight",))  # an eagle3 file without its fc
    gen = ["speculative-simple", "-m", str(target), "-p", PROMPT, "-n", "4", "--temp", "0", "-t", "1"]
    for args, code, text in (
            ([*gen, "-md", str(foreign)], 1, "hidden size 128"),
            ([*gen, "-md", str(broken)], 1, "missing tensors"),
            ([*gen, "-md", str(head), "--spec-type", "draft-simple"], 2, "is an EAGLE-3 draft"),
            ([*gen, "--spec-type", "draft-eagle3"], 2, "needs an EAGLE-3 draft"),
            ([*gen, "-md", str(head), "-tp", "2"], 2, "draft-eagle3 reads the target's hidden states")):
        run = spec_cli(*args)
        assert run.returncode == code and text in run.stderr, (args, run.stderr)
        assert "Traceback" not in run.stderr and len(run.stderr.strip().splitlines()) == 1, run.stderr


def test_a_bench_sweep_runs_draft_eagle3(files):
    d, target, md, _ = files
    bench_sweep(spec_cli, target, md, "draft-eagle3", d, PROMPT, "--draft-max", "2,auto")


def test_server_slots_and_per_request_types(files):
    _, target, md, _ = files
    server_types(target, md, "draft-eagle3", PROMPT)
