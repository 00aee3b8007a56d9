"""Dynamic erf (Derf; Chen et al., arXiv 2512.10938, Eq. 10): ``gamma * erf(alpha * x + s) + beta``.

``alpha`` and the shift ``s`` are learnable scalars (init 0.5 and 0), ``gamma``/``beta`` are per channel.
Element-wise, like DyT.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from .functional import channel_affine, check_data_format
from .registry import register_norm


@register_norm("derf")
class Derf(nn.Module):
    hparam_checks: ClassVar[dict[str, dict[str, Any]]] = {"alpha0": {"above": 0}}

    def __init__(self, dim: int, alpha0: float = 0.5, shift0: float = 0.0,
                 data_format: str = "channels_last") -> None:
        super().__init__()
        self.dim = dim
        self.data_format = check_data_format(data_format)
        self.alpha = nn.Parameter(torch.full((1,), float(alpha0)))
        self.shift = nn.Parameter(torch.full((1,), float(shift0)))
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.erf(self.alpha * x + self.shift)
        return channel_affine(y, self.weight, self.bias, self.data_format)

    def extra_repr(self) -> str:
        return f"{self.dim}, data_format={self.data_format}"
