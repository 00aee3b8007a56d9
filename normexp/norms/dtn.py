"""Dynamic Token Normalization (Shao et al., ICLR 2022, arXiv 2112.02624), following the official module
(github.com/wqshao126/DTN, ``models/normkit/norms/dtn.py``).

For input tokens x (T x C) with H heads (head h owns channels [h*d, (h+1)*d), d = C/H):

0. RMS pre-scaling per token and head: ``x <- x_h / sqrt(mean_j x_hj^2 + eps)`` ("l2 normalize for
   stability" in the official code).
1. Intra-token (LN) statistics over *all* C channels of each token: mean and **unbiased** variance
   (``torch.var`` in the official code), broadcast to every head.
2. Inter-token statistics per head with a position-aware matrix ``P^h`` (T' x T', columns sum to 1):
   ``mu_in = z @ P^h``, ``var_in = (z*z) @ P^h - mu_in^2`` (clamped at 0), where
   ``P^h[p, q] = softmax_p(pos_proj([dx, dy, dx^2 + dy^2])_h)`` is normalised over the *source* token p for
   each target token q, and ``dx = col(q) - col(p)``, ``dy = row(q) - row(p)`` (official column order and
   sign, official ``get_rel_indices``).
3. Mixing with two separate per-head weights ``lam = sigmoid(theta)`` (theta init 0 -> 0.5), one for the
   mean and one for the variance: ``mu = lam_mu*mu_ln + (1-lam_mu)*mu_in`` (same for var).
4. ``y = gamma * (x - mu) / sqrt(var + eps) + beta``. With ``only_var`` (official ``dtn_var``) the mean is
   the LN mean and only the variance is mixed.

Parameters beyond LN's gamma/beta: 2H mixing logits, ``pos_proj = nn.Linear(3, H)`` (3H weight + H bias),
i.e. exactly 6H (5H with ``only_var``). No running statistics, no batch dependence.

``pos_init`` says how ``pos_proj`` starts. ``"random"`` (the default) is what the released code trains:
its module applies the ConViT-style local init (``local_init``: each of the first k*k heads peaks at one
neighbour offset, the paper's ``a^h = [-1, 2 Delta^h_1, 2 Delta^h_2]``), but its models then re-initialise
every ``nn.Linear`` with trunc-normal(std 0.02) and zero bias -- ``pos_proj`` included -- after building
their blocks (``models/vit_norm_mix.py`` ``VisionTransformer.__init__``, ``models/pvt_norm.py``
``_init_weights``), so every head starts from a nearly uniform P. ``"local"`` keeps the local init (scaled
by ``locality_strength``), as the module does on its own.

Choices this implementation makes (the official code only handles a 14x14 grid without a class token):

* Grids larger than ``pool_size`` in a dimension are average-pooled to ``min(size, pool_size)`` in that
  dimension for the inter-token statistics (adaptive pooling, so non-divisible grids work), the statistics
  are computed from the *pooled* tokens (second moment of the pooled values, as the official code does),
  and mu_in / var_in are nearest-upsampled back (official ``dtn_pool``; ``pool_size=None`` never pools).
  Pooling runs as two small matmuls; with the separable P the upsampling is a gather of the factors' target
  columns (``_apply_position``), so E_P[z^2] and mu_in arrive at full resolution and
  ``var_in = max(E_P[z^2] - mu_in^2, 0)`` is formed per token there: the same values as upsampling var_in.
* Prefix tokens (class / distillation tokens, which precede the grid tokens in (B, N, C) input) are not
  on the grid, so they get intra-token (LN) statistics only, i.e. lambda = 1 for them. The official code
  never feeds them to DTN (its ViT adds the class token after the DTN blocks); this keeps DTN usable in
  layers that do see them.
* ``P^h`` is built once per layer and forward ([H, T', T'], shared by the batch). Its logits are
  ``a0*dx + a1*dy + a2*(dx^2 + dy^2) + b``, a sum of a column term and a row term, so the softmax over the
  source tokens of the grid factorises exactly: ``P^h = Py^h (x) Px^h`` (Kronecker product of a softmax
  over source rows and one over source columns; the bias cancels in the softmax). ``separable=True``
  (default) applies the two small factors instead of the dense T' x T' matrix: the same numbers, about
  T'/(H'+W') fewer FLOPs. ``separable=False`` uses the dense matrix, as the official code does.
* The mean and the second moment go through the same matmuls (z and z*z concatenated), laid out
  (H, h, w, B, d) so that each contraction is one large GEMM per head.
* ``kernels``: steps 0-1 and 3-4 are two autograd Functions with hand-written backward passes that save
  their inputs only and recompute the rest (the layer saves xs, the moments and the statistics, no
  normalised copies), run op by op (``"eager"``) or with each kernel compiled by ``torch.compile`` into a
  few fused loops (``"compiled"``); ``"autograd"`` runs the same functions as plain ops and lets autograd
  derive the backward (what an outer ``torch.compile`` always traces). ``"auto"`` compiles inputs of at
  least ``COMPILE_MIN_NUMEL`` elements where a compiler works, once their shape has run
  ``COMPILE_AFTER_CALLS`` times (a compile costs seconds per shape and kernel, which a shape met a few
  times never wins back), and is ``"autograd"`` otherwise (faster than the op-by-op Function on small
  tensors). All are tested against each other, against a per-token loop
  reference of the equations and with ``gradcheck``.
* The grid comes from the input shape for (B, H, W, C) / (B, C, H, W) maps and from ``layout.grid`` for
  (B, N, C) tokens; then N must be H*W or P + H*W with P prefix tokens (``num_prefix_tokens`` if given,
  else ``layout.num_prefix_tokens``), so a stage can share one layout across layers with and without the
  class token (official ViT: the class token joins at block 10). Without a grid DTN raises; it never
  guesses one from N.
* Statistics are computed in float32 with autocast disabled (``E[z^2] - E[z]^2`` cancels badly in half
  precision); the output is cast back to the input dtype.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from .functional import RECOMPUTE, Kernels, check_data_format, check_kernels, resolve_kernels
from .layout import TokenLayout
from .registry import register_norm

POS_INITS = ("random", "local")  # how pos_proj starts: the official models' effective init, or the module's

# ----------------------------------------------------------------------------- kernels
# Plain torch ops on whole tensors, used three ways (see ``DTN.kernels``): called directly, with autograd
# deriving the backward; inside _PrescaleStats / _Mix with their hand-written backward, op by op; or the
# same with each function compiled by torch.compile into a few fused loops. Grid-token results are written
# through (H, h, w, B, d) views into preallocated (B, N, C) buffers: the prefix tokens (LN statistics only,
# a few small ops) need no cat, and a channels-first map is written in its own layout.

def _prescale_stats(x: torch.Tensor, heads: int, eps: float, prefix: int, moments_grid: tuple[int, int] | None
                    ) -> tuple[torch.Tensor, ...]:
    """Steps (0)-(1): x (B, N, C) -> xs (B, N, C) pre-scaled per head, its factors rms (B, N, H, 1),
    mu_ln, var_ln (B, N) and, for ``moments_grid`` (h, w), the grid tokens' moments :func:`_moments`."""
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
        moments = _moments(xs[:, prefix:].reshape(b, *moments_grid, heads, c // heads))
    return xs.view(b, n, c), rms, mu, var, moments


def _moments(z: torch.Tensor) -> torch.Tensor:
    """Grid tokens (B, h, w, H, d) -> (H, h, w, 2B, d): z and z*z side by side, laid out so that the mean and
    the second moment share the position matmuls and each head's is one large GEMM."""
    z = z.permute(3, 1, 2, 0, 4)
    return torch.cat((z, z * z), dim=3)


def _moments_backward(g_grid: torch.Tensor, g_moments: torch.Tensor, z: torch.Tensor) -> None:
    """Adds the gradient through :func:`_moments` to g_grid: dL/dz += dL/dmean + 2 z dL/dsecond.
    g_grid, z: (H, h, w, B, d) views; g_moments: (H, h, w, 2B, d)."""
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
    """Per-element terms of steps (3)-(4) on the grid tokens, in the (H, h, w, B, d) order of the position
    matmuls (the statistics are read in their own layout, xs and the outputs through views):
    (y = (x - mu) rstd, rstd, var_in, E_P[z^2] - mu_in^2 or None, mu_in, mu_ln, var_ln)."""
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
    """Steps (3)-(4) on the grid tokens, written into out_grid (the (H, h, w, B, d) view of the output).

    They mix ``stats`` (2, B, h, w, H, d) -- mu_in and E_P[z^2] (``from_moments``) or var_in -- with the LN
    statistics mu_ln, var_ln (B, N) per head (prefix tokens: :func:`_ln_prefix`).
    """
    heads = lam_var.shape[0]
    y = _mix_terms(xs, stats, mu_ln, var_ln, lam_mu, lam_var, eps, prefix, from_moments)[0]
    out_grid.copy_(y * weight.view(heads, 1, 1, 1, -1) + bias.view(heads, 1, 1, 1, -1))


def _ln_prefix(xs: torch.Tensor, mu_ln: torch.Tensor, var_ln: torch.Tensor, eps: float) -> torch.Tensor:
    """Prefix tokens (B, P, C) standardised with their LN statistics only (before the affine)."""
    return (xs - mu_ln[..., None]) * torch.rsqrt(var_ln[..., None] + eps)


def _mix_backward(g_grid: torch.Tensor, gy: torch.Tensor, xs: torch.Tensor, stats: torch.Tensor,
                  mu_ln: torch.Tensor, var_ln: torch.Tensor, lam_mu: torch.Tensor | None,
                  lam_var: torch.Tensor, weight: torch.Tensor, eps: float, prefix: int,
                  from_moments: bool) -> tuple[torch.Tensor, ...]:
    """The per-element part of the backward of :func:`_mix` on the grid tokens, in one pass.

    With y = (x - mu) rstd, rstd = (var + eps)^-1/2 and G = dL/dy: dL/dx = G rstd = -dL/dmu and
    dL/dvar = -G y rstd / 2, where mu and var are per-head lerps of the inter-token and LN statistics.
    Writes dL/dx into g_grid (an (H, h, w, B, d) view) and returns (dL/dstats (H, h, w, 2, B, d),
    dL/dout * y summed over the batch (H, h, w, d) for the weight gradient, and sums over each head's
    channels (4, H, h, w, B) of dL/dvar, dL/dvar * var_in, dL/dx and dL/dx * mu_in (zeros without a mean
    mix), from which the caller forms the rest).
    """
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
            y_p = _ln_prefix(xs[:, :prefix], mu_ln[:, :prefix], var_ln[:, :prefix], eps)
            torch.addcmul(bias, y_p, weight, out=out[:, :prefix])
        ctx.save_for_backward(xs, stats, mu_ln, var_ln, lam_mu, lam_var, weight)
        ctx.config, ctx.kernels = (eps, prefix, from_moments), kernels
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, gy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        xs, stats, mu_ln, var_ln, lam_mu, lam_var, weight = ctx.saved_tensors
        eps, prefix, from_moments = ctx.config
        b, n, c = xs.shape
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
    """An empty (B, N, C) output; for a channels-first map of ``map_size`` a view of a (B, C, H, W) buffer,
    so the result needs no layout copy."""
    if map_size is None:
        return torch.empty_like(xs)
    b, n, c = xs.shape
    return xs.new_empty(b, c, *map_size).permute(0, 2, 3, 1).view(b, n, c)


def _pool_grid(z: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Adaptive average pooling of grid tokens (B, h, w, C) to (B, *size, C), as two small matmuls (the same
    bins and weights as ``F.adaptive_avg_pool2d``; their backward is two GEMMs, not a scatter)."""
    b, h, w, c = z.shape
    ay, ax = (_pool_matrix(n, m, z.dtype, z.device) for n, m in ((h, size[0]), (w, size[1])))
    z = torch.matmul(ay, z.reshape(b, h, w * c)).view(b * size[0], w, c)
    return torch.matmul(ax, z).view(b, *size, c)


@functools.cache  # a few grid sizes per model; built once, not on every forward
def _pool_matrix(n: int, m: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """(m, n): row i averages the inputs of adaptive pooling bin i, [floor(i n/m), ceil((i+1) n/m))."""
    return F.adaptive_avg_pool1d(torch.eye(n, dtype=dtype, device=device), m).T.contiguous()


@functools.cache
def _nearest_index(m: int, n: int, device: torch.device) -> torch.Tensor:
    """For each of n positions, the one of m that ``F.interpolate(mode="nearest")`` copies to it."""
    idx = torch.arange(m, dtype=torch.float32, device=device)[None, None]
    return F.interpolate(idx, size=n, mode="nearest").view(n).long()


@register_norm("dtn")
class DTN(nn.Module):
    """Dynamic Token Normalization for (B, N, C) tokens, (B, H, W, C) and (B, C, H, W) maps.

    The token grid comes from the input shape for maps and from ``layout.grid`` for (B, N, C) tokens
    (the stage's patch embedding sets it on every forward). ``N`` must be ``H*W`` or
    ``num_prefix_tokens + H*W`` (prefix count from ``num_prefix_tokens`` if given, else ``layout``).
    """

    def __init__(
        self,
        dim: int,
        num_heads: int | None = None,
        layout: TokenLayout | None = None,
        data_format: str = "channels_last",
        eps: float = 1e-5,
        pool_size: int | None = 14,
        locality_strength: float = 1.0,
        only_var: bool = False,
        pos_init: str = "random",
        separable: bool = True,
        num_prefix_tokens: int | None = None,
        kernels: str = "auto",
    ) -> None:
        super().__init__()
        if num_heads is None:
            raise ValueError("DTN needs num_heads (the head count of the attention block it sits in); "
                             "the model must pass it as norm context")
        if dim % num_heads != 0:
            raise ValueError(f"DTN: num_heads={num_heads} must divide dim={dim} (channels split per head)")
        if pool_size is not None and pool_size < 1:
            raise ValueError(f"DTN: pool_size must be a positive int or None, got {pool_size}")
        if pos_init not in POS_INITS:
            raise ValueError(f"DTN: pos_init must be one of {', '.join(POS_INITS)}, got {pos_init!r}")
        self.dim, self.num_heads, self.head_dim = dim, num_heads, dim // num_heads
        self.layout = layout  # shared, mutable, not a submodule (see layout.py)
        self.num_prefix_tokens = num_prefix_tokens
        self.data_format = check_data_format(data_format)
        self.eps, self.pool_size, self.only_var, self.separable = eps, pool_size, only_var, separable
        self.locality_strength = locality_strength
        self.kernels = check_kernels(kernels)

        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))
        # theta for lambda = sigmoid(theta); zeros -> 0.5, as in the official code (and its names).
        self.mean_norm_weight = None if only_var else nn.Parameter(torch.zeros(num_heads))
        self.var_norm_weight = nn.Parameter(torch.zeros(num_heads))
        # input features in the official column order [dx, dy, dx^2 + dy^2]
        self.pos_proj = nn.Linear(3, num_heads)
        nn.init.trunc_normal_(self.pos_proj.weight, std=0.02)
        nn.init.zeros_(self.pos_proj.bias)
        if pos_init == "local":
            self.local_init(locality_strength)

        # relative offsets of the last grid seen; non-persistent so state_dicts match the official ones
        self.register_buffer("rel_indices", torch.zeros(0, 0, 3), persistent=False)
        self._rel_grid: tuple[int, int] | None = None

    # ------------------------------------------------------------------ parameters
    @torch.no_grad()
    def local_init(self, locality_strength: float = 1.0) -> None:
        """ConViT-style local init (official code): head p = h1 + k*h2 of the first k*k heads (k = isqrt(H))
        gets logits ``-|delta - Delta_p|^2 + const`` with ``Delta_p = (h2 - c, h1 - c)`` (x, y), c the
        centre of the k x k window; the remaining heads keep their std-0.02 weights (nearly uniform P).
        The whole weight is then scaled by ``locality_strength``, as in the official code.

        With ``delta = target - source`` the head's P column for a target token peaks at the source
        ``target - Delta_p``.
        """
        w = self.pos_proj.weight
        k = math.isqrt(self.num_heads)
        center = (k - 1) / 2
        for h1 in range(k):
            for h2 in range(k):
                p = h1 + k * h2
                w[p, 2] = -1.0
                w[p, 1] = 2 * (h1 - center)
                w[p, 0] = 2 * (h2 - center)
        w.mul_(locality_strength)

    def mixing_weights(self) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(lambda_mean [H] or None with ``only_var``, lambda_var [H]); 1 = LN statistics, 0 = inter-token."""
        lam_mu = None if self.mean_norm_weight is None else torch.sigmoid(self.mean_norm_weight)
        return lam_mu, torch.sigmoid(self.var_norm_weight)

    @torch.no_grad()
    def set_mixing_weights(self, mean: float | None = None, var: float | None = None) -> None:
        """Set lambda_mean / lambda_var of every head (in [0, 1]; 0 and 1 become -inf / +inf logits)."""
        if mean is not None:
            if self.mean_norm_weight is None:
                raise ValueError("only_var DTN has no mean mixing weight")
            self.mean_norm_weight.fill_(torch.logit(torch.tensor(float(mean))).item())
        if var is not None:
            self.var_norm_weight.fill_(torch.logit(torch.tensor(float(var))).item())

    # ------------------------------------------------------------------ position matrix
    def _rel(self, grid: tuple[int, int], device: torch.device) -> torch.Tensor:
        """[T', T', 3] offsets (dx, dy, dx^2+dy^2) with dx = col(q) - col(p), cached for the last grid."""
        if self._rel_grid != grid or self.rel_indices.device != device:
            h, w = grid
            rows = torch.arange(h, device=device).repeat_interleave(w)
            cols = torch.arange(w, device=device).repeat(h)
            dx = (cols[None, :] - cols[:, None]).float()  # [p, q]
            dy = (rows[None, :] - rows[:, None]).float()
            self.rel_indices = torch.stack((dx, dy, dx * dx + dy * dy), dim=-1)
            self._rel_grid = grid
        return self.rel_indices

    def position_matrix(self, grid: tuple[int, int]) -> torch.Tensor:
        """Dense ``P[h, p, q]`` of shape [H, T', T'] for a (pooled) grid; sums over sources p are 1."""
        rel = self._rel(grid, self.pos_proj.weight.device).to(self.pos_proj.weight.dtype)
        logits = self.pos_proj(rel).permute(2, 0, 1)  # [H, p, q]
        return logits.softmax(dim=1)

    def position_factors(self, grid: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(Py [H, h, h], Px [H, w, w]) with ``P[h, (r', c'), (r, c)] = Py[h, r', r] * Px[h, c', c]``."""
        h, w = grid
        rel = self._rel(grid, self.pos_proj.weight.device).to(self.pos_proj.weight.dtype)
        dx = rel[:w, :w, 0]  # sources and targets in row 0
        dy = rel[::w, ::w, 1]  # sources and targets in column 0
        a = self.pos_proj.weight  # [H, 3]: coefficients of dx, dy, dx^2 + dy^2
        logit_x = a[:, 0, None, None] * dx + a[:, 2, None, None] * dx * dx
        # the bias cancels in the softmax; adding it keeps it in the graph (DDP expects every param used)
        logit_x = logit_x + self.pos_proj.bias[:, None, None]
        logit_y = a[:, 1, None, None] * dy + a[:, 2, None, None] * dy * dy
        return logit_y.softmax(dim=1), logit_x.softmax(dim=1)

    # ------------------------------------------------------------------ forward
    def _grid_of_tokens(self, num_tokens: int) -> tuple[tuple[int, int], int]:
        grid = None if self.layout is None else self.layout.grid
        if grid is None:
            raise RuntimeError(
                "DTN got (B, N, C) tokens but no token grid: build it with layout=TokenLayout(...) and set "
                "layout.grid (H, W) in the stage's patch embedding forward, or feed (B, H, W, C) maps")
        h, w = int(grid[0]), int(grid[1])
        prefix = num_tokens - h * w
        expected = self.num_prefix_tokens
        if expected is None:
            expected = self.layout.num_prefix_tokens if self.layout is not None else 0
        if prefix not in (0, expected):
            raise ValueError(f"DTN: {num_tokens} tokens do not match grid {h}x{w} with "
                             f"{expected} prefix tokens (expected {h * w} or {h * w + expected})")
        return (h, w), prefix

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        in_dtype = x.dtype
        if in_dtype in (torch.float16, torch.bfloat16):
            x = x.float()
        with torch.autocast(device_type=x.device.type, enabled=False):
            if self.data_format == "channels_first":
                if x.dim() != 4:
                    raise ValueError(f"channels_first DTN expects (B, C, H, W), got {tuple(x.shape)}")
                b, c, h, w = x.shape
                # (B, H*W, C) views of the input and of the (B, C, H, W) output: no layout copies
                y = self._normalize(x.permute(0, 2, 3, 1).reshape(b, h * w, c), (h, w), 0, map_size=(h, w))
                y = y.view(b, h, w, c).permute(0, 3, 1, 2)
            elif x.dim() == 4:
                b, h, w, c = x.shape
                y = self._normalize(x.reshape(b, h * w, c), (h, w), 0).view(b, h, w, c)
            elif x.dim() == 3:
                grid, prefix = self._grid_of_tokens(x.shape[1])
                y = self._normalize(x, grid, prefix)
            else:
                raise ValueError(f"DTN expects (B, N, C), (B, H, W, C) or (B, C, H, W), got {tuple(x.shape)}")
        return y.to(in_dtype)

    def _normalize(self, x: torch.Tensor, grid: tuple[int, int], prefix: int,
                   map_size: tuple[int, int] | None = None) -> torch.Tensor:
        """x: (B, N, C) with ``prefix`` leading non-grid tokens and H*W grid tokens in raster order."""
        b, n, c = x.shape
        if c != self.dim:
            raise ValueError(f"DTN built for {self.dim} channels got {c}")
        nh, d = self.num_heads, self.head_dim
        gh, gw = grid
        ps = self.pool_size
        pooled = ps is not None and (gh > ps or gw > ps)
        mode = resolve_kernels(self.kernels, x, (DTN, nh, grid, ps, self.separable, self.only_var))
        kernels = _KERNELS.get(mode)
        fused = mode != "autograd"

        # (0) per-token, per-head RMS pre-scaling; (1) LN statistics over all C channels (unbiased variance,
        # as the official torch.var call); unpooled grids also get their moments for step (2) here
        moments_grid = None if pooled else grid
        if fused:
            xs, mu_ln, var_ln, *moments = _PrescaleStats.apply(x, nh, self.eps, prefix, moments_grid, kernels)
        else:
            xs, _, mu_ln, var_ln, *moments = kernels.prescale_stats(x, nh, self.eps, prefix, moments_grid)

        # (2) inter-token statistics, computed in the layout (H, h, w, B, d): each head's P then contracts
        # leading spatial dims, so every matmul is one large GEMM per head (no batches of tiny matrices).
        if pooled:
            size = (min(gh, ps), min(gw, ps))
            moments = _moments(_pool_grid(xs[:, prefix:].view(b, gh, gw, c), size).view(b, *size, nh, d))
        else:
            moments = moments[0]
        # separable P: nearest upsampling folds into the factors (a gather of target columns), so the
        # statistics come out at full resolution and var_in = E_P[z^2] - mu_in^2 is formed in the mix kernel
        from_moments = not pooled or self.separable
        st = self._apply_position(moments, grid if from_moments else None)  # mu_in and E_P[z^2]
        if from_moments:
            stats = st.view(nh, gh, gw, 2, b, d).permute(3, 4, 1, 2, 0, 5)
        else:  # dense P at the pooled size, then var_in and nearest upsampling (official dtn_pool)
            mu_in, second = st.view(nh, *size, 2, b, d).unbind(3)
            var_in = torch.addcmul(second, mu_in, mu_in, value=-1.0).clamp_min(0)
            # nearest upsampling of both statistics in one call; (N, h', w', d) viewed channels-last
            st = torch.stack((mu_in, var_in)).permute(0, 1, 4, 2, 3, 5).reshape(2 * nh * b, *size, d)
            st = F.interpolate(st.permute(0, 3, 1, 2), size=(gh, gw), mode="nearest").permute(0, 2, 3, 1)
            stats = st.reshape(2, nh, b, gh, gw, d).permute(0, 2, 3, 4, 1, 5)
        # stats: (2, B, h, w, H, d) views

        # (3) mix per head and (4) standardise + affine
        lam_mu, lam_var = self.mixing_weights()
        args = (xs, stats, mu_ln, var_ln, lam_mu, lam_var, self.weight, self.bias, self.eps, prefix,
                from_moments)
        if fused:
            return _Mix.apply(*args, map_size, kernels)
        y = _output_buffer(xs, map_size)
        kernels.mix(_head_major(y, prefix, grid, nh), *args)
        if prefix:
            y[:, :prefix] = _ln_prefix(xs[:, :prefix], mu_ln[:, :prefix], var_ln[:, :prefix], self.eps) \
                * self.weight + self.bias
        return y

    def _apply_position(self, s: torch.Tensor, target_grid: tuple[int, int] | None = None) -> torch.Tensor:
        """out[h, q] = sum_p P^h[p, up(q)] s[h, p] for s of shape (H, h', w', M, d), tokens p = (row, col).

        ``target_grid`` (separable only): targets q on that finer grid, each reading the pooled target
        ``up(q)`` that nearest upsampling would copy to it; default: the targets are the grid of s.
        """
        nh, h, w, m, d = s.shape
        if self.separable:
            py, px = self.position_factors((h, w))
            if target_grid is not None and target_grid != (h, w):
                py = py[:, :, _nearest_index(h, target_grid[0], py.device)]
                px = px[:, :, _nearest_index(w, target_grid[1], px.device)]
            # contract the source rows, then the source columns; the target index takes the source's place
            s = torch.bmm(py.transpose(1, 2), s.reshape(nh, h, w * m * d))
            s = torch.matmul(px.transpose(1, 2).unsqueeze(1), s.view(nh, py.shape[2], w, m * d))
            return s.view(nh, py.shape[2], px.shape[2], m, d)
        if target_grid is not None and target_grid != (h, w):
            raise ValueError("the dense position matrix takes targets on the grid of its input")
        p = self.position_matrix((h, w))
        s = torch.bmm(p.transpose(1, 2), s.reshape(nh, h * w, m * d))
        return s.view(nh, h, w, m, d)

    def extra_repr(self) -> str:
        return (f"{self.dim}, num_heads={self.num_heads}, eps={self.eps}, pool_size={self.pool_size}, "
                f"only_var={self.only_var}, separable={self.separable}, data_format={self.data_format}")
