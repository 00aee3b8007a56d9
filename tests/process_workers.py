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
    loss.update_center(torch.from_numpy(np.array_split(outputs, world)[rank]))
    if rank == 0:
        np.save(result, loss.center.numpy())
