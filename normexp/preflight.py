"""The one validation pass every config goes through before any work (``normexp.run`` calls it first).

``validate(cfg)`` checks, before any model, data or file is built:

1. every interpolation resolves; then the plugins are imported (``normexp.plugins``: the installed
   packages' and the config's ``plugins``), so that a user's normalizers and backbones are registered in
   every process that validates -- every process that builds a model -- before any name is looked up;
2. every value fits the schema (``normexp.config``): types, ranges, choices; unknown keys are refused; every
   float is finite and every integer fits in 64 bits; the task's settings fit its ranges (``Task.ranges``);
3. values that depend on one another: the task and its data, the metric ``trainer.best_metric`` ranks by,
   the optimizer, the global batch, Mixup's pairs, the backbone's input size, the service the task needs
   of the backbone (``Task.need`` against its class's ``serves``, nothing built) -- asked of the task
   registry (``normexp.tasks.get_task``);
4. with ``environment=True``, what this machine must provide: the data at ``data.root`` (layout, class
   count), the device, the task's own inputs (a reference run; the run it starts from, completed).

``normexp.run`` then builds the model the task trains (``Task.build``) once on the meta device: what
only the model knows (a group count that must divide every width) is refused there, still before anything
is written. Any problem is one :class:`UserError` line naming the key, the bad value and what is allowed:
exit code 2, no traceback.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterator
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from .config import DATA_SCHEMAS, RunSchema, check_numbers, check_value, fit_schema, norm_schema
from .data import check_data
from .distributed import DistInfo, launcher_env
from .engine.batches import accumulation_steps
from .errors import UserError
from .models.base import DENSE_FEATURES
from .models.build import name_patterns
from .models.registry import class_serves, list_models, serving
from .plugins import load_plugins
from .tasks import TASKS, get_task
from .tasks.pretrained import check_source_completed
from .tracking import LOGGER_CLASSES


# ---------------------------------------------------------------- values that depend on one another
def _trainer(values: dict[str, Any]) -> Iterator[str]:
    t = values["trainer"]
    if t["ema"]["reported"] and not t["ema"]["enabled"]:
        yield "trainer.ema.reported=true needs trainer.ema.enabled=true (the reported weights are the EMA's)"
    if t["sched_on"] == "epoch" and t["warmup_iters"]:
        yield (f"trainer.warmup_iters={t['warmup_iters']} needs trainer.sched_on=update (with sched_on=epoch "
               "the lr changes once per epoch: use trainer.warmup_epochs)")
    warmup = t["warmup_epochs"] if t["warmup_prefix"] else 0
    if t["epochs"] - t["cooldown_epochs"] - warmup <= 0:
        yield (f"trainer.epochs={t['epochs']} leaves no epochs for the schedule after "
               f"cooldown_epochs={t['cooldown_epochs']}"
               + (f" and the warm-up prefix ({t['warmup_epochs']} epochs)" if t["warmup_prefix"] else ""))


def _task_and_data(values: dict[str, Any]) -> Iterator[str]:
    task, data = get_task(values["task"]["name"]), values["data"].get("name")
    if task.data and data not in task.data:
        yield (f"task={values['task']['name']} reads {' or '.join(f'data={d}' for d in task.data)}, "
               f"not data={data}")
    name = values["backbone"].get("name")
    served = class_serves(name) if name in list_models() else None  # an unknown name: the build says so
    if served is not None and task.need not in served:
        tasks = sorted(n for n, t in TASKS.items() if t.need in served)
        users = f" (for task={', '.join(tasks)})" if tasks else ""
        others = ", ".join(name_patterns(serving(task.need)))
        yield (f"backbone={name} serves {', '.join(sorted(served))}{users}, not {task.need}: "
               f"task={task.name} needs a backbone that serves {task.need} ({others})")
    metrics = task.metrics(values) if task.metrics else None
    best = values["trainer"]["best_metric"]
    if metrics is not None and best not in metrics:
        close = difflib.get_close_matches(best, metrics, n=1)
        yield (f"trainer.best_metric={best}: {'did you mean ' + close[0] + '? ' if close else ''}"
               f"task={values['task']['name']} reports {', '.join(metrics)}")


def _task_settings(values: dict[str, Any]) -> Iterator[str]:
    """The task's settings against its ranges (``Task.ranges``): types and bounds of the open group."""
    settings = values["task"]
    for key, check in get_task(settings["name"]).ranges.items():
        value = OmegaConf.select(OmegaConf.create(settings), key, default=None)
        try:
            check_value(f"task.{key}", value, check)
        except UserError as e:
            yield str(e)


