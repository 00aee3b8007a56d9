"""ScaleNorm (Nguyen & Salazar, 2019) as DTN's comparison uses it (``scale``,
wqshao126/DTN ``models/normkit/norms/us_scalenorm.py``):
``y = g * x / max(||x||_2, eps)`` over the channels of each token, with a learnable scale ``g``
initialised to sqrt(C). DTN's variant has a per-channel ``g`` (default); ``per_channel=False`` gives the
original single scalar. No centring, no bias; at init it equals RMSNorm without eps.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .functional import channel_affine, check_data_format
from .registry import register_norm


@register_norm("scale")
class ScaleNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5, per_channel: bool = True,
                 data_format: str = "channels_last") -> None:
        super().__init__()
        self.dim, self.eps = dim, eps
        self.data_format = check_data_format(data_format)
        self.weight = nn.Parameter(torch.full((dim if per_channel else 1,), math.sqrt(dim)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        channel_dim = 1 if self.data_format == "channels_first" else -1
        norm = torch.linalg.vector_norm(x, dim=channel_dim, keepdim=True).clamp_min(self.eps)
        weight = self.weight.expand(self.dim)
        return channel_affine(x / norm, weight, None, self.data_format)

    def extra_repr(self) -> str:
        per_channel = self.weight.numel() > 1
        return f"{self.dim}, eps={self.eps}, per_channel={per_channel}, data_format={self.data_format}"
