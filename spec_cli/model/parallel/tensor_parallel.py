"""-tp N: a target sharded over N ranks (tp_shard.py), driven by rank 0.

Rank 0 runs the command as without -tp (drafters, the step loop, statistics, the server) and tells the other ranks
what to do with their shards: each load of a target, each context, each decode batch and each cache edit (seq_rm,
seq_cp, clear) is broadcast before rank 0 does it, so every rank runs the same forwards on the same batch plan and
meets the others in the same collectives. The other ranks run `follow` until rank 0 says stop. Launch: the command
spawns ranks 1..N-1 itself, or torchrun starts every rank (`followed_by_torchrun`).
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import sys
import weakref
from pathlib import Path

import torch

from spec_cli.errors import SpecCliError
from spec_cli.model.config import ModelConfig
from spec_cli.model.context import Context
from spec_cli.model.gguf_file import GGUFFile
from spec_cli.model.loader import LoadedModel, load_model
from spec_cli.model.parallel import comm as tp_comm
from spec_cli.model.parallel.shard import check_divisible, shard_model

_closed: list[int] = []  # keys of rank 0's contexts garbage-collected since the last message (freed on followers)


def _send(op: str, key, *args) -> None:
    """One command to the followers; closed contexts ride along, so a finalizer never broadcasts mid-forward."""
    closed = list(_closed)
    _closed.clear()
    tp_comm.broadcast((closed, op, key, args))


class ShardedContext(Context):
    """A Context on rank 0 of a sharded target: every call is sent to the followers, then done here."""

    _keys = itertools.count()

    def __init__(self, loaded: LoadedModel, *args, **kwargs):
        super().__init__(loaded, *args, **kwargs)  # bad arguments fail here first, before any follower sees them
        self.key = next(self._keys)
        _send("open", self.key, loaded.shard, args, kwargs)
        weakref.finalize(self, _closed.append, self.key)

    def decode(self, batch, hidden: bool = False):
        _send("decode", self.key, batch, hidden)
        return super().decode(batch, hidden)

    def seq_rm(self, seq: int, p0: int, p1: int = -1) -> None:
        _send("seq_rm", self.key, seq, p0, p1)
        super().seq_rm(seq, p0, p1)

    def seq_cp(self, src: int, dst: int, p0: int = 0, p1: int = -1) -> None:
        _send("seq_cp", self.key, src, dst, p0, p1)
        super().seq_cp(src, dst, p0, p1)

    def clear(self) -> None:
        _send("clear", self.key)
        super().clear()


def load_target(path: str | Path, device: str | None, dtype: str, world: int, threads: int | None) -> LoadedModel:
    """Rank 0's shard of the target at `path`; the followers (started on first use) load theirs meanwhile."""
    world = tp_comm.world_size(world)
    check_divisible(ModelConfig.from_gguf(GGUFFile(path)), world)  # before any rank starts
    threads = threads or max(1, (os.cpu_count() or 1) // world)  # local ranks share the cores
    if not tp_comm.launched_by_torchrun():
        torch.set_num_threads(threads)
    tp_comm.start(world, follower_main, threads)
    args = (str(path), device, dtype)
    key = repr(args)
    _send("load", key, *args)
    return _load_shard(key, *args)


def _load_shard(key: str, path: str, device: str | None, dtype: str) -> LoadedModel:
    group = tp_comm.current()
    loaded = load_model(path, str(tp_comm.rank_device(device)), -1, dtype)
    return dataclasses.replace(shard_model(loaded, group.rank, group.world), shard=key)


def follow() -> None:
    """A follower's life: do what rank 0 broadcasts, on this rank's shards, until it says stop (None)."""
    models: dict[str, LoadedModel] = {}
    contexts: dict[int, Context] = {}
    while (message := tp_comm.broadcast()) is not None:
        closed, op, key, args = message
        for k in closed:
            contexts.pop(k, None)
        try:
            if op == "load":
                models[key] = _load_shard(key, *args)
            elif op == "open":
                shard, ctx_args, ctx_kwargs = args
                contexts[key] = Context(models[shard], *ctx_args, **ctx_kwargs)
            else:
                getattr(contexts[key], op)(*args)
        except SpecCliError:
            if tp_comm.current().broken:
                raise
            # else rank 0 met the same error in the same call, before any collective, and reports it


def follower_main(rank: int, world: int, port: int, threads: int) -> None:
    """A rank spawned by rank 0 (a local launch): join, follow, exit 0; a one-line error and exit 1 on failure."""
    torch.set_num_threads(threads)
    _run_follower(rank, lambda: tp_comm.join_spawned(rank, world, port))


def followed_by_torchrun() -> bool:
    """Whether this process is a torchrun rank other than 0 (then it follows instead of running the command)."""
    return tp_comm.launched_by_torchrun() and int(os.environ["RANK"]) > 0


def torchrun_follower() -> None:
    rank = int(os.environ["RANK"])
    _run_follower(rank, lambda: tp_comm.join(rank, int(os.environ["WORLD_SIZE"])))


def _run_follower(rank: int, join) -> None:
    try:
        join()
        follow()
    except SpecCliError as e:
        print(f"error: -tp rank {rank}: {e}", file=sys.stderr)
        sys.exit(1)
    except Exception as e:  # noqa: BLE001 - a follower's bug still ends in one line, like the CLI's
        print(f"error: -tp rank {rank}: {type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)
    tp_comm.leave()
    sys.exit(0)
