"""The schema of a run's config: the dataclasses (the top level, the trainer, each dataset), each
normalizer's options derived from its constructor (:func:`norm_schema`), and the checks of one value against
its field (:func:`fit_schema`). It reads no task, engine, data or tracking code: the checks that need them
(values that depend on one another, what the machine must provide) are ``normexp.preflight``'s.

The ``backbone`` and ``task`` groups are open here (their keys are the model's constructor arguments and
the task's settings); their builders refuse what they cannot use. ``data`` has one schema per dataset.
"""

from __future__ import annotations

import copy
import difflib
import math
import typing
from collections.abc import Callable
from dataclasses import MISSING, Field, dataclass, field, fields, is_dataclass, make_dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from . import CONFIG_DIR
from .errors import UserError

INT64_MAX = 2**63 - 1


def rng(low: float | None = None, high: float | None = None, **kw: Any) -> dict[str, Any]:
    """Field metadata: an inclusive range (``low``/``high``), ``above``/``below`` (exclusive), ``choices``,
    ``length`` (of a list), ``items`` (checks for each element), ``check`` (a function returning what is
    wrong, or None), ``type`` (``int`` or ``float``: for the open groups' keys, which no dataclass types)."""
    return {k: v for k, v in {"min": low, "max": high, **kw}.items() if v is not None}


def checked_field(default: Any, **check: Any) -> Any:
    """A dataclass field with its default and its checks (:func:`rng`'s metadata)."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: default, metadata=check)
    return field(default=default, metadata=check)


def _device(value: str) -> str | None:
    import torch

    if value == "auto":
        return None
    try:
        torch.device(value)
    except (RuntimeError, ValueError):
        return "must be auto, cpu, cuda, cuda:<index> or another torch device"
    return None


def _optimizer(value: str) -> str | None:
    from timm.optim import list_optimizers

    from . import optim  # noqa: F401  (registers normexp's optimizers with timm's)

    known = list_optimizers()
    name = value.lower().split("_")[-1]  # timm's prefixes: lookahead_adamw
    if name in known:
        return None
    close = difflib.get_close_matches(name, known, n=3)
    return f"not an optimizer timm knows ({'did you mean ' + ', '.join(close) + '? ' if close else ''}" \
        "see timm.optim.list_optimizers())"


# The trainer's defaults have one source, configs/trainer/default.yaml (where each is documented): the
# schema below gives each key its type and checks, and takes its default from that file at import.
TRAINER_YAML = CONFIG_DIR / "trainer" / "default.yaml"
TRAINER_DEFAULTS: dict[str, Any] = OmegaConf.to_container(OmegaConf.load(TRAINER_YAML))


def _check(**check: Any) -> Any:
    """A field's checks (see ``rng``) without a default: ``defaults_from`` gives it one."""
    return field(metadata=check)


def defaults_from(values: dict[str, Any]) -> Callable[[type], type]:
    """Class decorator, below ``@dataclass``: every field's default is its value in ``values`` (unresolved).
    A field ``values`` lacks, or a key of ``values`` with no field, is an error at import: the two cannot
    drift apart. A field with a default of its own (a nested schema) keeps it."""

    def apply(cls: type) -> type:
        names = list(cls.__dict__.get("__annotations__", {}))
        if set(names) != set(values):
            raise RuntimeError(f"{cls.__name__} and its defaults differ: fields without a default "
                               f"{sorted(set(names) - set(values))}, defaults without a field "
                               f"{sorted(set(values) - set(names))}")
        for name in names:
            f = cls.__dict__.get(name)
            f = f if isinstance(f, Field) else field()
            if f.default is MISSING and f.default_factory is MISSING:
                value = values[name]
                if isinstance(value, (list, dict)):
                    f.default_factory = lambda value=value: copy.deepcopy(value)
                else:
                    f.default = value
            setattr(cls, name, f)
        return cls

    return apply


@dataclass
@defaults_from(TRAINER_DEFAULTS["mixup"])
class MixupSchema:
    mixup_alpha: float = _check(**rng(0))
    cutmix_alpha: float = _check(**rng(0))
    prob: float = _check(**rng(0, 1))
    switch_prob: float = _check(**rng(0, 1))
    mode: str = _check(choices=["batch", "pair", "elem"])


@dataclass
@defaults_from(TRAINER_DEFAULTS["ema"])
class EmaSchema:
    enabled: bool
    decay: float = _check(**rng(0, 1))
    warmup: bool
    reported: bool


