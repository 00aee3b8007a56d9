"""Fold a normalizer's per-channel affine into the Linear layer that reads its output, for inference
(FlashNorm, arXiv 2407.09577, folds RMSNorm's weights the same way): a norm ``y = gamma * f(x) + beta``
feeding ``z = W y + b`` becomes ``y = f(x)`` feeding ``z = W' y + b'`` with ``W' = W diag(gamma)`` and
``b' = b + W beta``; the logits are the same, the norm's ``2C`` parameters are gone.

Which Linear consumes which norm is the backbone's to say (its ``affine_consumers``: norm slot -> the Linear
layers that read only that norm's output, through nothing but per-channel linear maps such as token pooling);
a norm folds when its output is ``weight * f(x) + bias`` over the last dim with ``f`` reading neither: torch's
LayerNorm and the normalizers that declare it (``output_affine``: DyT, the point-wise ones, Derf).
"""

from __future__ import annotations

import torch
from torch import nn

from ..norms.placement import fix_affine


def foldable(norm: nn.Module) -> bool:
    """Whether ``norm`` ends in a learnable per-channel affine over the last dim that nothing else reads."""
    declared = getattr(norm, "output_affine", isinstance(norm, nn.LayerNorm))
    weight, bias = norm._parameters.get("weight"), norm._parameters.get("bias")
    return bool(declared) and getattr(norm, "data_format", "channels_last") == "channels_last" \
        and weight is not None and bias is not None and weight.dim() == 1 and bias.shape == weight.shape


def affine_pairs(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """The model's norm slots whose affine folds, each with the Linear layers reading it; a model that
    declares none, or a declared norm that cannot fold, is a ValueError naming it."""
    declare = getattr(model, "affine_consumers", None)
    pairs = declare() if declare is not None else {}
    if not pairs:
        raise ValueError(f"{type(model).__name__} declares no Linear layer reading its norms "
                         "(affine_consumers): its norms' affine cannot be folded")
    for norm_name, linear_names in pairs.items():
        norm = model.get_submodule(norm_name)
        if not foldable(norm):
            raise ValueError(f"norm '{norm_name}' ({type(norm).__name__}) does not end in a per-channel "
                             "affine that folds (DyT, Derf, the point-wise normalizers and LayerNorm do)")
        for linear_name in linear_names:
            linear = model.get_submodule(linear_name)
            if not isinstance(linear, nn.Linear) or linear.in_features != norm.weight.numel():
                raise ValueError(f"'{linear_name}' is not a Linear layer reading the {norm.weight.numel()} "
                                 f"channels of '{norm_name}'")
    return pairs


@torch.no_grad()
def fold_norm_affines(model: nn.Module) -> list[str]:
    """Fold every declared norm's affine into its Linear layers in place; the norm keeps identity buffers
    (no parameters, no state-dict entries) and each Linear gets a bias if it had none. Returns the folded
    norms' names. Applied to a freshly built model, it gives the folded architecture a folded state dict
    loads into."""
    pairs = affine_pairs(model)
    for norm_name, linear_names in pairs.items():
        norm = model.get_submodule(norm_name)
        gamma, beta = norm.weight.double(), norm.bias.double()
        for linear_name in linear_names:
            linear = model.get_submodule(linear_name)
            weight = linear.weight.double()
            bias = linear.bias.double() if linear.bias is not None else torch.zeros_like(weight[:, 0])
            if linear.bias is None:
                linear.bias = nn.Parameter(torch.empty_like(linear.weight[:, 0]))
            linear.bias.copy_(bias + weight @ beta)
            linear.weight.copy_(weight * gamma)
        fix_affine(norm, gamma.numel())  # weight and bias become buffers ...
        norm.weight.fill_(1)  # ... of the identity
        norm.bias.fill_(0)
    return list(pairs)
