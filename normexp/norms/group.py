"""GroupNorm for tokens: per sample, statistics over (channels of a group) x (all tokens / positions).

DTN's ``gnorm`` baseline uses as many groups as the block has heads (wqshao126/DTN
``models/normkit/norm_select.py``), so ``num_groups`` defaults to the ``num_heads`` context; the ``groups``
hyper-parameter overrides it. Biased variance, as ``nn.GroupNorm``.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from .functional import channel_affine, check_data_format
from .registry import register_norm


@register_norm("gn")
class GroupNorm(nn.Module):
    hparam_checks: ClassVar[dict[str, dict[str, Any]]] = {"groups": {"min": 1}}

    def __init__(self, dim: int, groups: int | None = None, eps: float = 1e-5, affine: bool = True,
                 num_heads: int | None = None, data_format: str = "channels_last") -> None:
        super().__init__()
        num_groups = groups if groups is not None else num_heads
        if num_groups is None:
            raise ValueError("GroupNorm needs `groups` or the `num_heads` context to set the group count")
        if dim % num_groups != 0:
            raise ValueError(f"GroupNorm: {num_groups} groups must divide dim={dim}")
        self.dim, self.num_groups, self.eps = dim, num_groups, eps
        self.data_format = check_data_format(data_format)
        self.weight = nn.Parameter(torch.ones(dim)) if affine else None
        self.bias = nn.Parameter(torch.zeros(dim)) if affine else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.data_format == "channels_first":
            return F.group_norm(x, self.num_groups, self.weight, self.bias, self.eps)
        # channels-last (B, *, C): view channels as (G, C/G) and reduce over tokens and the group's channels
        shape = x.shape
        xg = x.reshape(shape[0], -1, self.num_groups, shape[-1] // self.num_groups)
        var, mean = torch.var_mean(xg, dim=(1, 3), keepdim=True, correction=0)
        y = ((xg - mean) * torch.rsqrt(var + self.eps)).view(shape)
        return channel_affine(y, self.weight, self.bias, self.data_format)

    def extra_repr(self) -> str:
        return f"{self.dim}, num_groups={self.num_groups}, eps={self.eps}, data_format={self.data_format}"
