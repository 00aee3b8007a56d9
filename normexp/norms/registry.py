"""Registry of normalizers, each built as ``norm_layer(dim, **context)`` (timm's ``norm_layer`` convention).

``context`` is what only the model knows (``data_format``, ``num_heads``, ``layout``, ``num_prefix_tokens``);
:func:`norm_layer_factory` passes a normalizer only the keys its constructor names. Other keyword arguments
are hyper-parameters (``norm.<name>=``), typed by the constructor's annotations and checked against the
class's ``hparam_checks`` before any model is built. ``token_statistics = True`` marks normalizers that
take statistics over a sample's tokens (the placement leaves ``pooled`` slots to them as built).
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

NormLayer = Callable[..., nn.Module]

_REGISTRY: dict[str, type[nn.Module]] = {}

CONTEXT_KEYS = ("data_format", "num_heads", "layout", "num_prefix_tokens")
COMMON_CHECKS: dict[str, dict[str, Any]] = {"eps": {"above": 0}}  # for that option of every normalizer


def register_norm(name: str) -> Callable[[type[nn.Module]], type[nn.Module]]:
    """Class decorator: make a normalizer available as ``norm=<name>``."""

    def wrap(cls: type[nn.Module]) -> type[nn.Module]:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"normalizer '{name}' is registered twice")
        _REGISTRY[name] = cls
        return cls

    return wrap


def list_norms() -> list[str]:
    return sorted(_REGISTRY)


def get_norm_class(name: str) -> type[nn.Module]:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown normalizer '{name}'; available: {', '.join(list_norms())}") from None


def _accepted_keywords(cls: type[nn.Module]) -> set[str] | None:
    """Keyword names the constructor takes, or None when it takes ``**kwargs``."""
    params = inspect.signature(cls.__init__).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params}


@dataclass(frozen=True)
class HyperParameter:
    """One option of a normalizer: its name, type (from the annotation), default and allowed values."""

    name: str
    type: Any
    default: Any
    checks: dict[str, Any] = field(default_factory=dict)


def hyperparameters(name: str) -> list[HyperParameter] | None:
    """The options of normalizer ``name`` (None when its constructor takes ``**kwargs``: any option)."""
    cls = get_norm_class(name)
    if _accepted_keywords(cls) is None:
        return None
    hints = typing.get_type_hints(cls.__init__)
    declared = getattr(cls, "hparam_checks", {})
    options = []
    for param in list(inspect.signature(cls.__init__).parameters.values())[1:]:
        if param.name in ("dim", *CONTEXT_KEYS) or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        checks = {**COMMON_CHECKS.get(param.name, {}), **declared.get(param.name, {})}
        options.append(HyperParameter(param.name, hints.get(param.name, Any), param.default, checks))
    return options


def norm_layer_factory(name: str, **hparams: Any) -> NormLayer:
    """``norm_layer(dim, **context)`` for the registered normalizer ``name``; unknown ``hparams`` fail here,
    listing the valid ones."""
    cls = get_norm_class(name)
    accepted = _accepted_keywords(cls)
    if accepted is not None:
        unknown = sorted(set(hparams) - accepted)
        if unknown:
            valid = sorted(accepted - {"self", "dim", *CONTEXT_KEYS})
            raise ValueError(f"normalizer '{name}' has no option {unknown}; its options are {valid}")

    def build(dim: int, **context: Any) -> nn.Module:
        if accepted is not None:
            context = {k: v for k, v in context.items() if k in accepted}
        return cls(dim, **hparams, **context)

    build.norm_name = name  # type: ignore[attr-defined]
    build.token_statistics = getattr(cls, "token_statistics", False)  # type: ignore[attr-defined]
    return build
