"""RMSNorm (Zhang & Sennrich, 2019, arXiv 1910.07467): scale by the root mean square, no centring.
``kernels``: the fused path (:mod:`normexp.norms.kernels.rms`), as DyT's; ``autograd`` is ``F.rms_norm``."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from .functional import check_data_format, output_dtype
from .kernels import KERNEL_MODES, check_kernels, resolve_kernels
from .kernels.rms import rms_norm
from .registry import register_norm


@register_norm("rms")
class RMSNorm(nn.Module):
    hparam_checks: ClassVar[dict[str, dict[str, Any]]] = {"kernels": {"choices": list(KERNEL_MODES)}}

    def __init__(self, dim: int, eps: float = 1e-6, affine: bool = True,
                 data_format: str = "channels_last", kernels: str = "auto") -> None:
        super().__init__()
        self.dim, self.eps = dim, eps
        self.data_format = check_data_format(data_format)
        self.kernels = check_kernels(kernels)
        self.weight = nn.Parameter(torch.ones(dim)) if affine else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        channels_first = self.data_format == "channels_first"
        mode = resolve_kernels(self.kernels, x, (RMSNorm, self.data_format), has_native=True)
        if mode != "autograd":
            return rms_norm(x, self.weight, self.eps, channels_first, mode).to(output_dtype(x))
        if channels_first:
            return F.rms_norm(x.movedim(1, -1), (self.dim,), self.weight, self.eps).movedim(-1, 1)
        return F.rms_norm(x, (self.dim,), self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}, data_format={self.data_format}"
