"""The fused path of the point-wise normalizers ``gamma * f(alpha * x + s) + beta`` -- DyT (``f = tanh``, no
shift, and its ablations' squashes), Derf and every function of :mod:`normexp.norms.pointwise`
(``norm.kernels=native|compiled|eager``): one autograd Function that saves only its input (and the
parameters), for every ``f`` that supplies its value and its derivative (:data:`FUNCTIONS`), transformed by
the function-property options (:class:`PointOptions`) and with a scalar or per-channel shift. Its forward is
one pass; its backward, compiled, two loops (one reduction for the alpha, shift, gamma and beta gradients,
one for dL/dx), and one in the native CPU loops (:mod:`.native`).

tanh and erf are rational functions (:func:`fast_tanh`, :func:`fast_erf`: within 2e-8 and 4e-8; float32
evaluation within 4e-7, a few ulps), because the library tanh and erf in compiled CPU code cost several
memory passes each; the sigmoid is ``(1 + tanh(z / 2)) / 2`` with the same tanh. Compiled, DyT costs what
a compiled RMSNorm costs (DyT paper, arXiv 2503.10622 v2, Table 15).

Kinks: each derivative is the one torch's autograd gives through the plain definition, so the two paths
agree everywhere: the clips (``clamp``, ``hardtanh``) pass the gradient only strictly inside, 0 on their
boundary, and so does the flat zone's shrink; ``sign(u)`` has slope 0, so ``expsign``, ``saturlog`` and
``logsign(_clip)`` have slope 0 at exactly u = 0 (their one-sided limits are 1); ``exproot`` and
``power23(_clip)`` have an infinite slope at 0, where both paths give NaN (as Derf's code does).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch.autograd.function import once_differentiable

from . import Kernels, native

Tensor = torch.Tensor

# tanh(z) ~ z P(z^2) / Q(z^2) on |z| <= 9 (and +-1 beyond, where |tanh(z) - 1| < 3e-8): a [9/8] rational
# function fitted here by iteratively reweighted least squares; max |error| 1.9e-8 in float64.
_TANH = ((0.99999990631, 0.13373210947, 0.0034865983045, 2.0472125529e-05, 1.3184672548e-08),
         (1.0, 0.46706507791, 0.025842039893, 0.00032714133389, 7.7028391063e-07), 9.0)
# erf(z) likewise on |z| <= 3.92 (+-1 beyond, where |erf(z) - 1| < 4e-8): [13/10], max |error| 3.7e-8
_ERF = ((1.1283791754, 0.18389709003, 0.053798876744, 0.0037526428218, 0.000363434369, 4.2703968976e-06,
         -1.0883767249e-08),
        (1.0, 0.49630801902, 0.11311338814, 0.015210239557, 0.00126638203, 5.9239031228e-05), 3.92)


def _odd_rational(z: Tensor, p_coefs: tuple[float, ...], q_coefs: tuple[float, ...], clamp: float) -> Tensor:
    """``z P(z^2) / Q(z^2)`` on the clamped z: multiply-adds and one division, no transcendental."""
    z = z.clamp(-clamp, clamp)
    s = z * z
    p, q = p_coefs[-1], q_coefs[-1]
    for a in p_coefs[-2::-1]:
        p = p * s + a
    for b in q_coefs[-2::-1]:
        q = q * s + b
    return z * p / q


def fast_tanh(z: Tensor) -> Tensor:
    """tanh within 2e-8 (float32 evaluation within 4e-7, a few ulps)."""
    return _odd_rational(z, *_TANH)


def fast_erf(z: Tensor) -> Tensor:
    """erf within 4e-8 (float32 evaluation within 4e-7, a few ulps)."""
    return _odd_rational(z, *_ERF)


class PointFunction(NamedTuple):
    """A point-wise ``f``: its value ``f(u)`` and its slope ``f'(u)`` from ``u`` and ``t = f(u)``."""

    value: Callable[[Tensor], Tensor]
    slope: Callable[[Tensor, Tensor], Tensor | float]


def _inside(v: Tensor, low: float = -1.0, high: float = 1.0) -> Tensor:
    """clamp's (and hardtanh's) gradient mask: 1 strictly inside (low, high), 0 on the boundary, as autograd
    gives it."""
    return ((v > low) & (v < high)).to(v.dtype)


def _nonzero(u: Tensor) -> Tensor:
    """sign(u)^2: the factor autograd's zero slope of sign (and of abs) at exactly 0 leaves."""
    return (u != 0).to(u.dtype)


