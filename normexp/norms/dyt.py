"""Dynamic Tanh (Zhu et al., CVPR 2025, arXiv 2503.10622, Sec. 4 and Algorithm 1; the official
``dynamic_tanh.py`` of github.com/jiachenzhu/DyT): ``DyT(x) = gamma * tanh(alpha * x) + beta``, with one
scalar ``alpha`` per layer (init ``alpha0``, 0.5) and ``gamma``, ``beta`` per channel. No statistics.

Ablations (Tables 7-8): ``squash`` tanh | hardtanh | sigmoid | identity (the paper does not say whether its
sigmoid was shifted or rescaled: this is the plain logistic, outputs in (0, 1)); ``learnable_alpha=False``
keeps alpha at ``alpha0`` (a buffer). ``kernels``: the fused path (``normexp.norms.kernels.pointwise``).
``alpha_init=calibrate``: alpha set from a pretrained LN model's statistics when its weights are converted
(``normexp.tasks.conversion``); a layer built from scratch starts at ``alpha0`` either way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from .functional import channel_affine, check_data_format, output_dtype
from .kernels import KERNEL_MODES, check_kernels, resolve_kernels
from .kernels.pointwise import ALPHA_INITS, check_alpha_init, pointwise
from .registry import register_norm

SQUASH: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "tanh": torch.tanh,
    "hardtanh": F.hardtanh,
    "sigmoid": torch.sigmoid,
    "identity": lambda x: x,
}


@register_norm("dyt")
class DyT(nn.Module):
    hparam_checks: ClassVar[dict[str, dict[str, Any]]] = {
        "alpha0": {"above": 0}, "squash": {"choices": sorted(SQUASH)},
        "kernels": {"choices": list(KERNEL_MODES)}, "alpha_init": {"choices": list(ALPHA_INITS)}}
    output_affine = True  # gamma * squash(alpha x) + beta: the affine folds (normexp.models.fold)

    def __init__(self, dim: int, alpha0: float = 0.5, data_format: str = "channels_last",
                 squash: str = "tanh", learnable_alpha: bool = True, kernels: str = "auto",
                 alpha_init: str = "alpha0") -> None:
        super().__init__()
        if squash not in SQUASH:
            raise ValueError(f"DyT squash must be one of {sorted(SQUASH)}, got '{squash}'")
        self.dim, self.squash, self.alpha_init = dim, squash, check_alpha_init(alpha_init)
        self.data_format = check_data_format(data_format)
        self.kernels = check_kernels(kernels)
        alpha = torch.full((1,), float(alpha0))
        if learnable_alpha:
            self.alpha = nn.Parameter(alpha)
        else:
            self.register_buffer("alpha", alpha)
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mode = resolve_kernels(self.kernels, x, (DyT, self.squash, self.data_format), has_native=True)
        if mode == "autograd":  # the definition
            y = channel_affine(SQUASH[self.squash](self.alpha * x), self.weight, self.bias, self.data_format)
        else:
            y = pointwise(x, self.alpha, None, self.weight, self.bias, self.squash,
                          self.data_format == "channels_first", mode)
        return y.to(output_dtype(x))

    @property
    def point_function(self) -> str:
        """Its ``f`` by the name :data:`normexp.norms.kernels.pointwise.FUNCTIONS` gives it."""
        return self.squash

    def extra_repr(self) -> str:
        learnable = isinstance(self.alpha, nn.Parameter)
        return (f"{self.dim}, alpha0={self.alpha.item():.3g}, squash={self.squash}, "
                f"learnable_alpha={learnable}, data_format={self.data_format}")
