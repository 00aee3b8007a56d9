"""torch.distributed for every task, set up from torchrun's (RANK, WORLD_SIZE, ...) or SLURM's environment
(the port derived from the job id, as submitit's ``TorchDistributedEnvironment``), and the few collectives
the loops need; alone, every helper does nothing. NCCL on CUDA, gloo otherwise."""

from __future__ import annotations

import datetime
import os
import random
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def launcher_env() -> DistInfo | None:
    """This process's place in a multi-process job, from torchrun's or SLURM's variables (None: alone)."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        info = DistInfo(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)))
    elif int(env.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in env:
        info = DistInfo(int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", 0)))
    else:
        return None
    return info if info.world_size > 1 else None


def _slurm_master_addr() -> str:
    nodes = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST", "localhost")
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodes], capture_output=True, text=True,
                             check=True, timeout=30)
        return out.stdout.split()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return nodes.split(",")[0].split("[")[0]  # "node[1-4]" -> "node": good enough on one node


def init_distributed(device: str = "auto") -> DistInfo:
    """Join the process group of a torchrun / SLURM job (once; later calls return the same answer)."""
    if dist.is_available() and dist.is_initialized():
        return info()
    found = launcher_env()
    if found is None:
        return DistInfo()
    if "RANK" not in os.environ:  # SLURM: export what init_process_group's env:// method reads
        os.environ.update(RANK=str(found.rank), WORLD_SIZE=str(found.world_size),
                          LOCAL_RANK=str(found.local_rank))
        os.environ.setdefault("MASTER_ADDR", _slurm_master_addr())
        job = os.environ.get("SLURM_JOB_ID", "0")
        os.environ.setdefault("MASTER_PORT", str(random.Random(job).randint(20000, 60000)))
    cuda = torch.cuda.is_available() and device != "cpu"
    if cuda:
        torch.cuda.set_device(found.local_rank)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(minutes=30))
    return found


def info() -> DistInfo:
    if not (dist.is_available() and dist.is_initialized()):
        return DistInfo()
    return DistInfo(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0)))


def barrier() -> None:
    if info().enabled:
        dist.barrier()


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum of ``tensor`` over the processes (in place); exact for integer counts."""
    if info().enabled:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Process ``src``'s ``obj`` on every process."""
    if not info().enabled:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_gather_objects(obj: Any) -> list[Any]:
    """Every process's ``obj``, in rank order."""
    if not info().enabled:
        return [obj]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def joined() -> bool:
    """Whether this process is in a process group (joined by :func:`init_distributed`)."""
    return dist.is_available() and dist.is_initialized()


def shutdown() -> None:
    """Leave the process group, if in one, after a barrier."""
    if joined():
        dist.barrier()
        dist.destroy_process_group()


@contextmanager
def process_group(device: str = "auto", ends: tuple[type[BaseException], ...] = ()) -> Iterator[DistInfo]:
    """:func:`init_distributed` for the block, and :func:`shutdown` at its end if the block joined and it
    ended normally or with one of ``ends``; otherwise the group is kept (leaving could hang)."""
    joined_before = joined()
    world = init_distributed(device)
    try:
        yield world
    except ends:
        if not joined_before:
            shutdown()
        raise
    else:
        if not joined_before:
            shutdown()
