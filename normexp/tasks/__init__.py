"""Tasks: what ``python -m normexp task=<name>`` does, behind one interface.

A task is registered by its own module (:func:`register_task`) as a :class:`Task`: its name, the data it
reads, the metrics its evaluation reports (the config schema checks ``data`` and ``trainer.best_metric``
against them), the one model it trains (``build``) and the one service it needs of the backbone (``need``,
one of the models' ``NEEDS``), its own checks before any work, the config it actually runs (``prepare``:
e.g. the checkpoint's model in place of the configured one -- applied before the run record is written, so
the record and the run directory name the model that runs), and what a run starting from one of its runs
reads from its checkpoint (``backbone_weights``) and how its model reads a batch (``model_input``).
Nothing outside a task's module compares task names: the schema, the start, the planner and ``normexp
analyze`` ask the registry.

The schema pass checks ``need`` against the backbone's class (nothing built); ``normexp.run`` builds
``build(prepared config)`` once on the meta device; a task's ``check`` builds nothing.

Every module of this package is imported on the first look-up, so a new task is one module (plus its model
code) and its yamls; a plugin module registers its tasks the same way (``plugins=[mytasks]``).
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from omegaconf import DictConfig
from torch import nn

from ..errors import UserError
from ..models import build_backbone
from ..models.base import CLASSIFICATION
from ..tracking.records import RunRecord


def _as_configured(cfg: DictConfig) -> DictConfig:
    return cfg


def build_classifier(cfg: DictConfig) -> nn.Module:
    """The configured backbone with its normalizer: the model a classification task trains."""
    return build_backbone(cfg.backbone, cfg.norm)


@dataclass(frozen=True)
class Task:
    """One task (see the module docstring).

    ``data``: the data configs it reads (empty: any); ``data_root``: whether it reads the data config's own
    dataset (False: the config gives only preprocessing and classes, as for evaluate). ``metrics(values)``:
    the metric names its evaluation reports for a resolved config (None: it does not train, and has no
    ``trainer.best_metric``).
    ``build(config)``: the model it trains, from its prepared config (default: the backbone as a classifier).
    ``need``: what it needs the backbone to serve (``normexp.models.base.NEEDS``; dense features: inputs of
    any size, the backbone's ``dense`` settings applied). ``starts_from``: the config key that names the run
    or checkpoint it starts from, if any (its completion is checked, its source recorded).
    ``backbone_weights(state, ema)``: the backbone's weights in a checkpoint of one of its runs (None: its
    checkpoints hold no backbone a run can start from or ``normexp analyze`` can rebuild);
    ``backbone_model(config)``: the model those weights fill, built from a run's config (None: the configured
    backbone, a classifier). ``settings(values)``: its own settings a table's dry run prints.
    ``model_input(config)``: how ``normexp analyze`` feeds a run's model its validation images (None: through
    the data's own transform, ``model(images)``).
    ``ranges``: its settings' types and ranges, ``task.<key>`` (dotted: nested) -> the checks of
    :func:`normexp.config.rng`, refused by the schema pass before any work.
    """

    name: str
    run: Callable[[DictConfig, RunRecord], dict[str, Any]]
    data: tuple[str, ...] = ()
    data_root: bool = True
    metrics: Callable[[dict[str, Any]], list[str]] | None = None
    check: Callable[[DictConfig], None] | None = None
    prepare: Callable[[DictConfig], DictConfig] = _as_configured
    build: Callable[[DictConfig], nn.Module] = build_classifier
    need: str = CLASSIFICATION
    starts_from: str | None = None
    backbone_weights: Callable[[dict[str, Any], bool | None], tuple[dict[str, Any], str]] | None = None
    backbone_model: Callable[[DictConfig], nn.Module] | None = None
    settings: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    model_input: Callable[[dict[str, Any]], ModelInput] | None = None
    ranges: dict[str, dict[str, Any]] = field(default_factory=dict)


@dataclass(frozen=True)
class ModelInput:
    """How a task's model reads a batch of validation images: their transform (an ``eval_transform`` of
    :func:`normexp.data.build_classification_data`; None: the data's own), the call from (model, images,
    labels, generator) to the model's output, any randomness it needs (a diffusion step, noise) drawn from
    the generator, and how the model sees them, in words (for figure captions; empty: as they are)."""

    transform: Callable[[Any], Any] | None
    forward: Callable[[nn.Module, torch.Tensor, torch.Tensor, torch.Generator], Any]
    described: str = ""


TASKS: dict[str, Task] = {}


def register_task(task: Task) -> Task:
    """Make ``task`` known by its name; a second, different task of the same name is refused in one line.
    A plugin's task registers after the shipped ones, so that it cannot take one's name by loading first."""
    if not task.run.__module__.startswith(f"{__name__}."):
        _import_task_modules()
    known = TASKS.get(task.name)
    if known is not None and known.run is not task.run:
        raise UserError(f"task '{task.name}' is registered twice ({known.run.__module__} and "
                        f"{task.run.__module__}): give the plugin's task a name of its own")
    TASKS[task.name] = task
    return task


@functools.cache
def _import_task_modules() -> None:
    """The shipped tasks, each registered by its module (once; a look-up lists them all)."""
    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")


def get_task(name: str) -> Task:
    _import_task_modules()
    if name not in TASKS:
        raise UserError(f"unknown task '{name}'; available: {', '.join(sorted(TASKS))}")
    return TASKS[name]


def prepare_config(cfg: DictConfig) -> DictConfig:
    """The config a task actually runs (e.g. a checkpoint's model in place of the configured one)."""
    return get_task(cfg.task.name).prepare(cfg)


def fit_and_record(trainer: Any, record: RunRecord, cfg: DictConfig) -> dict[str, Any]:
    """The tail every training task's run shares: fit, the evaluation-mode training loss where asked
    (``task.eval_train_loss``), the metrics and the throughput into the record."""
    metrics = trainer.fit()
    if cfg.task.get("eval_train_loss"):
        trainer.evaluate_fitting()
    record.update(metrics=metrics, images_per_s=round(trainer.images_per_s, 2))
    return metrics


def evaluated(values: dict[str, Any], names: list[str]) -> list[str]:
    """``val/<name>``, and ``ema/val/<name>`` when the EMA model is evaluated too."""
    prefixes = ["val", *(["ema/val"] if values["trainer"]["ema"]["enabled"] else [])]
    return [f"{prefix}/{name}" for prefix in prefixes for name in names]


def backbone_task(config: dict[str, Any] | None, source: Any, need: str = CLASSIFICATION) -> Task:
    """The task of the run that wrote ``source`` (its ``config``; a checkpoint without one: a classifier's),
    refused in one line when its checkpoints hold no backbone serving ``need`` to start from (a detector's
    dense backbone starts from a classifier's: its weights are the same)."""
    task = get_task((config or {}).get("task", {}).get("name", "classification"))

    def serves(t: Task) -> bool:
        return t.backbone_weights is not None and t.need == need

    if not serves(task):
        starters = ", ".join(sorted(name for name, t in TASKS.items() if serves(t)))
        what = ("no backbone" if task.backbone_weights is None
                else f"a {task.need} model, no {need} backbone")
        raise UserError(f"'{source}' is a {task.name} run, whose checkpoint holds {what} to start from: "
                        f"give a run of {starters}")
    return task
