"""The trainer's state in a checkpoint: what a killed run needs to go on exactly, mid-epoch included (RNG
states, position, metrics, task state, and each process's share by rank). The file format is
``checkpoint.py``'s."""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .. import distributed
from ..errors import UserError
from .checkpoint import checkpoint_file, load_checkpoint, save_checkpoint

if TYPE_CHECKING:
    from ..tracking.records import RunRecord

log = logging.getLogger(__name__)


def rng_state() -> dict[str, Any]:
    """This process's RNG states as tensors and plain values (loadable with ``weights_only=True``)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {"torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss),
            "python": random.getstate()}


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore the RNG states :func:`rng_state` returned."""
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))


def save_training_state(path: Path, state: dict[str, Any], is_main: bool) -> None:
    """Checkpoint ``state`` (``Trainer.state_dict()``, which every process took part in): process 0 writes."""
    if is_main:
        save_checkpoint(path, state)
    distributed.barrier()


def read_resume_state(record: RunRecord, source: str | None) -> tuple[dict[str, Any], str] | None:
    """The checkpoint to resume from and its source, or None (``auto``: the run directory's, if any; a path:
    that run's or file's)."""
    state = record.resume_state
    if state is None:
        if not source:
            return None
        if source == "auto":
            if not checkpoint_file(record.dir).is_file():
                return None
            source = str(record.dir)
        state = load_checkpoint(source)
    return state, str(record.dir if source == "auto" else source)


def this_process(processes: list[dict[str, Any]], rank: int, world_size: int, mid_epoch: bool,
                 source: str) -> dict[str, Any] | None:
    """This process's part of a checkpoint's ``processes``, or None when it came from another process count
    (mid-epoch that is an error)."""
    if len(processes) == world_size:
        return processes[rank]
    if mid_epoch:
        raise UserError(f"checkpoint '{source}' stopped mid-epoch with {len(processes)} processes: "
                        f"resume it with {len(processes)} (this job has {world_size})")
    log.warning("checkpoint from %d processes, resumed on %d: RNG streams restart", len(processes),
                world_size)
    return None
