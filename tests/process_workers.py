"""Functions that ``torch.multiprocessing`` runs in spawned processes: a spawned child imports a function by
its module's name, and test modules (imported by path) have none it can import; this module is on the tests'
``pythonpath``, which the children inherit."""

from __future__ import annotations

import os

import numpy as np
import torch


def dino_center_of(rank: int, world: int, port: int, outputs: np.ndarray, result: str) -> None:
    """DINO's centre after one update from this process's share of ``outputs`` (all-reduced over ``world``
    gloo processes); process 0 saves it to ``result``."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    from normexp import distributed
    from normexp.tasks.dino import DINOLoss

    distributed.init_distributed("cpu")
    loss = DINOLoss(outputs.shape[1], 2)
    loss.accumulate(torch.from_numpy(np.array_split(outputs, world)[rank]))
    loss.update_center()
    if rank == 0:
        np.save(result, loss.center.numpy())


def process_group_states(rank: int, world: int, ports: list[int], result: str) -> None:
    """Whether this process is in the group inside ``distributed.process_group``, after it (the block joined
    it), after a block ended by one of its ``ends``, and after a block whose group was joined before it;
    process 0 saves them to ``result``. Each group meets on a port of its own: process 1 can leave a group
    and join the next before process 0 has closed the last one's store, and would join that one."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1")
    from normexp import distributed

    states = []
    os.environ["MASTER_PORT"] = str(ports[0])
    with distributed.process_group("cpu") as info:
        states.append(distributed.joined() and info.world_size == world)
    states.append(distributed.joined())
    os.environ["MASTER_PORT"] = str(ports[1])
    try:
        with distributed.process_group("cpu", ends=(KeyError,)):
            raise KeyError("a run's end")
    except KeyError:
        states.append(distributed.joined())
    os.environ["MASTER_PORT"] = str(ports[2])
    distributed.init_distributed("cpu")
    with distributed.process_group("cpu"):
        pass
    states.append(distributed.joined())
    distributed.shutdown()
    if rank == 0:
        np.save(result, np.array(states))
