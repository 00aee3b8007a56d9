"""BatchNorm over the batch and all tokens / positions, per channel (DTN's ``batch``): an ``nn.BatchNorm1d``
child on the flattened input, so that ``SyncBatchNorm.convert_sync_batchnorm`` converts it (state_dict keys
``bn.*``)."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from .functional import check_data_format
from .registry import register_norm


@register_norm("bn")
class BatchNorm(nn.Module):
    hparam_checks: ClassVar[dict[str, dict[str, Any]]] = {"momentum": {"min": 0, "max": 1}}

    def __init__(self, dim: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True, data_format: str = "channels_last") -> None:
        super().__init__()
        self.dim = dim
        self.data_format = check_data_format(data_format)
        self.bn = nn.BatchNorm1d(dim, eps=eps, momentum=momentum, affine=affine,
                                 track_running_stats=track_running_stats)

    @property
    def weight(self) -> torch.Tensor | None:
        return self.bn.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.bn.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.data_format == "channels_first":
            # (B, C, *spatial) -> (B, C, L): BatchNorm1d reduces over B and L
            return self.bn(x.reshape(x.shape[0], x.shape[1], -1)).view_as(x) if x.dim() > 2 else self.bn(x)
        return self.bn(x.reshape(-1, x.shape[-1])).view_as(x)

    def extra_repr(self) -> str:
        return f"data_format={self.data_format}"
