"""A tiny GGUF with a NextN (MTP) head: tests/tiny_gguf's one-block llama model + one NextN block in llama.cpp's layout.

The head is built to agree with the target often but not always: its block is a copy of the target's only block
and the embedding half of eh_proj is the identity, so on its own the head would re-run the target on token_p and
predict what the target predicts at p (= token_{p+1}, what the head must predict). The hidden half of eh_proj is
random, so the hidden input (h_{p-1}) moves the prediction: a head fed the wrong position drafts differently.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from spec_cli.model.gguf_file import GGUFFile
from spec_cli.model.mtp_head import write_gguf_with_head
from spec_cli.model.quants import load_tensor
from tests.tiny_gguf import write_tiny_gguf


def write_tiny_mtp_gguf(path: Path, seed: int = 0, hidden_scale: float = 0.5, own_embed: bool = False,
                        own_head_norm: bool = True, draft_vocab: list[int] | None = None) -> Path:
    """The model without the head is written next to `path` as <stem>-base.gguf."""
    path = Path(path)
    base = write_tiny_gguf(path.with_name(path.stem + "-base.gguf"), arch="llama", seed=seed, n_layer=1)
    gf = GGUFFile(base)
    read = lambda name: load_tensor(gf, name).numpy()
    d = gf.tensors["output_norm.weight"].shape[0]
    rng = np.random.default_rng(seed + 7)
    head = {name[len("blk.0."):]: read(name) for name in gf.tensors if name.startswith("blk.0.")}
    head["nextn.eh_proj.weight"] = np.concatenate(  # [d, 2d]: [embedding half | hidden half]
        [np.eye(d), hidden_scale * rng.standard_normal((d, d)) / np.sqrt(d)], axis=1)
    head["nextn.enorm.weight"] = np.ones(d)
    head["nextn.hnorm.weight"] = np.ones(d)
    if own_head_norm:
        head["nextn.shared_head_norm.weight"] = read("output_norm.weight")
    if own_embed:
        head["nextn.embed_tokens.weight"] = read("token_embd.weight")
    return write_gguf_with_head(base, path, head, draft_vocab)
