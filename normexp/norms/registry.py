"""Registry of normalizers.

A normalizer is an ``nn.Module`` built as ``norm_layer(dim, **context)`` -- the timm ``norm_layer``
convention -- so it drops into any model slot. ``context`` carries what only the model knows:

- ``data_format``: ``"channels_last"`` for (B, N, C) tokens and (B, H, W, C) maps (normalise the last
  dim), ``"channels_first"`` for (B, C, H, W) maps;
- ``num_heads``: heads of the attention block the layer sits in;
- ``layout``: a :class:`normexp.norms.layout.TokenLayout` describing the token grid, shared by a stage;
- ``num_prefix_tokens``: class/distillation tokens that precede the grid tokens.

A normalizer class that takes statistics over the tokens of a sample (instance statistics) says so with
``token_statistics = True``; the placement then leaves the slots that see one pooled vector per image
(context ``pooled``) as built.

Each normalizer's constructor names the context it uses; :func:`norm_layer_factory` passes it only
those keys, so models hand every layer the full context and never special-case a normalizer. Its other
keyword arguments are its hyper-parameters (``norm.<name>=`` in the config): their types come from the
constructor's annotations and their allowed values from the class's ``hparam_checks`` (e.g.
``{"alpha0": {"above": 0}}``; ``eps`` is always > 0), which the config schema enforces before any model is
built (:func:`hyperparameters`).
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
    """Return ``norm_layer(dim, **context)`` for the registered normalizer ``name``.

    ``hparams`` are the normalizer's own hyper-parameters (from its yaml); unknown ones fail here, at
    configuration time, with the list of valid ones.
    """
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