def _saturlog(u: Tensor) -> Tensor:
    log = torch.log(u.abs() + 1)
    return torch.sign(u) * log / (log + 1)


def _exproot_slope(u: Tensor, t: Tensor) -> Tensor:
    root = u.abs().sqrt()
    return _nonzero(u) * torch.exp(-root) / (2 * root)  # 0 * inf = NaN at u = 0, as autograd's


_TWO_OVER_SQRT_PI = 2 / math.sqrt(math.pi)
# how a point-wise layer's alpha starts: at alpha0, or from a pretrained LN model (normexp.tasks.conversion)
ALPHA_INITS = ("alpha0", "calibrate")


def check_alpha_init(value: str) -> str:
    if value not in ALPHA_INITS:
        raise ValueError(f"alpha_init must be one of {ALPHA_INITS}, got '{value}'")
    return value


def _power23(u: Tensor) -> Tensor:
    """sign(u) |u|^(2/3) as exp(2/3 log|u|): a quarter of pow's time compiled on the CPU, within a few float32
    ulps."""
    return torch.sign(u) * torch.exp(torch.log(u.abs()) * (2 / 3))


_IDENTITY = PointFunction(lambda u: u, lambda u, t: 1.0)

# every f the fused Function computes: DyT's squashes and the point-wise family (pointwise.FUNCTIONS)
FUNCTIONS: dict[str, PointFunction] = {
    "tanh": PointFunction(fast_tanh, lambda u, t: 1 - t * t),
    "sigmoid": PointFunction(lambda u: 0.5 + 0.5 * fast_tanh(0.5 * u), lambda u, t: t * (1 - t)),
    "hardtanh": PointFunction(lambda u: u.clamp(-1.0, 1.0), lambda u, t: _inside(u)),
    "identity": _IDENTITY,
    "erf": PointFunction(fast_erf, lambda u, t: _TWO_OVER_SQRT_PI * torch.exp(-u * u)),
    "satursin": PointFunction(lambda u: torch.sin(u.clamp(-math.pi / 2, math.pi / 2)),
                              lambda u, t: torch.cos(u) * _inside(u, -math.pi / 2, math.pi / 2)),
    "isru": PointFunction(lambda u: u * torch.rsqrt(u * u + 1), lambda u, t: torch.rsqrt(u * u + 1) ** 3),
    "expsign": PointFunction(lambda u: torch.sign(u) * (1 - torch.exp(-u.abs())),
                             lambda u, t: _nonzero(u) * torch.exp(-u.abs())),
    "smoothsign": PointFunction(lambda u: u / (1 + u.abs()), lambda u, t: (1 + u.abs()) ** -2),
    "relsign": PointFunction(lambda u: u / (torch.sqrt(u * u + 1) + 1),
                             lambda u, t: 1 / (torch.sqrt(u * u + 1) * (torch.sqrt(u * u + 1) + 1))),
    "cubsign": PointFunction(lambda u: u ** 3 / (u.abs() ** 3 + 1),
                             lambda u, t: 3 * u * u / (u.abs() ** 3 + 1) ** 2),
    "exproot": PointFunction(lambda u: torch.sign(u) * (1 - torch.exp(-u.abs().sqrt())), _exproot_slope),
    "saturlog": PointFunction(_saturlog, lambda u, t: _nonzero(u) * (1 - t.abs()) ** 2 / (u.abs() + 1)),
    "arctan": PointFunction(lambda u: torch.atan(u) * (2 / math.pi),
                            lambda u, t: (2 / math.pi) / (1 + u * u)),
    # the clips: clamp's slope is nonzero exactly where |f(u)| < 1 (strictly), read off the output
    "linear_clip": PointFunction(lambda u: u.clamp(-1, 1), lambda u, t: _inside(t)),
    "power23_clip": PointFunction(lambda u: _power23(u).clamp(-1, 1),
                                  lambda u, t: _inside(t) * (2 / 3) * t / u),  # 0 / 0 = NaN at u = 0
    "logsign_clip": PointFunction(lambda u: (torch.sign(u) * torch.log(u.abs() + 1)).clamp(-1, 1),
                                  lambda u, t: _inside(t) * _nonzero(u) / (u.abs() + 1)),
    "smoothsign_clip": PointFunction(lambda u: (u / (1 + u.abs())).clamp(-1, 1),
                                     lambda u, t: _inside(t) * (1 + u.abs()) ** -2),
    "logquad_clip": PointFunction(lambda u: (torch.sign(u) * torch.log(u * u + 1)).clamp(-1, 1),
                                  lambda u, t: _inside(t) * 2 * u.abs() / (u * u + 1)),
    "arcsinh_clip": PointFunction(lambda u: torch.asinh(u).clamp(-1, 1),
                                  lambda u, t: _inside(t) * torch.rsqrt(u * u + 1)),
    # unbounded (Derf Tables 2 and 4) and non-monotone (Table 6)
    "arcsinh": PointFunction(torch.asinh, lambda u, t: torch.rsqrt(u * u + 1)),
    "logsign": PointFunction(lambda u: torch.sign(u) * torch.log(u.abs() + 1),
                             lambda u, t: _nonzero(u) / (u.abs() + 1)),
    "logquad": PointFunction(lambda u: torch.sign(u) * torch.log(u * u + 1),
                             lambda u, t: 2 * u.abs() / (u * u + 1)),
    "power23": PointFunction(_power23, lambda u, t: (2 / 3) * t / u),  # 0 / 0 = NaN at u = 0
    "linear": _IDENTITY,
    "sin": PointFunction(torch.sin, lambda u, t: torch.cos(u)),
    "dampx": PointFunction(lambda u: 2 * u / (1 + u * u), lambda u, t: 2 * (1 - u * u) / (1 + u * u) ** 2),
    "dampexp": PointFunction(lambda u: 2.72 * u * torch.exp(-u.abs()),
                             lambda u, t: 2.72 * torch.exp(-u.abs()) * (1 - u.abs())),
}


