"""Data: loaders only; knows nothing of models."""

from __future__ import annotations

from collections.abc import Callable

from ..errors import UserError
from .coco import check_coco_root
from .digits import NUM_CLASSES as DIGITS_CLASSES
from .digits import build_digits
from .imagenet import build_imagenet, check_imagefolder_root
from .loaders import ClassificationData, ImageSpec, TrainTransform

CLASSIFICATION_DATA: dict[str, Callable[..., ClassificationData]] = {
    "digits": build_digits,
    "imagenet": build_imagenet,
}


def build_classification_data(cfg, seed: int, train_transform: TrainTransform | None = None,
                              eval_train: bool = False,
                              eval_transform: TrainTransform | None = None) -> ClassificationData:
    """A labelled image data set's loaders: its own transforms (DeiT's for ImageNet, standardisation for the
    digits) or a task's (``train_transform``: pre-training views; ``eval_transform``: what its evaluation
    reads, e.g. a diffusion model's [-1, 1] images; see :class:`ImageSpec`); ``eval_train``: also the
    training images through the evaluation transform."""
    try:
        builder = CLASSIFICATION_DATA[cfg.name]
    except KeyError:
        raise UserError(f"data '{cfg.name}' has no classification loader; "
                        f"available: {', '.join(CLASSIFICATION_DATA)}") from None
    return builder(cfg, seed, train_transform=train_transform, eval_train=eval_train,
                   eval_transform=eval_transform)


def _check_fixed_classes(cfg, found: int, what: str) -> None:
    if cfg.num_classes != found:
        raise UserError(f"data.num_classes={cfg.num_classes}, but {what} has {found} classes: set "
                        f"data.num_classes={found}")


def _check_digits(cfg) -> None:
    _check_fixed_classes(cfg, DIGITS_CLASSES, "data=digits")


def _check_imagenet(cfg) -> None:
    check_imagefolder_root(cfg.root, (cfg.train_split, cfg.val_split), cfg.num_classes)


def _check_coco(cfg) -> None:
    check_coco_root(cfg.root, (cfg.train_split, cfg.val_split))


def _check_coco_digits(cfg) -> None:
    if cfg.root:  # a copy of the generated tree; else it is generated on first use
        _check_coco(cfg)
    _check_fixed_classes(cfg, DIGITS_CLASSES, "data=coco_digits")


DATA_CHECKS: dict[str, Callable] = {"digits": _check_digits, "imagenet": _check_imagenet, "coco": _check_coco,
                                    "coco_digits": _check_coco_digits}


def check_data(cfg) -> None:
    """Before any work: the data the config names is there, as the config describes it (a cheap look at
    its root, nothing loaded)."""
    check = DATA_CHECKS.get(cfg.name)
    if check is not None:
        check(cfg)


__all__ = ["ClassificationData", "ImageSpec", "TrainTransform", "build_classification_data", "check_data"]
