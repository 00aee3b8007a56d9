"""The schema of a run's config: structured (dataclass) configs that every composed config must fit.

``validate(cfg)`` merges the resolved config into these dataclasses -- OmegaConf checks every type and
refuses every key the schema does not have -- then checks the ranges the fields declare in their metadata.
Any problem is one :class:`UserError` line naming the key, the bad value and what is allowed, raised before
any work (``normexp.run``): exit code 2, no traceback.

Groups whose keys depend on the option chosen (``backbone``: the model's constructor arguments, ``norm``:
the normalizer's hyper-parameters) are open here; their builders refuse unknown keys with the list of valid
ones. ``data`` has one schema per dataset.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from .errors import UserError


def rng(low: float | None = None, high: float | None = None, **kw: Any) -> dict[str, Any]:
    """Field metadata: an inclusive range (``low``/``high``), ``above`` (exclusive), ``choices``."""
    return {k: v for k, v in {"min": low, "max": high, **kw}.items() if v is not None}


def _f(default: Any, **check: Any) -> Any:
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: default, metadata=check)
    return field(default=default, metadata=check)


@dataclass
class MixupSchema:
    mixup_alpha: float = _f(0.0, **rng(0))
    cutmix_alpha: float = _f(0.0, **rng(0))
    prob: float = _f(1.0, **rng(0, 1))
    switch_prob: float = _f(0.5, **rng(0, 1))
    mode: str = _f("batch", choices=["batch", "pair", "elem"])


@dataclass
class EmaSchema:
    enabled: bool = False
    decay: float = _f(0.99996, **rng(0, 1))
    warmup: bool = False
    reported: bool = False


@dataclass
class TrainerSchema:
    epochs: int = _f(30, **rng(1))
    device: str = "auto"
    amp: str | None = _f(None, choices=["bf16", "fp16", None])
    opt: str = "adamw"
    lr: float = _f(2e-3, above=0)
    lr_base_size: int | None = _f(None, **rng(1))
    lr_scale_warmup_min: bool = True
    weight_decay: float = _f(0.05, **rng(0))
    decay_norm_and_bias: bool = False
    opt_eps: float = _f(1e-8, above=0)
    betas: list[float] = _f([0.9, 0.999])
    sched: str = _f("cosine", choices=["cosine", "multistep", "step", "plateau", "poly", "tanh"])
    sched_on: str = _f("update", choices=["update", "epoch"])
    sched_lag: int = _f(0, **rng(0, 1))
    warmup_prefix: bool = False
    cooldown_epochs: int = _f(0, **rng(0))
    decay_milestones: list[int] | None = None
    decay_rate: float = _f(0.1, above=0)
    warmup_epochs: float = _f(3, **rng(0))
    warmup_iters: int | None = _f(None, **rng(0))
    warmup_lr: float = _f(1e-6, **rng(0))
    min_lr: float = _f(1e-5, **rng(0))
    smoothing: float = _f(0.1, **rng(0, 1))
    mixup: MixupSchema = field(default_factory=MixupSchema)
    ema: EmaSchema = field(default_factory=EmaSchema)
    clip_grad: float | None = _f(None, above=0)
    clip_mode: str = _f("norm", choices=["norm", "value", "agc"])
    max_loss: float | None = _f(None, above=0)
    eval_interval: int = _f(1, **rng(1))
    best_metric: str = "val/top1"
    log_interval: int = _f(50, **rng(0))
    checkpoint: bool = True
    checkpoint_interval: int = _f(0, **rng(0))
    resume: str | None = None
    progress: Any = _f("auto", choices=["auto", True, False])
    accum_steps: int = _f(1, **rng(1))
    global_batch: int | None = _f(None, **rng(1))
    sync_bn: bool = False
    find_unused_parameters: bool = False
    compile: bool = False
    channels_last: bool = False


@dataclass
class LoaderFields:
    """What every dataset's config has."""

    name: str = "???"
    img_size: int = _f(16, **rng(1))
    num_classes: int = _f(10, **rng(1))
    batch_size: int = _f(64, **rng(1))
    eval_batch_size: int = _f(256, **rng(1))
    num_workers: int = _f(0, **rng(0))


@dataclass
class DigitsSchema(LoaderFields):
    val_fraction: float = _f(0.2, above=0, max=0.9)
    split_seed: int = 0
    imagenet_c_root: str | None = None


@dataclass
class ImageNetSchema(LoaderFields):
    root: str | None = None
    imagenet_c_root: str | None = None
    train_split: str = "train"
    val_split: str = "val"
    pin_memory: bool = True
    auto_augment: str | None = None
    color_jitter: float | None = _f(0.3, **rng(0))
    interpolation: str = "bicubic"
    train_interpolation: str | None = None
    reprob: float = _f(0.25, **rng(0, 1))
    remode: str = _f("pixel", choices=["pixel", "rand", "const"])
    recount: int = _f(1, **rng(1))
    crop_pct: float = _f(0.875, above=0, max=1)
    mean: list[float] = _f([0.485, 0.456, 0.406])
    std: list[float] = _f([0.229, 0.224, 0.225])
    aug_repeats: int = _f(0, **rng(0))
    on_bad_image: str = _f("skip", choices=["skip", "fail"])


