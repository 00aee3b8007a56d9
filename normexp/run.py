"""One entry for every task: seeds, run record, loggers, dispatch. Nothing here touches Hydra."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from .errors import UserError
from .tasks import PREPARE_CONFIG, TASKS
from .tracking.provenance import seed_everything
from .tracking.records import MetricsMirror, RunRecord

log = logging.getLogger(__name__)


def build_mirrors(cfg: DictConfig, run_dir: Path, config: dict[str, Any]) -> list[MetricsMirror]:
    if cfg.logger.name == "none":
        return []
    if cfg.logger.name == "wandb":
        from .tracking.wandb import WandbMirror

        tags = [cfg.backbone.name, cfg.norm.name, cfg.task.name, cfg.data.name, *cfg.get("tags", [])]
        return [WandbMirror(cfg.logger, run_dir, config, name=cfg.name, tags=tags)]
    raise UserError(f"unknown logger '{cfg.logger.name}'; use logger=wandb or logger=none")


def run(cfg: DictConfig, run_dir: str | Path) -> dict[str, Any]:
    """Run ``cfg.task`` in ``run_dir``; the record is written whether the task completes or fails."""
    run_dir = Path(run_dir)
    if cfg.task.name not in TASKS:
        raise UserError(f"unknown task '{cfg.task.name}'; available: {', '.join(TASKS)}")
    preparation_error = None
    if cfg.task.name in PREPARE_CONFIG:
        try:
            cfg = PREPARE_CONFIG[cfg.task.name](cfg)
        except UserError as e:  # still recorded below, as a failed run of the config as given
            preparation_error = e
    config = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    seed_everything(cfg.seed)
    record = RunRecord(run_dir, config, build_mirrors(cfg, run_dir, config))
    try:
        if preparation_error is not None:
            raise preparation_error
        TASKS[cfg.task.name](cfg, record)
    except BaseException as e:
        record.finish("failed", error=f"{type(e).__name__}: {e}".splitlines()[0])
        raise
    return record.finish("completed")
