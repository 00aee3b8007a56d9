"""One entry for every task: seeds, run record, loggers, dispatch. Nothing here touches Hydra."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from .engine.trainer import Diverged
from .errors import UserError
from .tasks import TASKS, prepare_config
from .tracking.provenance import seed_everything
from .tracking.records import MetricsMirror, RunRecord

log = logging.getLogger(__name__)


def build_mirrors(cfg: DictConfig, run_dir: Path, config: dict[str, Any]) -> list[MetricsMirror]:
    if cfg.logger.name == "none":
        return []
    if cfg.logger.name == "wandb":
        from .tracking.wandb import WandbMirror

        tags = [cfg.backbone.name, cfg.norm.name, cfg.task.name, cfg.data.name, *cfg.get("tags", [])]
        if cfg.get("table"):  # a table's run: its scale and seed too, so W&B groups seeds of one row
            tags += [f"scale:{cfg.table.scale}", f"seed:{cfg.seed}"]
        return [WandbMirror(cfg.logger, run_dir, config, name=cfg.name, tags=tags)]
    raise UserError(f"unknown logger '{cfg.logger.name}'; use logger=wandb or logger=none")


def run(cfg: DictConfig, run_dir: str | Path) -> dict[str, Any]:
    """Run ``cfg.task`` in ``run_dir``; the record is written whether the task completes, diverges or fails.

    Divergence is a result: the record ends ``diverged`` with the step and the last finite metrics, and
    this returns normally (exit code 0, so a sweep carries on).
    """
    run_dir = Path(run_dir)
    if cfg.task.name not in TASKS:
        raise UserError(f"unknown task '{cfg.task.name}'; available: {', '.join(TASKS)}")
    preparation_error = None
    try:
        cfg = prepare_config(cfg)
    except UserError as e:  # still recorded below, as a failed run of the config as given
        preparation_error = e
    config = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    seed_everything(cfg.seed)
    record = RunRecord(run_dir, config, build_mirrors(cfg, run_dir, config))
    try:
        if preparation_error is not None:
            raise preparation_error
        TASKS[cfg.task.name](cfg, record)
    except Diverged as d:
        log.warning("%s: %s", cfg.name, d)
        record.log({"step": d.step, "epoch": d.epoch, "train/loss": d.loss, "diverged": True})
        last = {"last_finite": d.last_finite} if d.last_finite else {}
        record.update(metrics={**d.metrics, **last},
                      diverged={"step": d.step, "epoch": d.epoch, "loss": d.loss})
        return record.finish("diverged", error=str(d))
    except BaseException as e:
        record.finish("failed", error=f"{type(e).__name__}: {e}".splitlines()[0])
        raise
    return record.finish("completed")
