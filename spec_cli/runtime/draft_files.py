"""What `-md FILE` names: the kind of draft the GGUF is (llama.cpp #26814: without --spec-type the type comes from the
file's architecture) and the heads that load from it: an EAGLE-3 head, a DFlash (or DSpark) drafter, or the NextN
(MTP) head of a model file that has one (`mtp-train`'s output).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from spec_cli.errors import SpecCliError, UsageError
from spec_cli.model.config import ModelConfig
from spec_cli.model.dflash_file import is_dflash, is_dspark
from spec_cli.model.eagle3_file import is_eagle3
from spec_cli.model.gguf_file import GGUFFile
from spec_cli.model.loader import LoadedModel, torch_device
from spec_cli.model.mtp_head import MTPHead, load_mtp_head
from spec_cli.speculative.vocab_bridge import require_same_vocabulary
from spec_cli.text.tokenizer import Tokenizer

# the spec types a -md file can be drafted with; of them, those whose -md is a head file of its own (not a model)
MD_TYPES = ("draft-simple", "draft-eagle3", "draft-dflash", "draft-dspark", "draft-mtp")
HEAD_FILE_TYPES = ("draft-eagle3", "draft-dflash", "draft-dspark")
WHAT = {"draft-simple": "a draft model", "draft-eagle3": "an EAGLE-3 draft", "draft-dflash": "a DFlash draft",
        "draft-dspark": "a DSpark draft", "draft-mtp": "a model with NextN (MTP) layers"}


def draft_kind(path: str | Path) -> str:
    """The spec type a -md GGUF drafts with: an eagle3 file draft-eagle3, a dflash file draft-dflash (draft-dspark
    with DSpark's Markov head), a model with NextN layers draft-mtp (its head), any other model draft-simple."""
    gf = GGUFFile(path)
    arch = gf.architecture
    if is_eagle3(gf):
        return "draft-eagle3"
    if is_dflash(gf):
        return "draft-dspark" if is_dspark(gf) else "draft-dflash"
    if int(gf.get(f"{arch}.nextn_predict_layers", 0) or 0) > 0:
        return "draft-mtp"
    return "draft-simple"


def md_type(types: list[str], path: str | Path) -> str:
    """The spec type the -md file adds to `types`, checked: asked-for types that read -md must be its kind (a file's
    kind and another -md type is a usage error, not a traceback later)."""
    kind = draft_kind(path)
    other = [t for t in types if t in MD_TYPES and t != kind and not (t == "draft-mtp" and kind == "draft-simple")]
    if other:
        raise UsageError(f"-md {Path(path).name} is {WHAT[kind]} (--spec-type {kind}), not {WHAT[other[0]]} for "
                         f"--spec-type {other[0]} (leave --spec-type out to use the file's kind)")
    return kind


def head_device(device: str | None, device_draft: str | None, n_gpu_layers_draft: int) -> torch.device:
    """Where a one-layer head computes: -devd's device (the target's by default); -ngld 0 = the CPU."""
    dev = torch_device(device_draft or device)
    return torch.device("cpu") if n_gpu_layers_draft == 0 else dev


def load_head(path: str | Path, target: LoadedModel, tokenizer: Tokenizer, device: torch.device,
              loader: Callable) -> torch.nn.Module:
    """The head of -md's head file for this target (`loader(gguf, target, device)`: an eagle3 or dflash file's),
    its vocabulary checked against the target's where the file carries one."""
    gf = GGUFFile(path)
    head = loader(gf, target, device)
    if "tokenizer.ggml.tokens" in gf.metadata:
        require_same_vocabulary(tokenizer, Tokenizer.from_metadata(gf.metadata))
    return head


def load_mtp(path: str | Path | None, target: LoadedModel) -> MTPHead:
    """The NextN head of -md's model file (`path`), computing with the target's embedding and output, else the
    target's own."""
    source = target
    if path is not None:
        gf = GGUFFile(path)
        cfg = ModelConfig.from_gguf(gf)
        if (cfg.n_embd, cfg.n_vocab) != (target.config.n_embd, target.config.n_vocab):
            raise SpecCliError(f"{gf.path.name}: its NextN head is for a model of hidden size {cfg.n_embd} and "
                               f"{cfg.n_vocab} tokens; the target's are {target.config.n_embd} and "
                               f"{target.config.n_vocab}")
        source = LoadedModel(target.model, cfg, gf, 0.0, target.weights)
    head = load_mtp_head(source)
    if head is None:
        raise SpecCliError("--spec-type draft-mtp needs a model with an MTP (NextN) head; this model has none "
                           "(spec-cli draft-train --type mtp can distill one)")
    return head