class PointOptions(NamedTuple):
    """The function-property options of Derf's Sec. 3 and 7 (arXiv 2512.10938), each an identity at its
    default: ``f(u)`` becomes ``(1 - blend) * sign * clip(f(v), -clip, clip) + blend * v + output_shift`` at
    ``v = shrink(prescale * u, flat)``, ``shrink`` the flat zone (0 on [-flat, flat], ``v -+ flat`` outside:
    Table 5), ``sign`` -1 when ``negate`` (Table 6), ``blend`` the mix with the identity (Table 3),
    ``output_shift`` the vertical shift (Table 1), ``prescale`` Table 16's fixed epsilon."""

    prescale: float = 1.0
    flat: float = 0.0
    clip: float | None = None
    negate: bool = False
    blend: float = 0.0
    output_shift: float = 0.0

    def changed(self) -> dict[str, Any]:
        """The options not at their defaults."""
        return {k: v for k, v in self._asdict().items() if v != self._field_defaults[k]}


PLAIN = PointOptions()


def transformed(f: Callable[[Tensor], Tensor], options: PointOptions, u: Tensor,
                slope: Callable[[Tensor, Tensor], Tensor | float] | None = None) -> tuple[Tensor, Any]:
    """``g(u)``, ``f`` under ``options`` -- the definition under autograd, the fused kernels' value -- and,
    given ``f``'s ``slope``, ``g'(u)`` (else None); an option at its default adds no operation."""
    o = options
    v = u * o.prescale if o.prescale != 1 else u
    if o.flat:
        outside = (v.abs() > o.flat).to(v.dtype)  # no gradient: autograd's shrink slope is 0 on [-flat, flat]
        v = (v - o.flat * torch.sign(v)) * outside
    t = f(v)
    y = t.clamp(-o.clip, o.clip) if o.clip is not None else t
    y = -y if o.negate else y
    y = (1 - o.blend) * y + o.blend * v if o.blend else y
    y = y + o.output_shift if o.output_shift else y
    if slope is None:
        return y, None
    g = slope(v, t)
    g = g * _inside(t, -o.clip, o.clip) if o.clip is not None else g
    g = -g if o.negate else g
    g = (1 - o.blend) * g + o.blend if o.blend else g
    g = g * outside if o.flat else g
    return y, g * o.prescale if o.prescale != 1 else g


def channel_dim(x: Tensor, channels_first: bool) -> int:
    return 1 if channels_first and x.dim() > 2 else x.dim() - 1


def channel_shape(x: Tensor, channels_first: bool) -> tuple[int, ...]:
    """The shape that broadcasts a per-channel vector against x."""
    return (-1,) + (1,) * (x.dim() - 1 - channel_dim(x, channels_first))


