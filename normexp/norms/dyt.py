"""Dynamic Tanh (Zhu et al., CVPR 2025): ``gamma * squash(alpha * x) + beta`` (dyt.md 1.1).

``alpha`` is one scalar per layer (init ``alpha0`` = 0.5), ``gamma``/``beta`` are per channel.
No statistics, no reduction: purely element-wise.

Ablation options (dyt.md 3, Tables 7-8):

* ``squash``: ``"tanh"`` (DyT), ``"hardtanh"`` (clamp to [-1, 1]), ``"sigmoid"``, ``"identity"``
  (``gamma * alpha * x + beta``; diverges in Table 7). The notes do not say whether the paper's sigmoid was
  shifted or rescaled, so it is the plain logistic ``1 / (1 + exp(-alpha x))`` with outputs in (0, 1).
* ``learnable_alpha=False`` keeps alpha fixed at ``alpha0`` (a buffer, still in the state_dict);
  the "without alpha" rows of Table 8 are ``learnable_alpha=False, alpha0=1.0``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .functional import channel_affine, check_data_format
from .registry import register_norm

SQUASH: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "tanh": torch.tanh,
    "hardtanh": F.hardtanh,
    "sigmoid": torch.sigmoid,
    "identity": lambda x: x,
}


@register_norm("dyt")
class DyT(nn.Module):
    def __init__(self, dim: int, alpha0: float = 0.5, data_format: str = "channels_last",
                 squash: str = "tanh", learnable_alpha: bool = True) -> None:
        super().__init__()
        if squash not in SQUASH:
            raise ValueError(f"DyT squash must be one of {sorted(SQUASH)}, got '{squash}'")
        self.dim, self.squash = dim, squash
        self.data_format = check_data_format(data_format)
        alpha = torch.full((1,), float(alpha0))
        if learnable_alpha:
            self.alpha = nn.Parameter(alpha)
        else:
            self.register_buffer("alpha", alpha)
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return channel_affine(SQUASH[self.squash](self.alpha * x), self.weight, self.bias, self.data_format)

    def extra_repr(self) -> str:
        learnable = isinstance(self.alpha, nn.Parameter)
        return (f"{self.dim}, alpha0={self.alpha.item():.3g}, squash={self.squash}, "
                f"learnable_alpha={learnable}, data_format={self.data_format}")
