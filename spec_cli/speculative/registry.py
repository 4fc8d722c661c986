"""The drafter types `--spec-type` knows: a name -> a factory that builds a fresh drafter of it.

The names, their aliases and their priority order (the order the chain asks its drafters in, whatever the command
line says) are spec_cli/options.py's, which parses --spec-type; the built-in types' factories are below.
`register_drafter` adds a type after them; a plugin module named in SPEC_CLI_PLUGINS, imported when the command
starts (cli/__init__.py `load_plugins`), calls it at import.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from spec_cli.model.context import Context
from spec_cli.model.dflash_head import DFlashContext
from spec_cli.model.head_context import HeadContext
from spec_cli.options import add_drafter_type, drafter_types
from spec_cli.speculative.base import Drafter, SpecParams
from spec_cli.speculative.dflash import DFlashDrafter
from spec_cli.speculative.draft_model import DraftModelDrafter
from spec_cli.speculative.dspark import DSparkDrafter
from spec_cli.speculative.eagle3 import Eagle3Drafter
from spec_cli.speculative.mtp import MTPDrafter
from spec_cli.speculative.ngram_cache import NgramCacheDrafter
from spec_cli.speculative.ngram_map import NgramMapK4vDrafter, NgramMapKDrafter
from spec_cli.speculative.ngram_mod import NgramModDrafter
from spec_cli.speculative.ngram_simple import NgramSimpleDrafter
from spec_cli.speculative.suffix import SuffixDrafter
from spec_cli.speculative.vocab_bridge import VocabBridge


@dataclass(frozen=True)
class DrafterInputs:
    """What a factory builds a drafter from: the settings, the number of sequences and the engine's contexts."""

    params: SpecParams
    n_seq: int
    target: Context  # draft-mtp reads the target's hidden states
    draft: Context | None = None  # the draft model's (-md), for draft-simple
    mtp: HeadContext | None = None  # the target's NextN head with its own KV, for draft-mtp
    eagle3: HeadContext | None = None  # the EAGLE-3 head (-md) with its own KV, for draft-eagle3
    dflash: DFlashContext | None = None  # the DFlash drafter (-md) with its own KV, for draft-dflash / draft-dspark
    draft_bridge: VocabBridge | None = None  # the draft model's vocabulary to the target's, when they differ


DrafterFactory = Callable[[DrafterInputs], Drafter]

_FACTORIES: dict[str, DrafterFactory] = {  # the built-in types of options.py, by canonical name
    **{cls.name: (lambda inputs, cls=cls: cls(inputs.params, inputs.n_seq))
       for cls in (NgramSimpleDrafter, NgramMapKDrafter, NgramMapK4vDrafter, NgramModDrafter, NgramCacheDrafter)},
    "suffix": lambda inputs: SuffixDrafter(inputs.params, inputs.n_seq, inputs.target.n_ctx_seq),
    "draft-simple": lambda inputs: DraftModelDrafter(inputs.draft, inputs.params, inputs.n_seq, inputs.draft_bridge),
    "draft-mtp": lambda inputs: MTPDrafter(inputs.mtp, inputs.target, inputs.params, inputs.n_seq),
    "draft-eagle3": lambda inputs: Eagle3Drafter(inputs.eagle3, inputs.target, inputs.params, inputs.n_seq),
    "draft-dflash": lambda inputs: DFlashDrafter(inputs.dflash, inputs.target, inputs.params, inputs.n_seq),
    "draft-dspark": lambda inputs: DSparkDrafter(inputs.dflash, inputs.target, inputs.params, inputs.n_seq),
}


def register_drafter(name: str, factory: DrafterFactory, aliases: tuple[str, ...] = ()) -> None:
    """Make `name` (and `aliases`) a --spec-type whose drafters `factory(inputs)` builds; they are named `name`.
    The chain asks a type registered later after the ones before it."""
    add_drafter_type(name, aliases)
    _FACTORIES[name] = factory


def build_drafters(types: list[str], inputs: DrafterInputs) -> list[Drafter]:
    """Fresh drafters of the canonical `types`, in priority order."""
    drafters = []
    for name in drafter_types():
        if name in types:
            drafter = _FACTORIES[name](inputs)
            if drafter.name != name:  # the chain's statistics and per-request types go by the drafter's name
                raise TypeError(f"the factory of drafter type '{name}' built a drafter named '{drafter.name}'")
            drafters.append(drafter)
    return drafters
