"""RMSNorm (Zhang & Sennrich, 2019): scale by the root mean square, no centring."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .functional import check_data_format
from .registry import register_norm


@register_norm("rms")
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6, affine: bool = True,
                 data_format: str = "channels_last") -> None:
        super().__init__()
        self.dim, self.eps = dim, eps
        self.data_format = check_data_format(data_format)
        self.weight = nn.Parameter(torch.ones(dim)) if affine else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.data_format == "channels_first":
            return F.rms_norm(x.movedim(1, -1), (self.dim,), self.weight, self.eps).movedim(-1, 1)
        return F.rms_norm(x, (self.dim,), self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}, data_format={self.data_format}"
