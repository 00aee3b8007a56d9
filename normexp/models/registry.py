"""Model registry: ``@register_model`` on a constructor, ``create_model(name, **kwargs)`` to build it."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

_MODELS: dict[str, Callable[..., nn.Module]] = {}


def register_model(fn: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
    if fn.__name__ in _MODELS:
        raise ValueError(f"model '{fn.__name__}' is registered twice")
    _MODELS[fn.__name__] = fn
    return fn


def list_models() -> list[str]:
    return sorted(_MODELS)


def create_model(name: str, **kwargs) -> nn.Module:
    try:
        constructor = _MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model '{name}'; available: {', '.join(list_models())}") from None
    return constructor(**kwargs)
