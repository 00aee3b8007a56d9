"""RMSNorm's fused path (``norm.kernels=native|compiled|eager``): one autograd Function that saves only its
input and the per-row sum of squares (as LayerNorm's kernels save the input and two per-row statistics), with
the analytic backward ``dL/dx = rstd * (g - x_hat * mean(g * x_hat))``, ``g = dL/dy * gamma``,
``x_hat = x * rstd`` (Zhang & Sennrich, arXiv 1910.07467, Sec. 3). Float16/bfloat16 inputs are computed in
float32, as ``F.rms_norm``'s CUDA kernel does. Row statistics are sums scaled by ``1 / C`` rather than
means: compiled, each row's reduction and its element-wise pass then share one loop.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.function import once_differentiable

from . import Kernels, native
from .pointwise import channel_dim, channel_shape, channel_sums

Tensor = torch.Tensor


def _upcast(x: Tensor) -> Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _rstd(sum_square: Tensor, channels: int, eps: float) -> Tensor:
    return torch.rsqrt(sum_square * (1 / channels) + eps)


def _forward(x: Tensor, weight: Tensor | None, eps: float, channels_first: bool) -> tuple[Tensor, Tensor]:
    """(y, the sum of squares per row, its channel dim kept)."""
    x, dim = _upcast(x), channel_dim(x, channels_first)
    sum_square = (x * x).sum(dim, keepdim=True)
    y = x * _rstd(sum_square, x.shape[dim], eps)
    return (y if weight is None else y * weight.view(channel_shape(x, channels_first))), sum_square


def _backward(gy: Tensor, x: Tensor, sum_square: Tensor, weight: Tensor | None, eps: float,
              channels_first: bool) -> tuple[Tensor, Tensor | None]:
    """(dL/dx, dL/dgamma). Compiled: one loop per row for dL/dx, one of per-channel sums for dL/dgamma."""
    dim = channel_dim(x, channels_first)
    rstd = _rstd(sum_square, x.shape[dim], eps)
    x_hat = _upcast(x) * rstd
    g = gy if weight is None else gy * weight.view(channel_shape(x, channels_first))
    g_x = rstd * (g - x_hat * ((g * x_hat).sum(dim, keepdim=True) * (1 / x.shape[dim])))
    g_weight = None if weight is None else channel_sums(gy * x_hat, channels_first)
    return g_x, g_weight


_KERNELS = Kernels(forward=_forward, backward=_backward, native=native.RMS)


class _RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor | None, eps: float, channels_first: bool,
                kernels: Any) -> Tensor:
        y, sum_square = kernels.forward(x, weight, eps, channels_first)
        ctx.save_for_backward(x, sum_square, weight)
        ctx.config, ctx.kernels = (eps, channels_first), kernels
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, gy: Tensor) -> tuple[Tensor | None, ...]:
        x, sum_square, weight = ctx.saved_tensors
        g_x, g_weight = ctx.kernels.backward(gy, x, sum_square, weight, *ctx.config)
        return g_x, g_weight, None, None, None


def rms_norm(x: Tensor, weight: Tensor | None, eps: float, channels_first: bool, mode: str) -> Tensor:
    """``x / sqrt(mean_c(x^2) + eps) * weight`` through the fused Function, its kernels ``native``,
    ``compiled`` or ``eager``."""
    return _RMSNormFunction.apply(x, weight, eps, channels_first, _KERNELS.get(mode))
