"""Dynamic Tanh (Zhu et al., CVPR 2025, arXiv 2503.10622 Sec. 4 and Algorithm 1; official
``dynamic_tanh.py`` in github.com/jiachenzhu/DyT): ``gamma * squash(alpha * x) + beta``.

``alpha`` is one scalar per layer (init ``alpha0`` = 0.5), ``gamma``/``beta`` are per channel.
No statistics, no reduction: purely element-wise.

Ablation options (paper Tables 7-8):

* ``squash``: ``"tanh"`` (DyT), ``"hardtanh"`` (clamp to [-1, 1]), ``"sigmoid"``, ``"identity"``
  (``gamma * alpha * x + beta``; diverges in Table 7). The paper does not say whether its sigmoid was
  shifted or rescaled, so it is the plain logistic ``1 / (1 + exp(-alpha x))`` with outputs in (0, 1).
* ``learnable_alpha=False`` keeps alpha fixed at ``alpha0`` (a buffer, still in the state_dict);
  the "without alpha" rows of Table 8 are ``learnable_alpha=False, alpha0=1.0``.

``kernels`` (the paper's Table 15, v2: compiled, DyT costs what a compiled RMSNorm costs):

* ``"autograd"``: the definition in plain ops, autograd derives the backward.
* ``"compiled"``: one autograd Function whose forward (one pass: ``y``) and backward (two loops: one reduction
  for the alpha, gamma and beta gradients, one pass for dL/dx) are each compiled by ``torch.compile``; it
  saves only the input. There tanh is the rational function :func:`fast_tanh` (within 2e-8 of tanh; float32
  evaluation stays within 4e-7, a few float32 ulps), because the library tanh in compiled CPU code costs
  several times a memory pass; the sigmoid is ``(1 + tanh(z / 2)) / 2`` with the same tanh.
* ``"eager"``: the same Function and kernels, run op by op (slow; for testing the kernels uncompiled).
* ``"auto"``: ``"compiled"`` for inputs of at least ``COMPILE_MIN_NUMEL`` elements where torch.compile
  works, once their shape has run ``COMPILE_AFTER_CALLS`` times (a compile costs seconds per shape), else
  ``"autograd"``; inside an outer ``torch.compile`` always ``"autograd"``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from .functional import (
    KERNEL_MODES,
    Kernels,
    channel_affine,
    check_data_format,
    check_kernels,
    output_dtype,
    resolve_kernels,
)
from .registry import register_norm

SQUASH: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "tanh": torch.tanh,
    "hardtanh": F.hardtanh,
    "sigmoid": torch.sigmoid,
    "identity": lambda x: x,
}

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


@register_norm("dyt")
class DyT(nn.Module):
    hparam_checks: ClassVar[dict[str, dict[str, Any]]] = {
        "alpha0": {"above": 0}, "squash": {"choices": sorted(SQUASH)},
        "kernels": {"choices": list(KERNEL_MODES)}}

    def __init__(self, dim: int, alpha0: float = 0.5, data_format: str = "channels_last",
                 squash: str = "tanh", learnable_alpha: bool = True, kernels: str = "auto") -> None:
        super().__init__()
        if squash not in SQUASH:
            raise ValueError(f"DyT squash must be one of {sorted(SQUASH)}, got '{squash}'")
        self.dim, self.squash = dim, squash
        self.data_format = check_data_format(data_format)
        self.kernels = check_kernels(kernels)
        alpha = torch.full((1,), float(alpha0))
        if learnable_alpha:
            self.alpha = nn.Parameter(alpha)
        else:
            self.register_buffer("alpha", alpha)
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mode = resolve_kernels(self.kernels, x, (DyT, self.squash, self.data_format))
        if mode == "autograd":
            y = channel_affine(SQUASH[self.squash](self.alpha * x), self.weight, self.bias, self.data_format)
        else:
            y = _DyTFunction.apply(x, self.alpha, self.weight, self.bias, self.squash,
                                   self.data_format == "channels_first", _KERNELS.get(mode))
        return y.to(output_dtype(x))

    def extra_repr(self) -> str:
        learnable = isinstance(self.alpha, nn.Parameter)
        return (f"{self.dim}, alpha0={self.alpha.item():.3g}, squash={self.squash}, "
                f"learnable_alpha={learnable}, data_format={self.data_format}")
