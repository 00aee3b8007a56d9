"""Model registry: ``@register_model`` on a constructor (or :func:`register_size`), ``create_model(name,
**kwargs)`` to build it, and :func:`config_defaults`, the options a model's yaml takes from its code."""

from __future__ import annotations

import inspect
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


def register_size(name: str, build: Callable[..., nn.Module], settings: dict[str, Any], doc: str) -> None:
    """Register model ``name``: ``build(**settings)``, a keyword overriding a setting. The settings are what
    its config takes from the code (:func:`config_defaults`)."""

    def constructor(**kwargs: Any) -> nn.Module:
        return build(**{**settings, **kwargs})

    constructor.__name__, constructor.__qualname__, constructor.__doc__ = name, name, doc
    built = build if isinstance(build, type) else typing.get_type_hints(build).get("return", nn.Module)
    constructor.__annotations__ = {**constructor.__annotations__, "return": built}
    constructor.settings = settings  # type: ignore[attr-defined]
    register_model(constructor)


def built_with(name: str) -> dict[str, Any]:
    """The keyword values ``create_model(name)`` builds with: its size's settings, else its class's
    constructor defaults."""
    return {**_constructor_defaults(model_classes(name)[0]), **getattr(_MODELS[name], "settings", {})}


def config_defaults(name: str) -> dict[str, Any]:
    """The options model ``name``'s family shows in its config (its class's ``config_options``) at the values
    ``create_model(name)`` builds with."""
    handed = built_with(name)
    return {option: handed[option] for option in getattr(model_classes(name)[0], "config_options", ())}


def _constructor_defaults(cls: type) -> dict[str, Any]:
    """The keyword defaults of ``cls``'s constructors, the nearest class's first (``**kwargs`` go up)."""
    found: dict[str, Any] = {}
    for base in cls.__mro__:
        if base is nn.Module:
            break
        if "__init__" in base.__dict__:
            for p in list(inspect.signature(base.__init__).parameters.values())[1:]:
                if p.default is not p.empty:
                    found.setdefault(p.name, p.default)
    return found


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


def class_serves(name: str) -> frozenset[str]:
    """What every class ``create_model(name)`` may return serves (their contract's ``serves``; a model
    outside the contract: classification), read off the classes without building."""
    from .base import CLASSIFICATION

    return frozenset.intersection(*(frozenset(getattr(c, "serves", {CLASSIFICATION}))
                                    for c in model_classes(name)))


def serving(need: str) -> list[str]:
    """The registered models whose family serves ``need``, by name."""
    return [name for name in list_models() if need in class_serves(name)]
