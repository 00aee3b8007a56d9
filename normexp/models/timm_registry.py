"""normexp's classification backbones in timm's model registry, as ``normexp_<name>`` (a prefix no timm model
name has), so that an exported run (``normexp export``) loads the way timm loads its own:

    import normexp.models  # registers normexp_vit_micro, normexp_vit_small, ...
    model = timm.create_model("local-dir:<export dir>", pretrained=True)
    model = timm.create_model("normexp_vit_micro", pretrained=True, **model_args,
                              pretrained_cfg_overlay=dict(file="<export dir>/model.safetensors"))

Each entrypoint takes the backbone's own options (``img_size``, ``num_classes``, ...), ``norm`` (the run's
``norm`` config: the normalizer and its options) and ``fold`` (the variant with its norms' affine folded into
the Linear layers, :mod:`normexp.models.fold`), and builds through timm's ``build_model_with_cfg`` (timm's
``models/_builder.py``), which loads the weights. The default pretrained config names no classifier, so a
weights file loads strictly, head included; an export's ``config.json`` names it (a new ``num_classes`` then
starts a fresh head, as for timm's own models).
"""

from __future__ import annotations

import sys
from functools import partial
from typing import Any

from timm.models import build_model_with_cfg
from timm.models import register_model as register_timm_model
from torch import nn

from .base import CLASSIFICATION
from .build import build_model
from .fold import fold_norm_affines
from .registry import _MODELS, create_model, serving

PREFIX = "normexp_"
default_cfgs: dict[str, dict[str, Any]] = {}  # timm's register_model reads its module's default_cfgs


def timm_name(name: str) -> str:
    """timm's name of normexp's model ``name``."""
    return PREFIX + name


def build_for_timm(name: str, norm: dict[str, Any] | None = None, fold: bool = False,
                   **kwargs: Any) -> nn.Module:
    """normexp's ``name`` with ``kwargs``, its norm slots holding ``norm`` (None: the layers it is built
    with), its affine folded with ``fold`` (the weights are a folded export's to load)."""
    if norm is None:
        model = create_model(name, **kwargs)
    else:
        model = build_model(lambda: create_model(name, **kwargs), dict(norm), f"backbone '{name}'")
    if fold:
        fold_norm_affines(model)
    return model


def _entrypoint(name: str) -> Any:
    def entrypoint(pretrained: bool = False, **kwargs: Any) -> nn.Module:
        return build_model_with_cfg(partial(build_for_timm, name), timm_name(name), pretrained, **kwargs)

    entrypoint.__name__ = entrypoint.__qualname__ = timm_name(name)
    entrypoint.__module__ = __name__
    entrypoint.__doc__ = _MODELS[name].__doc__
    return entrypoint


def _default_cfg(name: str) -> dict[str, Any]:
    """No weights of its own (an export's file or directory gives them); the input size it is built with."""
    size = getattr(_MODELS[name], "settings", {}).get("img_size", 224)
    return {"input_size": (3, size, size), "classifier": None, "description": _MODELS[name].__doc__,
            "license": "mit"}


def register_all() -> None:
    """Register every normexp model that serves classification in timm's registry (once per process)."""
    module = sys.modules[__name__]
    for name in serving(CLASSIFICATION):
        if timm_name(name) in default_cfgs:
            continue
        default_cfgs[timm_name(name)] = _default_cfg(name)
        entrypoint = _entrypoint(name)
        setattr(module, entrypoint.__name__, entrypoint)
        register_timm_model(entrypoint)


register_all()