@dataclass
@defaults_from(TRAINER_DEFAULTS)
class TrainerSchema:
    epochs: int = _check(**rng(1))
    device: str = _check(check=_device)
    amp: str | None = _check(choices=["bf16", "fp16", None])
    tf32: bool
    opt: str = _check(check=_optimizer)
    lr: float = _check(above=0)
    lr_base_size: int | None = _check(**rng(1))
    lr_factor: float = _check(above=0)
    lr_scale_warmup_min: bool
    weight_decay: float = _check(**rng(0))
    decay_norm_and_bias: bool
    layer_decay: float | None = _check(above=0, max=1)
    opt_eps: float = _check(above=0)
    betas: list[float] = _check(length=2, items=rng(0, below=1))
    sched: str = _check(choices=["cosine", "multistep", "step", "plateau", "poly", "tanh"])
    sched_on: str = _check(choices=["update", "epoch"])
    sched_lag: int = _check(**rng(0, 1))
    warmup_prefix: bool
    cooldown_epochs: int = _check(**rng(0))
    decay_milestones: list[int] | None = _check(items=rng(0))
    decay_epochs: float | None = _check(above=0)
    decay_rate: float = _check(above=0)
    warmup_epochs: float = _check(**rng(0))
    warmup_iters: int | None = _check(**rng(0))
    warmup_lr: float = _check(**rng(0))
    min_lr: float = _check(**rng(0))
    smoothing: float = _check(**rng(0, below=1))
    mixup: MixupSchema = field(default_factory=MixupSchema)
    ema: EmaSchema = field(default_factory=EmaSchema)
    clip_grad: float | None = _check(above=0)
    clip_mode: str = _check(choices=["norm", "value", "agc", "param"])
    max_loss: float | None = _check(above=0)
    eval_interval: int = _check(**rng(1))
    best_metric: str  # one of the task's metrics: checked against the task below
    log_interval: int = _check(**rng(0))
    checkpoint: bool
    checkpoint_interval: int = _check(**rng(0))
    resume: str | None
    progress: Any = _check(choices=["auto", True, False])
    accum_steps: int = _check(**rng(1))
    global_batch: int | None = _check(**rng(1))
    sync_bn: bool
    find_unused_parameters: bool
    compile: bool
    channels_last: bool


@dataclass
class LoaderFields:
    """What every dataset's config has. A dataset's values have one source, its yaml
    (configs/data/<name>.yaml, where each is documented): its schema gives each key a type and checks only."""

    name: str
    img_size: int = _check(**rng(1))
    num_classes: int = _check(**rng(1))
    batch_size: int = _check(**rng(1))
    eval_batch_size: int = _check(**rng(1))
    num_workers: int = _check(**rng(0))


@dataclass
class DigitsSchema(LoaderFields):
    train_fraction: float = _check(above=0, max=1)
    val_fraction: float = _check(above=0, max=0.9)
    split_seed: int
    imagenet_c_root: str | None


@dataclass
class ImageNetSchema(LoaderFields):
    train_fraction: float = _check(above=0, max=1)
    root: str | None
    imagenet_c_root: str | None
    train_split: str
    val_split: str
    pin_memory: bool
    auto_augment: str | None
    color_jitter: float | None = _check(**rng(0))
    interpolation: str
    crop_sampler: str = _check(choices=["torchvision", "tf"])
    train_interpolation: str | None
    reprob: float = _check(**rng(0, 1))
    remode: str = _check(choices=["pixel", "rand", "const"])
    recount: int = _check(**rng(1))
    crop_pct: float = _check(above=0, max=1)
    mean: list[float] = _check(length=3)
    std: list[float] = _check(length=3, items=rng(above=0))
    aug_repeats: int = _check(**rng(0))
    on_bad_image: str = _check(choices=["skip", "fail"])


@dataclass
class CocoSchema(LoaderFields):
    root: str | None
    train_split: str
    val_split: str
    min_size: Any  # shorter side; a list: one drawn per training image (multi-scale)
    max_size: int = _check(**rng(1))
    mean: list[float] = _check(length=3)
    std: list[float] = _check(length=3, items=rng(above=0))
    hflip: float = _check(**rng(0, 1))
    filter_empty_gt: bool
    min_image_size: int = _check(**rng(0))
    on_bad_image: str = _check(choices=["skip", "fail"])


@dataclass
class CocoDigitsSchema(CocoSchema):
    canvas_size: int = _check(**rng(32))
    num_train: int = _check(**rng(1))
    num_val: int = _check(**rng(1))
    digits_per_image: list[int] = _check(length=2, items=rng(1))
    digit_size: list[int] = _check(length=2, items=rng(1))
    max_overlap: float = _check(**rng(0, 1))
    generator_seed: int


