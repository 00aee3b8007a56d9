"""Data: loaders only; knows nothing of models."""

from __future__ import annotations

from collections.abc import Callable

from ..errors import UserError
from .digits import build_digits
from .imagenet import build_imagenet
from .loaders import ClassificationData

CLASSIFICATION_DATA: dict[str, Callable[..., ClassificationData]] = {
    "digits": build_digits,
    "imagenet": build_imagenet,
}


def build_classification_data(cfg, seed: int) -> ClassificationData:
    try:
        builder = CLASSIFICATION_DATA[cfg.name]
    except KeyError:
        raise UserError(f"data '{cfg.name}' has no classification loader; "
                        f"available: {', '.join(CLASSIFICATION_DATA)}") from None
    return builder(cfg, seed)


__all__ = ["ClassificationData", "build_classification_data"]
