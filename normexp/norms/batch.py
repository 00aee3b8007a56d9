"""BatchNorm over the batch and all tokens / positions, per channel (DTN's ``batch``).

Statistics are taken over every (sample, token) pair of a channel, with running statistics (momentum 0.1,
as torch) used in eval mode. The math is ``nn.BatchNorm1d`` applied to the input flattened to (M, C)
(channels-last) or (B, C, L) (channels-first).

Why a wrapper around an ``nn.BatchNorm1d`` child rather than a ``_BatchNorm`` subclass:
``torch.nn.SyncBatchNorm.convert_sync_batchnorm`` swaps every ``_BatchNorm`` for a plain ``SyncBatchNorm``
and would drop a subclass's reshaping forward; with a child it converts the child and the reshaping here
keeps working. Consequences: the state_dict keys are ``bn.weight``, ``bn.running_mean``, ...; and
``placement.norm_slots`` lists the inner ``<name>.bn`` as a slot of a model that already uses this layer.
"""

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