DATA_SCHEMAS: dict[str, type] = {"digits": DigitsSchema, "imagenet": ImageNetSchema, "coco": CocoSchema,
                                 "coco_digits": CocoDigitsSchema}


@dataclass
class PlacementSchema:
    keep: list[str] = field(default_factory=list)
    first_blocks: int | None = checked_field(None, **rng(0))


NAME_BYTES = 255 - len("-12345678")  # a file name's limit (ext4, XFS, APFS), less the directory's run id


def _run_name(value: str) -> str | None:
    """What keeps ``value`` from naming a run's directory (``<name>-<run id>``), or None."""
    size = len(str(value).encode())
    if size > NAME_BYTES:
        return (f"{size} bytes long: a run's directory is named <name>-<run id>, and a file name holds 255 "
                f"bytes; give a name of at most {NAME_BYTES}")
    return None


@dataclass
class RunSchema:
    seed: int = checked_field(0, **rng(0, INT64_MAX))
    trial: int = checked_field(0, **rng(0))
    name: str = checked_field("???", check=_run_name)
    tags: list[str] = field(default_factory=list)
    plugins: list[str] = field(default_factory=list)  # modules or .py files: normexp.plugins
    trainer: TrainerSchema = field(default_factory=TrainerSchema)
    backbone: dict[str, Any] = field(default_factory=dict)
    norm: dict[str, Any] = field(default_factory=dict)
    data: dict[str, Any] = field(default_factory=dict)
    task: dict[str, Any] = field(default_factory=dict)
    logger: dict[str, Any] = field(default_factory=dict)
    table: dict[str, Any] | None = None
    launcher: dict[str, Any] | None = None


# ---------------------------------------------------------------- schemas derived from the normalizers
def _omegaconf_type(annotation: Any) -> Any:
    """The annotation if OmegaConf can check it (a plain type, or one of them or None), else Any."""
    plain = (int, float, bool, str)
    args = typing.get_args(annotation)
    if args and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return rest[0] | None if len(rest) == 1 and rest[0] in plain else Any
    return annotation if annotation in plain else Any


def norm_schema(name: str) -> type | None:
    """The schema of ``norm=<name>``: its options' types and checks from the normalizer's constructor (their
    values: the constructor's defaults, ``norm/code/<name>``, and what its yaml states), plus ``placement``
    and ``model_defaults`` (what it suggests to the models it goes into, read by their configs)."""
    from .norms.registry import get_norm_class, hyperparameters

    key = (name, get_norm_class(name))  # made once per registered class: the schema pass caches by schema
    if key not in _NORM_SCHEMAS:
        options = hyperparameters(name)
        _NORM_SCHEMAS[key] = None if options is None else _norm_dataclass(name, options)
    return _NORM_SCHEMAS[key]


_NORM_SCHEMAS: dict[tuple[str, type], type | None] = {}


def _norm_dataclass(name: str, options: list[Any]) -> type:
    return make_dataclass(f"Norm_{name}", [
        ("name", str, field(default="???")),
        ("placement", PlacementSchema, field(default_factory=PlacementSchema)),
        ("model_defaults", dict[str, Any], field(default_factory=dict)),
        *[(o.name, _omegaconf_type(o.type), field(metadata=o.checks, kw_only=True)) for o in options]])


# ---------------------------------------------------------------- checking values against a schema
def _shown(value: Any) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def _is_a(value: Any, kind: type) -> bool:
    """``value`` is of ``kind`` (an integer is a float too; a bool is neither)."""
    if isinstance(value, bool):
        return False
    return isinstance(value, int) if kind is int else isinstance(value, (int, float))


def check_value(key: str, value: Any, check: dict[str, Any]) -> None:
    """One value (or list) against its field's checks; a float must be finite, an integer fit in 64 bits."""
    shown = f"{key}={_shown(value)}"
    if isinstance(value, (list, tuple)):
        if "length" in check and len(value) != check["length"]:
            raise UserError(f"{shown}: must have {check['length']} values")
        for i, item in enumerate(value):
            check_value(f"{key}[{i}]", item, check.get("items", {}))
        return
    if "choices" in check and value not in check["choices"]:
        raise UserError(f"{shown}: must be one of {', '.join(_shown(c) for c in check['choices'])}")
    if "type" in check and not _is_a(value, check["type"]):
        what = "an integer" if check["type"] is int else "a number"
        if isinstance(value, str):
            raise UserError(f"{key}={value!r} is a string: must be {what} (give it unquoted)")
        raise UserError(f"{shown}: must be {what}")
    if value is None or isinstance(value, bool):
        return
    if isinstance(value, float) and not math.isfinite(value):
        raise UserError(f"{shown}: must be a finite number")
    if isinstance(value, int) and abs(value) > INT64_MAX:
        raise UserError(f"{shown}: out of range (integers must fit in 64 bits)")
    if isinstance(value, (int, float)):
        for bound, fails, says in (("min", float.__lt__, ">="), ("max", float.__gt__, "<="),
                                   ("above", float.__le__, ">"), ("below", float.__ge__, "<")):
            if bound in check and fails(float(value), float(check[bound])):
                raise UserError(f"{shown}: must be {says} {check[bound]}")
    problem = check["check"](value) if "check" in check else None
    if problem:
        raise UserError(f"{shown}: {problem}")


