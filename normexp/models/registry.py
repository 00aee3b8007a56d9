"""Model registry: ``@register_model`` on a constructor, ``create_model(name, **kwargs)`` to build it."""

from __future__ import annotations

import types
import typing
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

_MODELS: dict[str, Callable[..., nn.Module]] = {}


def register_model(fn: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
    if fn.__name__ in _MODELS:
        raise ValueError(f"model '{fn.__name__}' is registered twice")
    _MODELS[fn.__name__] = fn
    return fn


def settings(name: str) -> dict[str, Any]:
    """The size settings model ``name``'s constructor passes its class, where it declares them (its
    ``settings`` attribute): the code's defaults its yaml composes (``backbone/code/<name>``)."""
    return dict(getattr(_MODELS[name], "settings", {}))


def list_models() -> list[str]:
    return sorted(_MODELS)


def create_model(name: str, **kwargs) -> nn.Module:
    try:
        constructor = _MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model '{name}'; available: {', '.join(list_models())}") from None
    return constructor(**kwargs)


def model_classes(name: str) -> tuple[type, ...]:
    """The classes ``create_model(name)`` may return, from its constructor's return annotation (a model
    without one is built on the meta device)."""
    constructor = _MODELS[name]
    hint = typing.get_type_hints(constructor).get("return")
    classes = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    if all(isinstance(c, type) and issubclass(c, nn.Module) and c is not nn.Module for c in classes):
        return classes
    with torch.device("meta"):
        return (type(constructor()),)


def serving(need: str) -> list[str]:
    """The registered models whose family serves ``need`` (their contract's ``serves``), by name."""
    from .base import CLASSIFICATION

    return [name for name in list_models()
            if all(need in getattr(c, "serves", {CLASSIFICATION}) for c in model_classes(name))]