def _batches(values: dict[str, Any]) -> Iterator[str]:
    trainer, batch = values["trainer"], values["data"]["batch_size"]
    mixup = trainer["mixup"]
    if (mixup["mixup_alpha"] > 0 or mixup["cutmix_alpha"] > 0) and batch % 2:
        yield (f"data.batch_size={batch}: Mixup / CutMix (trainer.mixup) mix each batch with itself reversed "
               f"and need an even batch per process: use data.batch_size={batch + 1} or {batch - 1}")
    world = (launcher_env() or DistInfo()).world_size  # DistInfo(): one process
    try:
        accumulation_steps(trainer["global_batch"], batch, world, trainer["accum_steps"])
    except UserError as e:
        yield str(e)


def _input_size(values: dict[str, Any]) -> Iterator[str]:
    backbone, data = values["backbone"], values["data"]
    img, patch = backbone.get("img_size"), backbone.get("patch_size")
    if isinstance(img, int) and isinstance(patch, int) and patch > 0 and img % patch:
        yield (f"backbone.img_size={img} is not a multiple of backbone.patch_size={patch}: use an image size "
               f"of {img // patch * patch or patch} or {(img // patch + 1) * patch} (data.img_size; the "
               "backbone's follows it)")
    dense = get_task(values["task"]["name"]).need == DENSE_FEATURES  # any size: detectors resize
    fixed = not dense and not backbone.get("dynamic_img_size")
    if fixed and isinstance(img, int) and img != data.get("img_size"):
        yield (f"backbone.img_size={img} but the images are data.img_size={data.get('img_size')} px: set "
               "data.img_size (the backbone's follows it), not backbone.img_size")


def _probes(values: dict[str, Any]) -> Iterator[str]:
    from .engine.probes import unknown_probes

    problem = unknown_probes(values["task"].get("probes"))
    if problem:
        yield problem


def _loggers(values: dict[str, Any]) -> Iterator[str]:
    unknown = sorted(set(values.get("logger") or {}) - set(LOGGER_CLASSES))
    if unknown:
        yield f"unknown logger(s) {unknown}; use logger=wandb, mlflow, none or a list of them"


CROSS_CHECKS: tuple[Callable[[dict[str, Any]], Iterator[str]], ...] = (
    _trainer, _task_and_data, _task_settings, _batches, _input_size, _probes, _loggers)


# ---------------------------------------------------------------- what the machine must provide
def _device_available(cfg: DictConfig) -> None:
    import torch

    device = cfg.trainer.device
    if not str(device).startswith("cuda"):
        return
    if not torch.cuda.is_available():
        raise UserError(f"trainer.device={device} but CUDA is not available; use trainer.device=cpu or auto")
    index = torch.device(device).index
    if index is not None and index >= torch.cuda.device_count():
        raise UserError(f"trainer.device={device}: this machine has {torch.cuda.device_count()} CUDA "
                        "device(s)")


def check_environment(cfg: DictConfig) -> None:
    """The data at its root (where the task reads it), the device, the task's own inputs (the run it starts
    from: completed)."""
    task = get_task(cfg.task.name)
    if task.data_root:
        check_data(cfg.data)
    _device_available(cfg)
    check_source_completed(cfg, task)
    if task.check is not None:
        task.check(cfg)


# ---------------------------------------------------------------- the one pass
def resolve(cfg: DictConfig) -> dict[str, Any]:
    """The resolved config as plain containers; an interpolation that does not resolve is one line."""
    try:
        return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", "") or ""
        first = str(e).strip().splitlines()[0]
        raise UserError(f"config key {key} cannot be resolved: {first}") from None


def validate(cfg: DictConfig, environment: bool = True) -> None:
    """Refuse a config that does not fit the schema, in one line naming the key and what is allowed.

    ``environment=False``: the config alone (e.g. when planning a table on a machine without its data)."""
    values = resolve(cfg)
    check_numbers(values, "")
    fit_schema(RunSchema, values, "")
    load_plugins(values["plugins"])  # a user's normalizers and backbones, before any name is looked up
    data_schema = DATA_SCHEMAS.get(values["data"].get("name"))
    if data_schema is not None:
        fit_schema(data_schema, values["data"], "data")
    norm = values["norm"]
    try:
        schema = norm_schema(norm.get("name"))
    except ValueError as e:  # an unknown normalizer
        raise UserError(f"norm.name={norm.get('name')}: {e}") from None
    if schema is not None:
        fit_schema(schema, norm, "norm")
    for check in CROSS_CHECKS:
        for problem in check(values):
            raise UserError(problem)
    if environment:
        check_environment(cfg)