def _check_fields(schema: type, values: DictConfig, where: str) -> None:
    for f in fields(schema):
        key = f"{where}.{f.name}" if where else f.name
        nested = f.default_factory if f.default_factory is not MISSING else None
        if isinstance(nested, type) and is_dataclass(nested):
            _check_fields(nested, values[f.name], key)
        elif not OmegaConf.is_missing(values, f.name):  # a key its yaml does not state: nothing to check
            value = values[f.name]
            plain = OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
            check_value(key, plain, dict(f.metadata))


def check_numbers(tree: Any, where: str) -> None:
    """Every number anywhere (the open groups too): finite, and within 64 bits."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            check_numbers(v, f"{where}.{k}" if where else str(k))
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            check_numbers(v, f"{where}[{i}]")
    else:
        check_value(where, tree, {})


def _schema_at(schema: type, path: list[str]) -> type:
    """The dataclass that holds the key at ``path`` (its parent's schema)."""
    for name in path[:-1]:
        nested = next((f.default_factory for f in fields(schema) if f.name == name), None)
        if not (isinstance(nested, type) and is_dataclass(nested)):
            break
        schema = nested
    return schema


def schema_keys(key: str) -> list[str]:
    """The keys the schema allows beside ``key`` (none when its parent is an open group: backbone, task)."""
    path = key.split(".")
    schema = _schema_at(RunSchema, path)
    return [f.name for f in fields(schema)] if len(path) == 1 or schema is not RunSchema else []


def unknown_key(key: str, known: list[str] | None = None) -> UserError:
    """``unknown config key <key>`` with the closest known keys and all of them (by default: the schema's
    keys beside it)."""
    parent, _, leaf = key.rpartition(".")
    known = schema_keys(key) if known is None else known
    if not known:
        return UserError(f"unknown config key {key}")
    close = difflib.get_close_matches(leaf, known, n=3)
    hint = f"did you mean {', '.join(f'{parent}.{c}' if parent else c for c in close)}? " if close else ""
    return UserError(f"unknown config key {key}: {hint}{parent or 'the config'} has {', '.join(known)}")


_STRUCTURED: dict[type, tuple[DictConfig, dict[str, bool]]] = {}


def _structured(schema: type) -> tuple[DictConfig, dict[str, bool]]:
    """The schema as a config (made once: merge copies it) and its open fields, ``dict[str, Any]`` (name ->
    whether None is allowed too): the merge leaves those out, as converting them checks nothing but their
    type and is most of its cost."""
    if schema not in _STRUCTURED:
        hints = typing.get_type_hints(schema)
        open_fields = {f.name: hints[f.name] != dict[str, Any] for f in fields(schema)
                       if hints[f.name] in (dict[str, Any], dict[str, Any] | None)}
        _STRUCTURED[schema] = OmegaConf.structured(schema), open_fields
    return _STRUCTURED[schema]


def _merge(schema: type, values: Any, where: str) -> DictConfig:
    base, open_fields = _structured(schema)
    if isinstance(values, dict):
        for name, optional in open_fields.items():
            value = values.get(name)
            if name in values and not isinstance(value, dict) and not (optional and value is None):
                key = f"{where}.{name}" if where else name
                raise UserError(f"bad value for {key}: a mapping of options, not {type(value).__name__}")
        values = {k: v for k, v in values.items() if k not in open_fields}
    try:
        return OmegaConf.merge(base, values)
    except OmegaConfBaseException as e:
        inner = getattr(e, "full_key", None) or ""
        key = ".".join(k for k in (where, inner) if k)
        first = str(e).strip().splitlines()[0]
        if isinstance(e, ConfigKeyError):
            raise unknown_key(key, [f.name for f in fields(_schema_at(schema, inner.split(".")))]) from None
        raise UserError(f"bad value for {key}: {first}") from None


def fit_schema(schema: type, values: Any, where: str) -> DictConfig:
    """``values`` merged into ``schema`` (types, unknown keys), then every field's checks."""
    merged = _merge(schema, values, where)
    _check_fields(schema, merged, where)
    return merged
