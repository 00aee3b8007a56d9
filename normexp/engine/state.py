"""The trainer's state in a checkpoint: what a killed run needs to go on as if it had not been killed.

A checkpoint holds the model, EMA, optimizer, scheduler, scaler, the position in the epoch (epoch, batch,
update), the metrics so far, the task's own state (``Trainer.task_state``) and, from every process by rank,
its RNG states, its share of the epoch's loss and its divergence window -- so ``trainer.resume=auto``
continues mid-epoch exactly. The file format (atomic
writes, CRC-checked safe reads) is ``checkpoint.py``'s.
"""

from __future__ import annotations

import logging
import random
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .. import distributed
from ..errors import UserError
from ..tracking.provenance import config_hash
from .checkpoint import checkpoint_file, load_checkpoint, load_model_state, save_checkpoint

if TYPE_CHECKING:
    from .trainer import Trainer

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


def training_state(trainer: Trainer) -> dict[str, Any]:
    """Everything :func:`resume_training` restores (a collective: every process contributes its part)."""
    return {
        "run_id": config_hash(trainer.record.config),
        "epoch": trainer.epoch, "batch": trainer.batch, "update": trainer.update,
        "model": trainer.module.state_dict(),
        "optimizer": trainer.optimizer.state_dict(),
        "scheduler": trainer.scheduler.state_dict(),
        "ema": trainer.ema.module.state_dict() if trainer.ema is not None else None,
        "scaler": trainer.precision.scaler.state_dict() if trainer.precision.scaler is not None else None,
        "metrics": trainer.metrics,
        "task": trainer.task_state(),
        "train_images": trainer.train_images, "train_seconds": trainer.train_seconds,
        "config": trainer.record.config,
        # what each process holds alone, by rank: RNG states, its share of the epoch's loss, the window
        "processes": distributed.all_gather_objects({
            "rng": rng_state(), "epoch_loss": trainer.epoch_loss.cpu(), "epoch_seen": trainer.epoch_seen,
            "window": trainer.loss_window.state_dict()}),
    }


def save_training_state(trainer: Trainer) -> None:
    """Checkpoint (process 0 writes; every process contributes its RNG state)."""
    state = training_state(trainer)
    if trainer.dist.is_main:
        save_checkpoint(trainer.record.checkpoint_path, state)
    distributed.barrier()


def resume_training(trainer: Trainer, source: str | None) -> None:
    """``auto``: the run directory's checkpoint if there is one; a path: that run's or file's; None: nothing.

    Process 0 continues from the checkpoint ``normexp.run`` already read and verified (the record's
    ``resume_state``) when it decided the start; the other processes read the same file."""
    record = trainer.record
    state = record.resume_state
    if state is None:
        if not source:
            return
        if source == "auto":
            if not checkpoint_file(record.dir).is_file():
                return
            source = str(record.dir)
        state = load_checkpoint(source)
    source = str(record.dir if source == "auto" else source)
    load_model_state(trainer.module, state["model"], source)
    trainer.optimizer.load_state_dict(state["optimizer"])
    if trainer.ema is not None and state["ema"] is not None:
        trainer.ema.module.load_state_dict(state["ema"])
    if trainer.precision.scaler is not None and state["scaler"] is not None:
        trainer.precision.scaler.load_state_dict(state["scaler"])
    trainer.epoch, trainer.batch, trainer.update = state["epoch"], state["batch"], state["update"]
    trainer.scheduler.load_state_dict(state["scheduler"])
    # the schedule comes from the current config (as timm does), so a resumed run may extend epochs;
    # per epoch, fit() sets the epoch's lr before it continues
    if trainer.cfg.sched_on == "update":
        trainer.scheduler.step_update(trainer.update)
    trainer.metrics = state["metrics"]
    trainer.load_task_state(state.get("task"))
    trainer.train_images, trainer.train_seconds = state["train_images"], state["train_seconds"]
    processes, world_size = state["processes"], trainer.dist.world_size
    if len(processes) == world_size:
        mine = processes[trainer.dist.rank]
        set_rng_state(mine["rng"])
        trainer.epoch_loss = mine["epoch_loss"].to(trainer.device)
        trainer.epoch_seen = mine["epoch_seen"]
        trainer.loss_window.load_state_dict(mine["window"])
    elif trainer.batch:
        raise UserError(f"checkpoint '{source}' stopped mid-epoch with {len(processes)} processes: "
                        f"resume it with {len(processes)} (this job has {world_size})")
    else:
        log.warning("checkpoint from %d processes, resumed on %d: RNG streams restart", len(processes),
                    world_size)
    log.info("resumed from %s at epoch %d, update %d", source, trainer.epoch, trainer.update)
