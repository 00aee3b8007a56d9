"""LayerNorm over the channel dim, for tokens, channels-last and channels-first maps."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .functional import check_data_format
from .registry import register_norm


@register_norm("ln")
class LayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` that also accepts channels-first maps (the timm ``LayerNorm2d`` case)."""

    def __init__(self, dim: int, eps: float = 1e-6, affine: bool = True,
                 data_format: str = "channels_last") -> None:
        super().__init__(dim, eps=eps, elementwise_affine=affine)
        self.data_format = check_data_format(data_format)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.data_format == "channels_first":
            x = x.movedim(1, -1)
            return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps).movedim(-1, 1)
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