def channel_sums(v: Tensor, channels_first: bool) -> Tensor:
    """Per-channel sums over every other dim. On the CPU, channels last, in two stages over blocks of rows:
    compiled, one sum down the columns of a (rows, C) tensor runs at a third of the speed of a read (it
    walks each block of channels down all rows), over blocks of 16 rows at about the speed of a read."""
    dim = channel_dim(v, channels_first)
    rows = v.numel() // v.shape[dim]
    block = next((b for b in (16, 8, 4, 2) if rows % b == 0), 1)
    if dim != v.dim() - 1 or v.device.type != "cpu" or block == 1:
        return v.sum([i for i in range(v.dim()) if i != dim])
    return v.reshape(rows // block, block, v.shape[dim]).sum(1).sum(0)


def _pre(x: Tensor, alpha: Tensor, shift: Tensor | None, channels_first: bool) -> Tensor:
    """alpha x + shift, the shift a scalar or one per channel."""
    return alpha * x if shift is None else alpha * x + shift.view(channel_shape(x, channels_first))


def _forward(x: Tensor, alpha: Tensor, shift: Tensor | None, weight: Tensor, bias: Tensor, fn: str,
             channels_first: bool, options: PointOptions) -> Tensor:
    shape = channel_shape(x, channels_first)
    t, _ = transformed(FUNCTIONS[fn].value, options, _pre(x, alpha, shift, channels_first))
    return t * weight.view(shape) + bias.view(shape)


def _backward(gy: Tensor, x: Tensor, alpha: Tensor, shift: Tensor | None, weight: Tensor, fn: str,
              channels_first: bool, options: PointOptions, alpha_grad: bool,
              shift_grad: bool) -> tuple[Tensor | None, ...]:
    """(dL/dx, dL/dalpha, dL/dshift, dL/dgamma, dL/dbeta). Compiled: one loop of per-channel sums, one for
    dL/dx."""
    f = FUNCTIONS[fn]
    t, slope = transformed(f.value, options, _pre(x, alpha, shift, channels_first), f.slope)
    g_u = gy * slope
    # dL/dalpha = sum_c gamma_c sum_n g_u x: its per-channel sums share one loop with gamma's and beta's
    g_alpha = (weight * channel_sums(g_u * x, channels_first)).sum().view(1) if alpha_grad else None
    g_shift = weight * channel_sums(g_u, channels_first) if shift_grad else None
    if g_shift is not None and shift.numel() == 1:  # a scalar shift: the sum of every channel's share
        g_shift = g_shift.sum().view(1)
    g_x = g_u * (weight * alpha).view(channel_shape(x, channels_first))
    return g_x, g_alpha, g_shift, channel_sums(gy * t, channels_first), channel_sums(gy, channels_first)


_KERNELS = Kernels(forward=_forward, backward=_backward, native=native.POINTWISE)


class _PointWiseFunction(torch.autograd.Function):
    """``gamma * f(alpha * x + s) + beta`` with a one-pass forward and a one-pass backward; saves only x (and
    the parameters)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, alpha: Tensor, shift: Tensor | None, weight: Tensor, bias: Tensor,
                fn: str, channels_first: bool, options: PointOptions, kernels: Any) -> Tensor:
        ctx.save_for_backward(x, alpha, shift, weight)
        ctx.config, ctx.kernels = (fn, channels_first, options), kernels
        return kernels.forward(x, alpha, shift, weight, bias, fn, channels_first, options)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, gy: Tensor) -> tuple[Tensor | None, ...]:
        x, alpha, shift, weight = ctx.saved_tensors
        grads = ctx.kernels.backward(gy, x, alpha, shift, weight, *ctx.config, ctx.needs_input_grad[1],
                                     ctx.needs_input_grad[2])
        return *grads, None, None, None, None


def pointwise(x: Tensor, alpha: Tensor, shift: Tensor | None, weight: Tensor, bias: Tensor, fn: str,
              channels_first: bool, mode: str, options: PointOptions = PLAIN) -> Tensor:
    """``weight * g(alpha * x + shift) + bias`` (shift: a scalar, one per channel, or None) through the fused
    Function, its kernels ``native``, ``compiled`` or ``eager``; ``g`` one of :data:`FUNCTIONS` under
    ``options``."""
    return _PointWiseFunction.apply(x, alpha, shift, weight, bias, fn, channels_first, options,
                                    _KERNELS.get(mode))
