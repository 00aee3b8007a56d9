"""DTN's computation (the steps of ``DTN.normalize``) in whole-tensor kernels, and its fused path
(``norm.kernels=compiled|eager``): steps 0-1 and 3-4 are autograd Functions with hand-written backward passes
that save their inputs only; ``autograd`` runs the same kernels as plain ops. Statistics are laid out
(H, h, w, B, d) so that each head's position matmul is one GEMM, and results are written through views into
preallocated (B, N, C) buffers.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from . import RECOMPUTE, Kernels

# Plain torch ops on whole tensors, used three ways (see ``DTN.kernels``): called directly, with autograd
# deriving the backward; inside _PrescaleStats / _Mix with their hand-written backward, op by op; or the
# same with each function compiled by torch.compile into a few fused loops. Grid-token results are written
# through (H, h, w, B, d) views into preallocated (B, N, C) buffers: the prefix tokens (LN statistics only,
# a few small ops) need no cat, and a channels-first map is written in its own layout.

def _prescale_stats(x: torch.Tensor, heads: int, eps: float, prefix: int, moments_grid: tuple[int, int] | None
                    ) -> tuple[torch.Tensor, ...]:
    """Steps (0)-(1): x (B, N, C) -> xs pre-scaled per head, rms (B, N, H, 1), mu_ln, var_ln (B, N) and, for
    ``moments_grid``, :func:`grid_moments`."""
    b, n, c = x.shape
    xh = x.view(b, n, heads, c // heads)
    rms = torch.rsqrt(xh.square().mean(-1, keepdim=True) + eps)
    # token-major whatever x's layout (a residual stream that began as a transposed patch embedding
    # has token stride 1): every later kernel reads xs channel-contiguous
    xs = (xh * rms).contiguous()
    mu = xs.mean((2, 3))
    var = (xs.square().mean((2, 3)) - mu.square()).clamp_min(0) * (c / (c - 1))  # unbiased, as torch.var
    moments = None
    if moments_grid is not None:
        moments = grid_moments(xs[:, prefix:].reshape(b, *moments_grid, heads, c // heads))
    return xs.view(b, n, c), rms, mu, var, moments


def grid_moments(z: torch.Tensor) -> torch.Tensor:
    """Grid tokens (B, h, w, H, d) -> (H, h, w, 2B, d): z and z*z side by side for one GEMM per head."""
    z = z.permute(3, 1, 2, 0, 4)
    return torch.cat((z, z * z), dim=3)


def _moments_backward(g_grid: torch.Tensor, g_moments: torch.Tensor, z: torch.Tensor) -> None:
    """Adds the gradient through :func:`grid_moments` to g_grid: dL/dz += dL/dmean + 2 z dL/dsecond."""
    b = z.shape[3]
    g_grid.copy_(g_grid + g_moments[:, :, :, :b] + 2 * z * g_moments[:, :, :, b:])


def _prescale_stats_backward(g_xs: torch.Tensor, g_mu: torch.Tensor, g_var: torch.Tensor, xs: torch.Tensor,
                             rms: torch.Tensor, mu: torch.Tensor) -> torch.Tensor:
    """dL/dx from the gradients of the outputs xs, mu_ln, var_ln of :func:`_prescale_stats`."""
    b, n, c = xs.shape
    xh = xs.view(b, n, rms.shape[2], -1)
    # var = (E[xs^2] - mu^2) c/(c-1), clamped at 0: d var / d xs = 2 (xs - mu) / (c - 1) where not clamped
    keep = xh.square().mean((2, 3)) - mu.square() >= 0
    g_var = torch.where(keep, g_var, 0) * (2 / (c - 1))
    mu = mu.view(b, n, 1, 1)
    g = g_xs.view(b, n, *xh.shape[2:]) + g_mu.view(b, n, 1, 1) / c + g_var.view(b, n, 1, 1) * (xh - mu)
    # xs = x rms with rms = (mean_d x^2 + eps)^-1/2:  dL/dx = rms (g - xs mean_d(g xs))
    return (rms * (g - xh * (g * xh).mean(-1, keepdim=True))).view(b, n, c)


def _head_major(t: torch.Tensor, prefix: int, grid: tuple[int, int], heads: int) -> torch.Tensor:
    """(H, h, w, B, d) view of the grid tokens of a (B, N, C) tensor (no copy)."""
    b = t.shape[0]
    return t[:, prefix:].reshape(b, *grid, heads, -1).permute(3, 1, 2, 0, 4)


def _mix_terms(xs: torch.Tensor, stats: torch.Tensor, mu_ln: torch.Tensor, var_ln: torch.Tensor,
               lam_mu: torch.Tensor | None, lam_var: torch.Tensor, eps: float, prefix: int, from_moments: bool
               ) -> tuple[torch.Tensor, ...]:
    """Per-element terms of steps (3)-(4) on the grid tokens, in (H, h, w, B, d) order:
    (y, rstd, var_in, E_P[z^2] - mu_in^2 or None, mu_in, mu_ln, var_ln)."""
    heads = lam_var.shape[0]
    grid = (stats.shape[2], stats.shape[3])
    mu_in, sec = stats[0].permute(3, 1, 2, 0, 4), stats[1].permute(3, 1, 2, 0, 4)
    mu_g = mu_ln[:, prefix:].reshape(-1, *grid).permute(1, 2, 0)[None, ..., None]  # (1, h, w, B, 1)
    var_g = var_ln[:, prefix:].reshape(-1, *grid).permute(1, 2, 0)[None, ..., None]
    var_raw = sec - mu_in * mu_in if from_moments else None
    var_in = var_raw.clamp_min(0) if from_moments else sec  # E[z^2] - E[z]^2 >= 0
    rstd = torch.rsqrt(var_in + lam_var.view(heads, 1, 1, 1, 1) * (var_g - var_in) + eps)
    mu = mu_g if lam_mu is None else mu_in + lam_mu.view(heads, 1, 1, 1, 1) * (mu_g - mu_in)
    y = (_head_major(xs, prefix, grid, heads) - mu) * rstd
    return y, rstd, var_in, var_raw, mu_in, mu_g, var_g


def _mix(out_grid: torch.Tensor, xs: torch.Tensor, stats: torch.Tensor, mu_ln: torch.Tensor,
         var_ln: torch.Tensor, lam_mu: torch.Tensor | None, lam_var: torch.Tensor, weight: torch.Tensor,
         bias: torch.Tensor, eps: float, prefix: int, from_moments: bool) -> None:
    """Steps (3)-(4) on the grid tokens, written into out_grid; ``stats`` (2, B, h, w, H, d) is mu_in and
    E_P[z^2] (``from_moments``) or var_in."""
    heads = lam_var.shape[0]
    y = _mix_terms(xs, stats, mu_ln, var_ln, lam_mu, lam_var, eps, prefix, from_moments)[0]
    out_grid.copy_(y * weight.view(heads, 1, 1, 1, -1) + bias.view(heads, 1, 1, 1, -1))


def ln_prefix(xs: torch.Tensor, mu_ln: torch.Tensor, var_ln: torch.Tensor, eps: float) -> torch.Tensor:
    """Prefix tokens (B, P, C) standardised with their LN statistics only (before the affine)."""
    return (xs - mu_ln[..., None]) * torch.rsqrt(var_ln[..., None] + eps)


def _mix_backward(g_grid: torch.Tensor, gy: torch.Tensor, xs: torch.Tensor, stats: torch.Tensor,
                  mu_ln: torch.Tensor, var_ln: torch.Tensor, lam_mu: torch.Tensor | None,
                  lam_var: torch.Tensor, weight: torch.Tensor, eps: float, prefix: int,
                  from_moments: bool) -> tuple[torch.Tensor, ...]:
    """The per-element backward of :func:`_mix` in one pass: writes dL/dx into g_grid and returns
    (dL/dstats, the weight gradient's sum, per-head channel sums the caller needs)."""
    heads = lam_var.shape[0]
    grid = (stats.shape[2], stats.shape[3])
    y, rstd, var_in, var_raw, mu_in, _, _ = _mix_terms(xs, stats, mu_ln, var_ln, lam_mu, lam_var, eps, prefix,
                                                       from_moments)
    g_out = _head_major(gy, prefix, grid, heads)
    gx = g_out * weight.view(heads, 1, 1, 1, -1) * rstd
    g_var = -0.5 * gx * y * rstd
    g_grid.copy_(gx)
    if lam_mu is None:  # only_var: the mean is the LN mean
        g_mu_in = torch.zeros_like(gx)
        gx_mu = g_mu_in
    else:
        g_mu_in = gx * (lam_mu.view(heads, 1, 1, 1, 1) - 1)
        gx_mu = gx * mu_in
    g_sec = g_var * (1 - lam_var.view(heads, 1, 1, 1, 1))
    if from_moments:  # var_in = max(E[z^2] - mu_in^2, 0)
        g_sec = torch.where(var_raw >= 0, g_sec, 0)
        g_mu_in = g_mu_in - 2 * mu_in * g_sec
    sums = torch.stack((g_var.sum(-1), (g_var * var_in).sum(-1), gx.sum(-1), gx_mu.sum(-1)))
    return torch.stack((g_mu_in, g_sec), dim=3), (g_out * y).sum(3), sums


_KERNELS = Kernels(RECOMPUTE, prescale_stats=_prescale_stats,
                   prescale_stats_backward=_prescale_stats_backward, moments_backward=_moments_backward,
                   mix=_mix, mix_backward=_mix_backward)


class _PrescaleStats(torch.autograd.Function):
    """Steps (0)-(1) (and the grid moments) with a hand-written backward; saves xs, rms and mu_ln only."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, heads: int, eps: float, prefix: int,
                moments_grid: tuple[int, int] | None, kernels: Any) -> tuple[torch.Tensor, ...]:
        xs, rms, mu, var, moments = kernels.prescale_stats(x, heads, eps, prefix, moments_grid)
        ctx.save_for_backward(xs, rms, mu)
        ctx.prefix, ctx.moments_grid, ctx.kernels = prefix, moments_grid, kernels
        return (xs, mu, var) if moments is None else (xs, mu, var, moments)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, g_xs: torch.Tensor, g_mu: torch.Tensor, g_var: torch.Tensor,
                 g_moments: torch.Tensor | None = None) -> tuple[torch.Tensor | None, ...]:
        xs, rms, mu = ctx.saved_tensors
        if g_moments is not None:  # the grid tokens also feed the moments
            heads = rms.shape[2]
            g_xs = g_xs.clone(memory_format=torch.contiguous_format)
            ctx.kernels.moments_backward(_head_major(g_xs, ctx.prefix, ctx.moments_grid, heads), g_moments,
                                         _head_major(xs, ctx.prefix, ctx.moments_grid, heads))
        g_x = ctx.kernels.prescale_stats_backward(g_xs, g_mu, g_var, xs, rms, mu)
        return g_x, None, None, None, None, None


class _Mix(torch.autograd.Function):
    """Steps (3)-(4) with a hand-written backward; saves its inputs only (y and rstd are recomputed)."""

    @staticmethod
    def forward(ctx: Any, xs: torch.Tensor, stats: torch.Tensor, mu_ln: torch.Tensor, var_ln: torch.Tensor,
                lam_mu: torch.Tensor | None, lam_var: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                eps: float, prefix: int, from_moments: bool, map_size: tuple[int, int] | None,
                kernels: Any) -> torch.Tensor:
        out = _output_buffer(xs, map_size)
        grid, heads = (stats.shape[2], stats.shape[3]), lam_var.shape[0]
        kernels.mix(_head_major(out, prefix, grid, heads), xs, stats, mu_ln, var_ln, lam_mu, lam_var, weight,
                    bias, eps, prefix, from_moments)
        if prefix:
            y_p = ln_prefix(xs[:, :prefix], mu_ln[:, :prefix], var_ln[:, :prefix], eps)
            torch.addcmul(bias, y_p, weight, out=out[:, :prefix])
        ctx.save_for_backward(xs, stats, mu_ln, var_ln, lam_mu, lam_var, weight)
        ctx.config, ctx.kernels = (eps, prefix, from_moments), kernels
        # a map's (B, C, H, W) buffer itself: autograd forbids in-place writes (a ResNet's `out += identity`)
        # to views of a view a custom Function returns, and allows them to views of its output
        return out if map_size is None else out._base

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, gy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        xs, stats, mu_ln, var_ln, lam_mu, lam_var, weight = ctx.saved_tensors
        eps, prefix, from_moments = ctx.config
        b, n, c = xs.shape
        if gy.dim() == 4:  # the gradient of a map's (B, C, H, W) buffer
            gy = gy.permute(0, 2, 3, 1).reshape(b, n, c)
        grid, heads = (stats.shape[2], stats.shape[3]), lam_var.shape[0]
        g_xs = torch.empty_like(xs)
        g_stats, g_out_y, sums = ctx.kernels.mix_backward(_head_major(g_xs, prefix, grid, heads), gy, xs,
                                                          stats, mu_ln, var_ln, lam_mu, lam_var, weight,
                                                          *ctx.config)
        # the reductions over tokens, from the per-head sums (4, H, h, w, B)
        s_var, s_var_in, s_x, s_x_mu = sums

        def token(t: torch.Tensor) -> torch.Tensor:  # (h, w, B) -> (B, h*w)
            return t.permute(2, 0, 1).reshape(b, -1)

        mu_g = mu_ln[:, prefix:].reshape(b, *grid).permute(1, 2, 0)  # (h, w, B)
        var_g = var_ln[:, prefix:].reshape(b, *grid).permute(1, 2, 0)
        g_var_ln = token((s_var * lam_var.view(heads, 1, 1, 1)).sum(0))
        g_lam_var = (s_var * var_g - s_var_in).sum((1, 2, 3))
        if lam_mu is None:
            g_mu_ln, g_lam_mu = -token(s_x.sum(0)), None
        else:
            g_mu_ln = -token((s_x * lam_mu.view(heads, 1, 1, 1)).sum(0))
            g_lam_mu = (s_x_mu - s_x * mu_g).sum((1, 2, 3))
        g_weight = g_out_y.sum((1, 2)).reshape(c)
        g_bias = gy.sum((0, 1))
        if prefix:  # LN statistics only
            rstd_p = torch.rsqrt(var_ln[:, :prefix, None] + eps)
            y_p = (xs[:, :prefix] - mu_ln[:, :prefix, None]) * rstd_p
            gx_p = torch.mul(gy[:, :prefix] * weight, rstd_p, out=g_xs[:, :prefix])
            g_mu_ln = torch.cat((-gx_p.sum(2), g_mu_ln), 1)
            g_var_ln = torch.cat(((gx_p * y_p).sum(2) * rstd_p[..., 0] * -0.5, g_var_ln), 1)
            g_weight += (gy[:, :prefix] * y_p).sum((0, 1))
        # (H, h, w, 2, B, d) -> (2, B, h, w, H, d): unpooled, the layout of the position matmuls' output
        return (g_xs, g_stats.permute(3, 4, 1, 2, 0, 5), g_mu_ln, g_var_ln, g_lam_mu, g_lam_var, g_weight,
                g_bias, None, None, None, None, None)


def _output_buffer(xs: torch.Tensor, map_size: tuple[int, int] | None) -> torch.Tensor:
    """An empty (B, N, C) output; for a channels-first map, a view of a (B, C, H, W) buffer."""
    if map_size is None:
        return torch.empty_like(xs)
    b, n, c = xs.shape
    return xs.new_empty(b, c, *map_size).permute(0, 2, 3, 1).view(b, n, c)


def pool_grid(z: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Adaptive average pooling of (B, h, w, C) grid tokens as two small matmuls
    (``adaptive_avg_pool2d``'s)."""
    b, h, w, c = z.shape
    ay, ax = (_pool_matrix(n, m, z.dtype, z.device) for n, m in ((h, size[0]), (w, size[1])))
    z = torch.matmul(ay, z.reshape(b, h, w * c)).view(b * size[0], w, c)
    return torch.matmul(ax, z).view(b, *size, c)


@functools.cache  # a few grid sizes per model; built once, not on every forward
def _pool_matrix(n: int, m: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """(m, n): row i averages the inputs of adaptive pooling bin i, [floor(i n/m), ceil((i+1) n/m))."""
    return F.adaptive_avg_pool1d(torch.eye(n, dtype=dtype, device=device), m).T.contiguous()


@functools.cache
def nearest_index(m: int, n: int, device: torch.device) -> torch.Tensor:
    """For each of n positions, the one of m that ``F.interpolate(mode="nearest")`` copies to it."""
    idx = torch.arange(m, dtype=torch.float32, device=device)[None, None]
    return F.interpolate(idx, size=n, mode="nearest").view(n).long()


def prescale_stats(x: torch.Tensor, heads: int, eps: float, prefix: int,
                   moments_grid: tuple[int, int] | None, mode: str) -> tuple[torch.Tensor, ...]:
    """Steps (0)-(1) on the path ``mode`` (autograd | eager | compiled): (xs, mu_ln, var_ln[, moments])."""
    if mode == "autograd":
        xs, _, mu_ln, var_ln, moments = _prescale_stats(x, heads, eps, prefix, moments_grid)
        return (xs, mu_ln, var_ln) if moments is None else (xs, mu_ln, var_ln, moments)
    return _PrescaleStats.apply(x, heads, eps, prefix, moments_grid, _KERNELS.get(mode))


def mix(xs: torch.Tensor, stats: torch.Tensor, mu_ln: torch.Tensor, var_ln: torch.Tensor,
        lam_mu: torch.Tensor | None, lam_var: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
        eps: float, prefix: int, from_moments: bool, map_size: tuple[int, int] | None, mode: str
        ) -> torch.Tensor:
    """Steps (3)-(4) on the path ``mode``: the (B, N, C) output (a view of a map for ``map_size``)."""
    args = (xs, stats, mu_ln, var_ln, lam_mu, lam_var, weight, bias, eps, prefix, from_moments)
    if mode != "autograd":
        y = _Mix.apply(*args, map_size, _KERNELS.get(mode))
        return y if map_size is None else y.permute(0, 2, 3, 1).view(xs.shape)
    y = _output_buffer(xs, map_size)
    grid, heads = (stats.shape[2], stats.shape[3]), lam_var.shape[0]
    _mix(_head_major(y, prefix, grid, heads), *args)
    if prefix:
        y[:, :prefix] = ln_prefix(xs[:, :prefix], mu_ln[:, :prefix], var_ln[:, :prefix], eps) * weight + bias
    return y

