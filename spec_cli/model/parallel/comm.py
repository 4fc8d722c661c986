"""The ranks of a tensor-parallel group over torch.distributed: joining it (torchrun's env:// rendezvous, or the
local ranks a command spawns itself), the collectives the shards use, and a lost rank as a one-line error.

gloo on the CPU, NCCL on CUDA (one group with both: each collective goes by its tensors' device; rank r computes
on cuda:LOCAL_RANK). The rendezvous and every collective give up after TIMEOUT; a rank that dies closes its
connections, so the others fail at their next collective at once.
"""

from __future__ import annotations

import atexit
import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from spec_cli.errors import SpecCliError, UsageError
from spec_cli.model.loader import is_auto_device, torch_device

TIMEOUT = timedelta(seconds=120)  # loading a large shard on a follower counts against it (rank 0 waits meanwhile)


@dataclass
class Group:
    rank: int
    world: int
    spawned: list = field(default_factory=list)  # the follower processes this command started (local launch)
    broken: bool = False  # a collective failed: no farewell to send


_group: Group | None = None


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def world_size(requested: int) -> int:
    """The group's size: -tp N, or under torchrun its WORLD_SIZE (-tp must then be left out or equal it)."""
    if not launched_by_torchrun():
        return requested
    world = int(os.environ["WORLD_SIZE"])
    if requested not in (1, world):
        raise UsageError(f"-tp {requested} under torchrun with {world} processes: give -tp {world} or leave it out")
    return world


def rank_device(device: str | None) -> torch.device:
    """This rank's device for `-dev`: cuda:LOCAL_RANK where the device is CUDA, else the CPU. `auto` is CUDA only
    where the machine has a GPU for each of its ranks (one H100 and -tp 2: every rank on the CPU); a CUDA device
    named with too few GPUs is a usage error."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    n_local = int(os.environ["LOCAL_WORLD_SIZE"]) if "LOCAL_WORLD_SIZE" in os.environ else current().world
    n_gpus = torch.cuda.device_count()
    if is_auto_device(device):
        return torch.device("cuda", local_rank) if n_gpus >= n_local else torch.device("cpu")
    if torch_device(device).type != "cuda":
        return torch.device("cpu")
    if local_rank >= n_gpus:
        raise UsageError(f"-tp: rank {local_rank} needs cuda:{local_rank} but this machine has {n_gpus} CUDA "
                         f"device(s) (-dev cpu runs the ranks on the CPU)")
    return torch.device("cuda", local_rank)


def current() -> Group:
    if _group is None:
        raise SpecCliError("no tensor-parallel group")
    return _group


def start(world: int, follower, threads: int) -> Group:
    """Rank 0 joins the group (once per command): under torchrun by env://, else after spawning ranks 1..world-1,
    each running `follower(rank, world, store_port, threads)`."""
    global _group
    if _group is not None:
        if _group.world != world:
            raise UsageError(f"-tp {world} after -tp {_group.world}: one group size per command")
        return _group
    if launched_by_torchrun():
        join(int(os.environ["RANK"]), world)
        return current()
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, timeout=TIMEOUT, wait_for_workers=False)
    spawn = torch.multiprocessing.get_context("spawn")
    ranks = [spawn.Process(target=follower, args=(r, world, store.port, threads), daemon=True)
             for r in range(1, world)]
    for process in ranks:
        process.start()
    join(0, world, store)
    _group.spawned = ranks
    return _group


def join(rank: int, world: int, store: dist.Store | None = None) -> None:
    """Enter the group as `rank`: through `store` (a local launch) or torchrun's env:// variables."""
    global _group
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if local_rank < torch.cuda.device_count():  # (CPU ranks beyond the GPUs of a machine never touch NCCL)
        torch.cuda.set_device(local_rank)
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    try:
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=TIMEOUT)
    except (RuntimeError, ValueError) as e:
        raise SpecCliError(f"tensor parallel: rank {rank} could not join the group of {world} within "
                           f"{TIMEOUT.seconds} s ({_first_line(e)})") from None
    _group = Group(rank, world)
    if rank == 0:
        atexit.register(stop)


def join_spawned(rank: int, world: int, port: int) -> None:
    """A spawned follower enters its parent's group through the parent's store on `port`."""
    os.environ["LOCAL_RANK"] = str(rank)
    try:
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=TIMEOUT)
    except RuntimeError as e:
        raise SpecCliError(f"tensor parallel: rank {rank} cannot reach rank 0 ({_first_line(e)})") from None
    join(rank, world, store)


def all_reduce(t: torch.Tensor) -> torch.Tensor:
    """t summed over the ranks, in place."""
    try:
        dist.all_reduce(t)
    except RuntimeError as e:
        raise _lost(e) from None
    return t


def all_gather(t: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's t (same shape on all), in rank order."""
    parts = [torch.empty_like(t) for _ in range(current().world)]
    try:
        dist.all_gather(parts, t)
    except RuntimeError as e:
        raise _lost(e) from None
    return parts


def broadcast(message=None):
    """Rank 0's `message` (any picklable object) on every rank; None tells the followers to stop."""
    box = [message]
    try:
        dist.broadcast_object_list(box, src=0, device=torch.device("cpu"))
    except RuntimeError as e:
        raise _lost(e) from None
    return box[0]


def stop() -> None:
    """Rank 0 at exit: tell the followers to stop (unless the group is broken), leave, reap spawned ranks."""
    global _group
    group, _group = _group, None
    if group is None:
        return
    if not group.broken:
        try:
            broadcast(None)
        except SpecCliError:
            pass
    leave()
    for process in group.spawned:
        process.join(timeout=10)
        if process.is_alive():
            process.kill()


def leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _lost(e: Exception) -> SpecCliError:
    if _group is not None:
        _group.broken = True
    return SpecCliError(f"tensor parallel: a rank stopped or did not answer within {TIMEOUT.seconds} s "
                        f"({_first_line(e)})")


def _first_line(e: Exception) -> str:
    lines = str(e).strip().splitlines()
    return lines[0][:200] if lines else type(e).__name__
