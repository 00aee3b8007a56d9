"""Tasks: each takes the resolved config and the run record, and returns its metrics."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from omegaconf import DictConfig

from .classification import run_classification
from .detection import run_detection, with_pretrained_backbone
from .robustness import run_robustness, with_checkpoint_model

TASKS: dict[str, Callable[..., dict[str, Any]]] = {
    "classification": run_classification,
    "robustness": run_robustness,
    "detection": run_detection,
}

# Config changes a task makes before its record is written, so that the record shows what actually runs
# (robustness: the checkpoint's model replaces the configured one; detection: the pretrained run's backbone).
PREPARE_CONFIG: dict[str, Callable[[DictConfig], DictConfig]] = {
    "robustness": with_checkpoint_model,
    "detection": with_pretrained_backbone,
}


def prepare_config(cfg: DictConfig) -> DictConfig:
    """The config a task actually runs (e.g. a checkpoint's model in place of the configured one)."""
    prepare = PREPARE_CONFIG.get(cfg.task.name)
    return prepare(cfg) if prepare else cfg
