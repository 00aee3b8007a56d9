"""DyT's fused path (``norm.kernels=compiled|eager``): one autograd Function that saves only its input. Its
forward is one pass; its backward two loops: one reduction for the alpha, gamma and beta gradients, one pass
for dL/dx. Compiled, tanh is the rational function :func:`fast_tanh` (within 2e-8 of tanh; float32
evaluation within 4e-7, a few ulps), because the library tanh in compiled CPU code costs several times a
memory pass; the sigmoid is ``(1 + tanh(z / 2)) / 2`` with the same tanh. Compiled, DyT costs what a
compiled RMSNorm costs (DyT paper, arXiv 2503.10622 v2, Table 15).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.function import once_differentiable

from . import Kernels

# tanh(z) ~ z P(z^2) / Q(z^2) on |z| <= 9 (and +-1 beyond, where |tanh(z) - 1| < 3e-8): a [9/8] rational
# function fitted here by iteratively reweighted least squares; max |error| 1.9e-8 in float64.
_TANH_P = (0.99999990631, 0.13373210947, 0.0034865983045, 2.0472125529e-05, 1.3184672548e-08)
_TANH_Q = (1.0, 0.46706507791, 0.025842039893, 0.00032714133389, 7.7028391063e-07)
_TANH_CLAMP = 9.0


def fast_tanh(z: torch.Tensor) -> torch.Tensor:
    """tanh from multiply-adds and one division (no transcendental): what compiles to a cheap fused loop."""
    z = z.clamp(-_TANH_CLAMP, _TANH_CLAMP)
    s = z * z
    p, q = _TANH_P[-1], _TANH_Q[-1]
    for a, b in zip(_TANH_P[-2::-1], _TANH_Q[-2::-1], strict=True):
        p, q = p * s + a, q * s + b
    return z * p / q


def _squash(z: torch.Tensor, squash: str) -> torch.Tensor:
    if squash == "tanh":
        return fast_tanh(z)
    if squash == "sigmoid":
        return 0.5 + 0.5 * fast_tanh(0.5 * z)
    if squash == "hardtanh":
        return z.clamp(-1.0, 1.0)
    return z


def _squash_slope(t: torch.Tensor, z: torch.Tensor, squash: str) -> torch.Tensor | float:
    """d squash / dz from its output t (and input z)."""
    if squash == "tanh":
        return 1 - t * t
    if squash == "sigmoid":
        return t * (1 - t)
    if squash == "hardtanh":  # as torch's: gradient 1 strictly inside (-1, 1)
        return ((z > -1) & (z < 1)).to(z.dtype)
    return 1.0


def _channel_dim(x: torch.Tensor, channels_first: bool) -> int:
    return 1 if channels_first and x.dim() > 2 else x.dim() - 1


def _channel_shape(x: torch.Tensor, channels_first: bool) -> tuple[int, ...]:
    """The shape that broadcasts a per-channel vector against x."""
    return (-1,) + (1,) * (x.dim() - 1 - _channel_dim(x, channels_first))


def _dyt_forward(x: torch.Tensor, alpha: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                 squash: str, channels_first: bool) -> torch.Tensor:
    shape = _channel_shape(x, channels_first)
    return _squash(alpha * x, squash) * weight.view(shape) + bias.view(shape)


def _dyt_backward(gy: torch.Tensor, x: torch.Tensor, alpha: torch.Tensor, weight: torch.Tensor, squash: str,
                  channels_first: bool, alpha_grad: bool) -> tuple[torch.Tensor | None, ...]:
    """(dL/dx, dL/dalpha, dL/dgamma, dL/dbeta). Compiled: one loop of per-channel sums, one for dL/dx."""
    z = alpha * x
    t = _squash(z, squash)
    g_t = gy * _squash_slope(t, z, squash)
    dims = tuple(i for i in range(x.dim()) if i != _channel_dim(x, channels_first))
    # dL/dalpha = sum_c gamma_c sum_n g_t x: its per-channel sums share one loop with gamma's and beta's
    g_alpha = (weight * (g_t * x).sum(dims)).sum().view(1) if alpha_grad else None
    g_x = g_t * (weight * alpha).view(_channel_shape(x, channels_first))
    return g_x, g_alpha, (gy * t).sum(dims), gy.sum(dims)


_KERNELS = Kernels(forward=_dyt_forward, backward=_dyt_backward)


class _DyTFunction(torch.autograd.Function):
    """DyT with a one-pass forward and a one-pass backward; saves only x (and the parameters)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, alpha: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                squash: str, channels_first: bool, kernels: Any) -> torch.Tensor:
        ctx.save_for_backward(x, alpha, weight)
        ctx.config, ctx.kernels = (squash, channels_first), kernels
        return kernels.forward(x, alpha, weight, bias, squash, channels_first)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, gy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, alpha, weight = ctx.saved_tensors
        squash, channels_first = ctx.config
        grads = ctx.kernels.backward(gy, x, alpha, weight, squash, channels_first, ctx.needs_input_grad[1])
        return *grads, None, None, None


def dyt(x: torch.Tensor, alpha: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, squash: str,
        channels_first: bool, mode: str) -> torch.Tensor:
    """``weight * squash(alpha * x) + bias`` through the fused Function, its kernels ``compiled`` or
    ``eager``."""
    return _DyTFunction.apply(x, alpha, weight, bias, squash, channels_first, _KERNELS.get(mode))
