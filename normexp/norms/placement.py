"""The one place that decides which norm layers of a model become the chosen normalizer: ``replace_norms``
swaps each *norm slot* for ``norm_layer(dim, **context)``, the context from ``model.norm_context(name)``."""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable
from typing import Any

from torch import nn

from .registry import NormLayer, get_norm_class, list_norms

SLOT_TYPES: tuple[type[nn.Module], ...] = (nn.LayerNorm, nn.modules.batchnorm._BatchNorm, nn.GroupNorm)


def slot_shape(module: nn.Module) -> tuple[int, str]:
    """Channel count and data format of a norm slot."""
    if isinstance(module, nn.LayerNorm):
        # timm's LayerNorm2d (and our own channels-first LN) normalise dim 1 of NCHW maps.
        channels_first = getattr(module, "data_format", None) == "channels_first" or \
            type(module).__name__ == "LayerNorm2d"
        return module.normalized_shape[-1], "channels_first" if channels_first else "channels_last"
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        return module.num_features, "channels_first"
    if isinstance(module, nn.GroupNorm):
        return module.num_channels, "channels_first"
    raise TypeError(f"{type(module).__name__} is not a norm slot")


def slot_affine(module: nn.Module) -> bool:
    """Whether a norm slot was built with a learnable per-channel affine (DiT's LayerNorms are not)."""
    return bool(getattr(module, "elementwise_affine", getattr(module, "affine", True)))


def fix_affine(layer: nn.Module, dim: int) -> nn.Module:
    """``layer`` with its per-channel ``weight`` / ``bias`` fixed as identity buffers (other parameters still
    learn): DyT becomes ``tanh(alpha x)``."""
    for module in layer.modules():
        weight = module._parameters.get("weight")
        if weight is None or weight.dim() != 1 or weight.numel() != dim:
            continue
        for name in ("weight", "bias"):
            value = module._parameters.pop(name, None)
            if value is not None:
                module.register_buffer(name, value.detach().clone(), persistent=False)
    return layer


def norm_slots(model: nn.Module) -> list[str]:
    """Names of the norm slots of ``model``, in module order."""
    return [name for name, m in model.named_modules() if isinstance(m, SLOT_TYPES)]


def _slot_types() -> tuple[type[nn.Module], ...]:
    # registered late (a plugin's normalizer) included
    return (*SLOT_TYPES, *(get_norm_class(name) for name in list_norms()))


def norm_slot_names(model: nn.Module) -> list[str]:
    """Names of the norm slots of a built model, in module order (outermost slot modules only)."""
    types = _slot_types()
    names: list[str] = []
    for name, module in model.named_modules():
        if not name or not isinstance(module, types):
            continue
        if names and name.startswith(names[-1] + "."):
            continue  # inside the slot just listed
        names.append(name)
    return names


def replace_norms(
    model: nn.Module,
    norm_layer: NormLayer,
    keep: Iterable[str] = (),
    first_blocks: int | None = None,
    context_fn: Callable[[str], dict[str, Any]] | None = None,
) -> list[str]:
    """Swap the norm slots of ``model`` for ``norm_layer``; return the names of the replaced slots.

    A slot keeps its layer when it matches a ``keep`` or the model's ``norm_keep`` fnmatch pattern, when
    ``first_blocks=k`` and its block is None or >= k, or when it is ``pooled`` and the normalizer takes
    ``token_statistics``. ``context_fn`` defaults to ``model.norm_context``. A slot without a learnable affine
    gets the normalizer without one (:func:`fix_affine`).
    """
    keep = [*keep, *getattr(model, "norm_keep", ())]
    if context_fn is None:
        context_fn = getattr(model, "norm_context", None)
    replaced = []
    for name in norm_slots(model):
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in keep):
            continue
        context = dict(context_fn(name)) if context_fn else {}
        block = context.pop("block", None)
        if first_blocks is not None and (block is None or block >= first_blocks):
            continue
        if context.pop("pooled", False) and getattr(norm_layer, "token_statistics", False):
            continue
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        slot = getattr(parent, attr)
        dim, data_format = slot_shape(slot)
        layer = norm_layer(dim, data_format=data_format, **context)
        setattr(parent, attr, layer if slot_affine(slot) else fix_affine(layer, dim))
        replaced.append(name)
    return replaced
