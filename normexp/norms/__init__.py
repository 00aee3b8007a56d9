"""Normalizers, one file each, behind one registry (``norm=<name>``)."""

from . import (  # noqa: F401  (importing registers them)
    batch,
    derf,
    dtn,
    dyt,
    fixup,
    group,
    instance,
    ln,
    normfree,
    pointwise,
    power,
    rms,
    scale,
    sigma_reparam,
    sn,
)
from .layout import TokenLayout
from .placement import replace_norms
from .registry import get_norm_class, list_norms, norm_layer_factory, register_norm

__all__ = ["TokenLayout", "get_norm_class", "list_norms", "norm_layer_factory", "register_norm",
           "replace_norms"]
