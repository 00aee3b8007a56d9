"""Tasks: what ``python -m normexp task=<name>`` does, behind one interface.

A task names the data it reads and the metrics its evaluation reports (the config schema checks
``data`` and ``trainer.best_metric`` against them), checks its own settings before any work (``check``),
prepares the config it actually runs (``prepare``: e.g. the checkpoint's model in place of the configured
one -- applied before the run record is written, so the record and the run directory name the model that
runs) and runs it into a record (``run``: returns its metrics).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig

from ..errors import UserError
from ..metrics.coco import STATS
from ..tracking.records import RunRecord
from .classification import check_classification, run_classification
from .detection import check_detection, run_detection, with_pretrained_backbone
from .robustness import check_robustness, run_robustness, with_checkpoint_model


def _as_configured(cfg: DictConfig) -> DictConfig:
    return cfg


def _evaluated(values: dict[str, Any], names: list[str]) -> list[str]:
    """``val/<name>``, and ``ema/val/<name>`` when the EMA model is evaluated too."""
    prefixes = ["val", *(["ema/val"] if values["trainer"]["ema"]["enabled"] else [])]
    return [f"{prefix}/{name}" for prefix in prefixes for name in names]


def classification_metrics(values: dict[str, Any]) -> list[str]:
    return _evaluated(values, ["top1", "top5", "loss"])


def detection_metrics(values: dict[str, Any]) -> list[str]:
    kinds = ["bbox", *(["segm"] if values["task"].get("detector") == "mask_rcnn" else [])]
    return _evaluated(values, [f"{kind}_{stat}" for kind in kinds for stat in STATS])


@dataclass(frozen=True)
class Task:
    run: Callable[[DictConfig, RunRecord], dict[str, Any]]
    data: tuple[str, ...]  # the data configs it reads
    metrics: Callable[[dict[str, Any]], list[str]] | None = None  # what its evaluation reports; None: no
    #                                                               training, no trainer.best_metric
    check: Callable[[DictConfig], None] | None = None  # its own settings, before any work
    prepare: Callable[[DictConfig], DictConfig] = _as_configured


TASKS: dict[str, Task] = {
    "classification": Task(run_classification, ("digits", "imagenet"), classification_metrics,
                           check_classification),
    "robustness": Task(run_robustness, ("digits", "imagenet"), check=check_robustness,
                       prepare=with_checkpoint_model),
    "detection": Task(run_detection, ("coco", "coco_digits"), detection_metrics, check_detection,
                      prepare=with_pretrained_backbone),
}


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise UserError(f"unknown task '{name}'; available: {', '.join(TASKS)}")
    return TASKS[name]


def prepare_config(cfg: DictConfig) -> DictConfig:
    """The config a task actually runs (e.g. a checkpoint's model in place of the configured one)."""
    return get_task(cfg.task.name).prepare(cfg)
