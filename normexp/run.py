"""One entry for every task: validate, prepare, seed, record, dispatch. Nothing here touches Hydra.

In a distributed job every process runs this; process 0 alone writes the record, its directory and the
loggers, and every process uses that directory.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from .config import validate
from .engine import distributed
from .engine.trainer import Diverged, Interrupted
from .errors import UserError, one_line
from .tasks import get_task
from .tracking.provenance import seed_everything
from .tracking.records import MetricsMirror, RunRecord, run_tags

log = logging.getLogger(__name__)


MIRRORS = {"wandb": ("normexp.tracking.wandb", "WandbMirror"),
           "mlflow": ("normexp.tracking.mlflow", "MlflowMirror")}


def build_mirrors(cfg: DictConfig, run_dir: Path, config: dict[str, Any]) -> list[MetricsMirror]:
    """The loggers of ``cfg.logger`` (none, one or several: ``logger=[wandb,mlflow]``), each mirroring the
    record; imported only when used."""
    import importlib

    loggers = cfg.get("logger") or {}
    unknown = sorted(set(loggers) - set(MIRRORS))
    if unknown:
        raise UserError(f"unknown logger(s) {unknown}; use logger=wandb, mlflow, none or a list of them")
    mirrors = []
    for name, settings in loggers.items():
        module, cls = MIRRORS[name]
        mirror = getattr(importlib.import_module(module), cls)
        mirrors.append(mirror(settings, run_dir, config, name=cfg.name, tags=run_tags(config)))
    return mirrors


def named_after(run_dir: Path, configured: str, prepared: str) -> Path:
    """The run directory renamed after the model that runs, when Hydra named it after the configured one
    (``task=robustness`` evaluating a checkpoint of another model). Process 0 renames; all agree."""
    new = run_dir
    if configured != prepared and run_dir.name.endswith(configured):
        new = run_dir.with_name(run_dir.name[: -len(configured)] + prepared)
        if distributed.info().is_main:
            if new.exists():
                new = run_dir
            else:
                run_dir.rename(new)
    return Path(distributed.broadcast_object(str(new)))


def run(cfg: DictConfig, run_dir: str | Path) -> dict[str, Any]:
    """Run ``cfg.task`` in ``run_dir``; the record is written whether the task completes, diverges or fails.

    Divergence is a result: the record ends ``diverged`` with the step and the last finite metrics, and
    this returns normally (exit code 0, so a sweep carries on). A stop signal ends it ``interrupted``
    after the trainer's checkpoint (:class:`Interrupted` propagates).
    """
    run_dir = Path(run_dir)
    preparation_error = None
    try:
        validate(cfg)
        task = get_task(cfg.task.name)
        prepared = task.prepare(cfg)
        run_dir = named_after(run_dir, cfg.name, prepared.name)
        cfg = prepared
    except UserError as e:  # still recorded below, as a failed run of the config as given
        preparation_error = e
    world = distributed.init_distributed(cfg.trainer.device)
    config = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    if preparation_error is None:  # every process its own augmentation; DDP shares process 0's init
        seed_everything(cfg.seed + world.rank)
    mirrors = build_mirrors(cfg, run_dir, config) if world.is_main and preparation_error is None else []
    record = RunRecord(run_dir, config, mirrors, writes=world.is_main)
    try:
        if preparation_error is not None:
            raise preparation_error
        task.run(cfg, record)
    except Diverged as d:
        log.warning("%s: %s", cfg.name, d)
        record.log({"step": d.step, "epoch": d.epoch, "train/loss": d.loss, "diverged": True})
        last = {"last_finite": d.last_finite} if d.last_finite else {}
        record.update(metrics={**d.metrics, **last},
                      diverged={"step": d.step, "epoch": d.epoch, "loss": d.loss})
        return record.finish("diverged", error=str(d))
    except Interrupted as e:
        record.finish("interrupted", error=str(e))
        e.hand_over()  # submitit requeues the job here; otherwise the process ends with the signal's code
        raise
    except BaseException as e:
        record.finish("failed", error=f"{type(e).__name__}: {one_line(e)}")
        raise
    return record.finish("completed")
