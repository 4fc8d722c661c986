"""`--spec-type` name -> drafter class. Every class is built as `cls(params: SpecParams, n_seq: int)`."""

from __future__ import annotations

from spec_cli.speculative.ngram_cache import NgramCacheDrafter
from spec_cli.speculative.ngram_map import NgramMapK4vDrafter, NgramMapKDrafter
from spec_cli.speculative.ngram_mod import NgramModDrafter
from spec_cli.speculative.ngram_simple import NgramSimpleDrafter

NGRAM_DRAFTERS: dict[str, type] = {
    cls.name: cls
    for cls in (NgramSimpleDrafter, NgramMapKDrafter, NgramMapK4vDrafter, NgramModDrafter, NgramCacheDrafter)
}
