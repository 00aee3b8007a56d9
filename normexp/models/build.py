"""Build a backbone from its config and put the configured normalizer into it."""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Iterable
from typing import Any

from omegaconf import DictConfig, OmegaConf
from torch import nn

from ..errors import UserError
from ..norms import get_norm_class, norm_layer_factory, replace_norms
from .base import DENSE_FEATURES, served
from .registry import create_model, model_classes, serving


def as_dict(cfg: DictConfig | dict) -> dict[str, Any]:
    return OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)


def norm_settings(norm_cfg: DictConfig | dict) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """Split a ``norm`` config into (name, hyper-parameters, placement)."""
    cfg = as_dict(norm_cfg)
    name = cfg.pop("name")
    placement = cfg.pop("placement", None) or {}
    cfg.pop("model_defaults", None)  # suggestions read by the backbone configs through interpolation
    return name, cfg, placement


def backbone_arguments(backbone_cfg: DictConfig | dict, dense: bool = False) -> tuple[str, dict[str, Any]]:
    """(registered name, constructor arguments) of a backbone config; ``dense``: with the ``dense`` values."""
    kwargs = as_dict(backbone_cfg)
    name = kwargs.pop("name")
    # suggestions read by the norm and trainer configs through interpolation, not by the model
    kwargs.pop("norm_defaults", None)
    kwargs.pop("trainer_defaults", None)
    kwargs.pop("kind", None)  # the configs of DiT runs made before its model class said what it serves
    dense_kwargs = kwargs.pop("dense", None) or {}
    if dense:
        kwargs.update(dense_kwargs)
    return name, kwargs


def build_model(constructor: Callable[[], nn.Module], norm_cfg: DictConfig | dict, what: str) -> nn.Module:
    """``constructor()`` with the configured normalizer in its norm slots (one placement walk), then the
    normalizer's ``adapt_model`` if it has one; a model the normalizer cannot fill is one line naming
    ``what``."""
    norm_name, hparams, placement = norm_settings(norm_cfg)
    unknown = sorted(set(placement) - {"keep", "first_blocks"})
    if unknown:
        raise UserError(f"norm.placement has no option {unknown}; its options are ['first_blocks', 'keep']")
    try:  # the constructors check their arguments: each normalizer its options against every slot it fills
        model = constructor()
        replace_norms(model, norm_layer_factory(norm_name, **hparams), keep=placement.get("keep") or (),
                      first_blocks=placement.get("first_blocks"))
        rule = getattr(get_norm_class(norm_name), "adapt_model", None)  # a normalization-free method's
        if rule is not None:
            rule(model, **{k: v for k, v in hparams.items() if k in inspect.signature(rule).parameters})
    except (ValueError, TypeError, AssertionError) as e:
        raise UserError(f"cannot build {what} with norm '{norm_name}': {e}") from e
    return model


def build_backbone(backbone_cfg: DictConfig | dict, norm_cfg: DictConfig | dict,
                   dense: bool = False) -> nn.Module:
    """Create ``backbone_cfg.name`` with its config values, then swap its norm slots for ``norm_cfg``
    (``dense``: see :func:`backbone_arguments`; a model that serves no dense features is refused)."""
    name, kwargs = backbone_arguments(backbone_cfg, dense)
    model = build_model(lambda: create_model(name, **kwargs), norm_cfg, f"backbone '{name}'")
    if dense:
        require(model, name, DENSE_FEATURES)
    return model


def name_patterns(names: Iterable[str]) -> list[str]:
    """Registered names, those of one class as their common prefix and ``*`` (``vit_*``)."""
    groups: dict[tuple[type, ...], list[str]] = {}
    for name in names:
        groups.setdefault(model_classes(name), []).append(name)
    return sorted(group[0] if len(group) == 1 else os.path.commonprefix(group) + "*"
                  for group in groups.values())


def require(model: nn.Module, name: str, need: str) -> None:
    """Refuse, in one line, a model that does not serve ``need`` (its contract's ``serves``)."""
    serves = served(model)
    if need not in serves:
        how = " (its family serves them when built with pyramid_scales: a dense: block in its config)" \
            if need in getattr(model, "serves", ()) else ""
        what, others = ", ".join(sorted(serves)) or "nothing", ", ".join(name_patterns(serving(need)))
        raise UserError(f"backbone '{name}' serves {what}, not {need}{how}; "
                        f"backbones that serve {need}: {others}")
