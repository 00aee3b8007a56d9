"""Tasks: what ``python -m normexp task=<name>`` does, behind one interface.

A task prepares the config it actually runs (``prepare``: e.g. the checkpoint's model in place of the
configured one -- applied before the run record is written, so the record and the run directory name the
model that runs) and runs it into a record (``run``: returns its metrics).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig

from ..errors import UserError
from ..tracking.records import RunRecord
from .classification import run_classification
from .detection import run_detection, with_pretrained_backbone
from .robustness import run_robustness, with_checkpoint_model


def _as_configured(cfg: DictConfig) -> DictConfig:
    return cfg


@dataclass(frozen=True)
class Task:
    run: Callable[[DictConfig, RunRecord], dict[str, Any]]
    prepare: Callable[[DictConfig], DictConfig] = _as_configured


TASKS: dict[str, Task] = {
    "classification": Task(run_classification),
    "robustness": Task(run_robustness, prepare=with_checkpoint_model),
    "detection": Task(run_detection, prepare=with_pretrained_backbone),
}


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise UserError(f"unknown task '{name}'; available: {', '.join(TASKS)}")
    return TASKS[name]


def prepare_config(cfg: DictConfig) -> DictConfig:
    """The config a task actually runs (e.g. a checkpoint's model in place of the configured one)."""
    return get_task(cfg.task.name).prepare(cfg)
