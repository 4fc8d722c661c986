"""The drafter types `--spec-type` knows: a name (and aliases) -> a factory that builds a fresh drafter of it.

The built-in types are registered below in llama.cpp's priority order, the order the chain asks its drafters in
whatever the command line says. `register_drafter` adds a type after them; a plugin module named in
SPEC_CLI_PLUGINS, imported by `load_plugins` when the command starts, calls it at import.
"""

from __future__ import annotations

import importlib
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from spec_cli.errors import UsageError
from spec_cli.model.context import Context
from spec_cli.model.head_context import HeadContext
from spec_cli.speculative.base import Drafter, SpecParams
from spec_cli.speculative.draft_model import DraftModelDrafter
from spec_cli.speculative.eagle3 import Eagle3Drafter
from spec_cli.speculative.mtp import MTPDrafter
from spec_cli.speculative.ngram_cache import NgramCacheDrafter
from spec_cli.speculative.ngram_map import NgramMapK4vDrafter, NgramMapKDrafter
from spec_cli.speculative.ngram_mod import NgramModDrafter
from spec_cli.speculative.ngram_simple import NgramSimpleDrafter

PLUGINS_ENV = "SPEC_CLI_PLUGINS"
_NAME = re.compile(r"[a-z0-9][a-z0-9_.-]*")  # --spec-type values are lower-cased and split at commas


@dataclass(frozen=True)
class DrafterInputs:
    """What a factory builds a drafter from: the settings, the number of sequences and the engine's contexts."""

    params: SpecParams
    n_seq: int
    target: Context  # draft-mtp reads the target's hidden states
    draft: Context | None = None  # the draft model's (-md), for draft-simple
    mtp: HeadContext | None = None  # the target's NextN head with its own KV, for draft-mtp
    eagle3: HeadContext | None = None  # the EAGLE-3 head (-md) with its own KV, for draft-eagle3


DrafterFactory = Callable[[DrafterInputs], Drafter]

_FACTORIES: dict[str, DrafterFactory] = {}  # canonical name -> factory, in priority order
_ALIASES: dict[str, str] = {}


def register_drafter(name: str, factory: DrafterFactory, aliases: tuple[str, ...] = ()) -> None:
    """Make `name` (and `aliases`) a --spec-type whose drafters `factory(inputs)` builds; they are named `name`.
    The chain asks a type registered later after the ones before it."""
    for n in (name, *aliases):
        if not _NAME.fullmatch(n) or n == "none" or n in _FACTORIES or n in _ALIASES:
            raise ValueError(f"cannot register drafter type '{n}': taken, or not a lower-case name")
    _FACTORIES[name] = factory
    _ALIASES.update(dict.fromkeys(aliases, name))


def spec_type_names() -> dict[str, str]:
    """Every name --spec-type accepts but `none` -> its canonical name: the types in priority order, then aliases."""
    return {**{name: name for name in _FACTORIES}, **_ALIASES}


def drafter_types() -> list[str]:
    """Canonical names, in priority order."""
    return list(_FACTORIES)


def build_drafters(types: list[str], inputs: DrafterInputs) -> list[Drafter]:
    """Fresh drafters of the canonical `types`, in priority order."""
    drafters = []
    for name, factory in _FACTORIES.items():
        if name in types:
            drafter = factory(inputs)
            if drafter.name != name:  # the chain's statistics and per-request types go by the drafter's name
                raise TypeError(f"the factory of drafter type '{name}' built a drafter named '{drafter.name}'")
            drafters.append(drafter)
    return drafters


def load_plugins(env: Mapping[str, str] = os.environ) -> None:
    """Import the modules SPEC_CLI_PLUGINS names (a comma list); each registers its drafter types at import."""
    for module in filter(None, (m.strip() for m in env.get(PLUGINS_ENV, "").split(","))):
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise UsageError(f"{PLUGINS_ENV}: cannot import '{module}' ({e})") from None


for _cls in (NgramSimpleDrafter, NgramMapKDrafter, NgramMapK4vDrafter, NgramModDrafter, NgramCacheDrafter):
    register_drafter(_cls.name, lambda inputs, cls=_cls: cls(inputs.params, inputs.n_seq))
register_drafter("draft-simple", lambda inputs: DraftModelDrafter(inputs.draft, inputs.params, inputs.n_seq),
                 aliases=("draft",))
register_drafter("draft-mtp", lambda inputs: MTPDrafter(inputs.mtp, inputs.target, inputs.params, inputs.n_seq),
                 aliases=("mtp",))
register_drafter("draft-eagle3",
                 lambda inputs: Eagle3Drafter(inputs.eagle3, inputs.target, inputs.params, inputs.n_seq),
                 aliases=("eagle3",))