@dataclass
class CocoSchema(LoaderFields):
    root: str | None = None
    train_split: str = "train2017"
    val_split: str = "val2017"
    min_size: Any = 800  # shorter side; a list: one drawn per training image (multi-scale)
    max_size: int = _f(1333, **rng(1))
    mean: list[float] = _f([0.485, 0.456, 0.406])
    std: list[float] = _f([0.229, 0.224, 0.225])
    hflip: float = _f(0.5, **rng(0, 1))
    filter_empty_gt: bool = True
    min_image_size: int = _f(32, **rng(0))


@dataclass
class CocoDigitsSchema(CocoSchema):
    canvas_size: int = _f(96, **rng(32))
    num_train: int = _f(1000, **rng(1))
    num_val: int = _f(200, **rng(1))
    digits_per_image: list[int] = _f([2, 4])
    digit_size: list[int] = _f([12, 28])
    max_overlap: float = _f(0.3, **rng(0, 1))
    generator_seed: int = 0


DATA_SCHEMAS: dict[str, type] = {"digits": DigitsSchema, "imagenet": ImageNetSchema, "coco": CocoSchema,
                                 "coco_digits": CocoDigitsSchema}


@dataclass
class RunSchema:
    seed: int = 0
    name: str = "???"
    tags: list[str] = field(default_factory=list)
    trainer: TrainerSchema = field(default_factory=TrainerSchema)
    backbone: dict[str, Any] = field(default_factory=dict)
    norm: dict[str, Any] = field(default_factory=dict)
    data: dict[str, Any] = field(default_factory=dict)
    task: dict[str, Any] = field(default_factory=dict)
    logger: dict[str, Any] = field(default_factory=dict)
    table: dict[str, Any] | None = None
    launcher: dict[str, Any] | None = None


def _schema_at(schema: type, path: list[str]) -> type:
    """The dataclass that holds the key at ``path`` (its parent's schema)."""
    for name in path[:-1]:
        nested = next((f.default_factory for f in fields(schema) if f.name == name), None)
        if not (isinstance(nested, type) and is_dataclass(nested)):
            break
        schema = nested
    return schema


def _merge(schema: type, values: Any, where: str) -> Any:
    try:
        return OmegaConf.merge(OmegaConf.structured(schema), values)
    except OmegaConfBaseException as e:
        inner = getattr(e, "full_key", None) or ""
        key = ".".join(k for k in (where, inner) if k)
        first = str(e).strip().splitlines()[0]
        if isinstance(e, ConfigKeyError):
            parent, _, _ = key.rpartition(".")
            allowed = ", ".join(f.name for f in fields(_schema_at(schema, inner.split("."))))
            raise UserError(f"unknown config key {key}: {parent or 'the config'} has {allowed}") from None
        raise UserError(f"bad value for {key}: {first}") from None


def _check_ranges(schema: type, values: DictConfig, where: str) -> None:
    for f in fields(schema):
        value = values[f.name]
        key = f"{where}.{f.name}" if where else f.name
        if is_dataclass(f.type) or (isinstance(f.default_factory, type) and is_dataclass(f.default_factory)):
            _check_ranges(f.default_factory, value, key)  # type: ignore[arg-type]
            continue
        check, shown = f.metadata, f"{key}={value}"
        if "choices" in check and value not in check["choices"]:
            allowed = ", ".join("null" if c is None else str(c).lower() if isinstance(c, bool) else str(c)
                                for c in check["choices"])
            raise UserError(f"{shown}: must be one of {allowed}")
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if "min" in check and value < check["min"]:
            raise UserError(f"{shown}: must be >= {check['min']}")
        if "max" in check and value > check["max"]:
            raise UserError(f"{shown}: must be <= {check['max']}")
        if "above" in check and value <= check["above"]:
            raise UserError(f"{shown}: must be > {check['above']}")


def _check_trainer(t: DictConfig) -> None:
    """What one field cannot say alone: settings of the trainer that depend on each other."""
    if t.ema.reported and not t.ema.enabled:
        raise UserError("trainer.ema.reported=true needs trainer.ema.enabled=true (the reported weights are "
                        "the EMA's)")
    if t.sched_on == "epoch" and t.warmup_iters:
        raise UserError(f"trainer.warmup_iters={t.warmup_iters} needs trainer.sched_on=update (with "
                        "sched_on=epoch the lr changes once per epoch: use trainer.warmup_epochs)")
    schedule = t.epochs - t.cooldown_epochs - (t.warmup_epochs if t.warmup_prefix else 0)
    if schedule <= 0:
        raise UserError(f"trainer.epochs={t.epochs} leaves no epochs for the schedule after "
                        f"cooldown_epochs={t.cooldown_epochs}"
                        + (f" and the warm-up prefix ({t.warmup_epochs} epochs)" if t.warmup_prefix else ""))


def validate(cfg: DictConfig) -> None:
    """Refuse a config that does not fit the schema, in one line naming the key and what is allowed."""
    try:
        values = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", "") or ""
        raise UserError(f"config key {key} cannot be resolved: {str(e).strip().splitlines()[0]}") from None
    run = _merge(RunSchema, values, "")
    _check_ranges(RunSchema, run, "")
    _check_trainer(run.trainer)
    data_schema = DATA_SCHEMAS.get(values.get("data", {}).get("name"))
    if data_schema is not None:
        data = _merge(data_schema, values["data"], "data")
        _check_ranges(data_schema, data, "data")
