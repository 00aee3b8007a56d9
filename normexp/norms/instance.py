"""InstanceNorm for tokens: per sample and channel, statistics over all tokens / positions (+ affine).

DTN's ``insnorm`` baseline (wqshao126/DTN ``models/normkit/norms/us_instancenorm.py``) uses the *unbiased*
variance over the tokens, hence the default ``unbiased=True``; ``unbiased=False`` gives the textbook /
``nn.InstanceNorm`` form. Prefix (class) tokens,
when present, are tokens like any other here.
"""

from __future__ import annotations

import torch
from torch import nn

from .functional import channel_affine, check_data_format
from .registry import register_norm


@register_norm("in")
class InstanceNorm(nn.Module):
    token_statistics = True  # statistics over the tokens of a sample: undefined on one pooled vector

    def __init__(self, dim: int, eps: float = 1e-5, affine: bool = True, unbiased: bool = True,
                 data_format: str = "channels_last") -> None:
        super().__init__()
        self.dim, self.eps, self.unbiased = dim, eps, unbiased
        self.data_format = check_data_format(data_format)
        self.weight = nn.Parameter(torch.ones(dim)) if affine else None
        self.bias = nn.Parameter(torch.zeros(dim)) if affine else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() < 3:
            raise ValueError(f"InstanceNorm needs a token / spatial dim, got shape {tuple(x.shape)}")
        # reduce over every dim but batch and channel
        first = self.data_format == "channels_first"
        dims = tuple(range(2, x.dim())) if first else tuple(range(1, x.dim() - 1))
        var, mean = torch.var_mean(x, dim=dims, keepdim=True, correction=int(self.unbiased))
        y = (x - mean) * torch.rsqrt(var + self.eps)
        return channel_affine(y, self.weight, self.bias, self.data_format)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}, unbiased={self.unbiased}, data_format={self.data_format}"
