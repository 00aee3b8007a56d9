"""Dynamic Token Normalization (Shao et al., ICLR 2022), following the official module (dtn.md 1.2, 5).

For input tokens x (T x C) with H heads (head h owns channels [h*d, (h+1)*d), d = C/H):

0. RMS pre-scaling per token and head: ``x <- x_h / sqrt(mean_j x_hj^2 + eps)`` ("l2 normalize for
   stability" in the official code; dtn.md 1.2 step 0).
1. Intra-token (LN) statistics over *all* C channels of each token: mean and **unbiased** variance
   (``torch.var`` in the official code, dtn.md 1.3), broadcast to every head.
2. Inter-token statistics per head with a position-aware matrix ``P^h`` (T' x T', columns sum to 1):
   ``mu_in = z @ P^h``, ``var_in = (z*z) @ P^h - mu_in^2`` (clamped at 0), where
   ``P^h[p, q] = softmax_p(pos_proj([dx, dy, dx^2 + dy^2])_h)`` is normalised over the *source* token p for
   each target token q, and ``dx = col(q) - col(p)``, ``dy = row(q) - row(p)`` (official column order and
   sign, dtn.md 1.2 ``get_rel_indices``).
3. Mixing with two separate per-head weights ``lam = sigmoid(theta)`` (theta init 0 -> 0.5), one for the
   mean and one for the variance: ``mu = lam_mu*mu_ln + (1-lam_mu)*mu_in`` (same for var).
4. ``y = gamma * (x - mu) / sqrt(var + eps) + beta``. With ``only_var`` (official ``dtn_var``) the mean is
   the LN mean and only the variance is mixed.

Parameters beyond LN's gamma/beta: 2H mixing logits, ``pos_proj = nn.Linear(3, H)`` (3H weight + H bias),
i.e. exactly 6H (5H with ``only_var``). No running statistics, no batch dependence.

Choices this implementation makes (the official code only handles a 14x14 grid without a class token):

* Grids larger than ``pool_size`` in a dimension are average-pooled to ``min(size, pool_size)`` in that
  dimension for the inter-token statistics (adaptive pooling, so non-divisible grids work), the statistics
  are computed from the *pooled* tokens (second moment of the pooled values, as the official code does),
  and mu_in / var_in are nearest-upsampled back (official ``dtn_pool``; ``pool_size=None`` never pools).
* Prefix tokens (class / distillation tokens, which precede the grid tokens in (B, N, C) input) are not
  on the grid, so they get intra-token (LN) statistics only, i.e. lambda = 1 for them. The official code
  never feeds them to DTN (dtn.md 1.4); this keeps DTN usable in layers that do see them.
* ``P^h`` is built once per layer and forward ([H, T', T'], shared by the batch). Its logits are
  ``a0*dx + a1*dy + a2*(dx^2 + dy^2) + b``, a sum of a column term and a row term, so the softmax over the
  source tokens of the grid factorises exactly: ``P^h = Py^h (x) Px^h`` (Kronecker product of a softmax
  over source rows and one over source columns; the bias cancels in the softmax). ``separable=True``
  (default) applies the two small factors instead of the dense T' x T' matrix: the same numbers, about
  T'/(H'+W') fewer FLOPs. ``separable=False`` uses the dense matrix, as the official code does.
* The mean and the second moment go through the same matmuls (z and z*z concatenated), laid out
  (H, h, w, B, d) so that each contraction is one large GEMM per head.
* In eager mode steps 3-4 (mixing, standardising, affine) are one autograd Function with a hand-written
  backward (fewer full-size temporaries, no layout copies); under ``torch.compile`` (or with
  ``custom_backward = False``) the same math runs as plain ops. Both are tested against each other, against
  a per-token loop reference of the equations and with ``gradcheck``.
* The grid comes from the input shape for (B, H, W, C) / (B, C, H, W) maps and from ``layout.grid`` for
  (B, N, C) tokens; then N must be H*W or P + H*W with P prefix tokens (``num_prefix_tokens`` if given,
  else ``layout.num_prefix_tokens``), so a stage can share one layout across layers with and without the
  class token (official ViT: the class token joins at block 10). Without a grid DTN raises; it never
  guesses one from N.
* Statistics are computed in float32 with autocast disabled (``E[z^2] - E[z]^2`` is fragile in half
  precision, dtn.md 4 item 8); the output is cast back to the input dtype.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .functional import check_data_format
from .layout import TokenLayout
from .registry import register_norm


def _head_major(t: torch.Tensor, prefix: int, grid: tuple[int, int]) -> torch.Tensor:
    """(H, B, h, w, d) view of the grid tokens of a (B, N, H, d) tensor (no copy)."""
    b, _, nh, d = t.shape
    return t[:, prefix:].view(b, grid[0], grid[1], nh, d).permute(3, 0, 1, 2, 4)


def _mix_standardize(x: torch.Tensor, mu_in: torch.Tensor, second: torch.Tensor, mu_ln: torch.Tensor,
                     var_ln: torch.Tensor, lam_mu: torch.Tensor | None, lam_var: torch.Tensor,
                     weight: torch.Tensor, bias: torch.Tensor, eps: float, prefix: int,
                     from_moments: bool) -> torch.Tensor:
    """Steps (3)-(4) of DTN in plain autograd ops; the same computation as :class:`_MixStandardize`."""
    b, n, nh, d = x.shape
    grid = (mu_in.shape[2], mu_in.shape[3])
    heads = (nh, 1, 1, 1, 1)
    mu_ln_g = mu_ln[:, prefix:].view(1, b, *grid, 1)
    var_ln_g = var_ln[:, prefix:].view(1, b, *grid, 1)
    var_in = torch.addcmul(second, mu_in, mu_in, value=-1.0).clamp_min(0) if from_moments else second
    var = torch.lerp(var_in, var_ln_g, lam_var.view(heads))
    mu = mu_ln_g if lam_mu is None else torch.lerp(mu_in, mu_ln_g, lam_mu.view(heads))
    y = (_head_major(x, prefix, grid) - mu) * torch.rsqrt(var + eps)
    y = y.permute(1, 2, 3, 0, 4).reshape(b, n - prefix, nh, d)
    if prefix:  # prefix tokens: LN statistics only
        mu_p, var_p = mu_ln[:, :prefix, None, None], var_ln[:, :prefix, None, None]
        y = torch.cat(((x[:, :prefix] - mu_p) * torch.rsqrt(var_p + eps), y), dim=1)
    return torch.addcmul(bias.view(nh, d), y, weight.view(nh, d))


class _MixStandardize(torch.autograd.Function):
    """Steps (3)-(4) of DTN with a hand-written backward.

    Forward: ``mu = lerp(mu_in, mu_ln, lam_mu)``, ``var = lerp(var_in, var_ln, lam_var)`` per head on the grid
    tokens (LN statistics only on the prefix tokens), ``y = (x - mu) / sqrt(var + eps)``, output
    ``y * weight + bias``. With ``from_moments`` the second statistic is ``E_P[z^2]`` and
    ``var_in = max(E_P[z^2] - mu_in^2, 0)`` is formed here too.

    Why by hand: autograd's generic backward of these broadcasting ops reduces over non-contiguous
    broadcast dims and allocates about three times as many full-size temporaries (it dominated the layer's
    time); this keeps the token-major output without a permute copy and saves only y, rstd, mu_in/second.

    Shapes: x (B, N, H, d) token-major; mu_in, second (H, B, h, w, d) head-major; mu_ln, var_ln (B, N);
    lam_mu (H,) or None (only_var); lam_var (H,); weight, bias (C,).
    """

    @staticmethod
    def _var_in(mu_in: torch.Tensor, second: torch.Tensor,
                from_moments: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(var_in, mask of where the clamp passes gradients, or None when second is var_in already)."""
        if not from_moments:
            return second, None
        var_in = torch.addcmul(second, mu_in, mu_in, value=-1.0)
        keep = var_in >= 0
        return var_in.clamp_min_(0), keep  # E[z^2] - E[z]^2 >= 0

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mu_in: torch.Tensor, second: torch.Tensor, mu_ln: torch.Tensor,
                var_ln: torch.Tensor, lam_mu: torch.Tensor | None, lam_var: torch.Tensor,
                weight: torch.Tensor, bias: torch.Tensor, eps: float, prefix: int,
                from_moments: bool) -> torch.Tensor:
        b, n, nh, d = x.shape
        grid = (mu_in.shape[2], mu_in.shape[3])
        mu_ln_g = mu_ln[:, prefix:].view(1, b, *grid, 1)
        var_ln_g = var_ln[:, prefix:].view(1, b, *grid, 1)
        var_in, _ = _MixStandardize._var_in(mu_in, second, from_moments)
        rstd = torch.lerp(var_in, var_ln_g, lam_var.view(nh, 1, 1, 1, 1)).add_(eps).rsqrt_()
        mu = mu_ln_g if lam_mu is None else torch.lerp(mu_in, mu_ln_g, lam_mu.view(nh, 1, 1, 1, 1))
        y = torch.empty_like(x)
        y_g = _head_major(y, prefix, grid)
        torch.sub(_head_major(x, prefix, grid), mu, out=y_g)  # written straight into token-major y
        y_g.mul_(rstd)
        if prefix:  # prefix tokens: LN statistics only
            rstd_p = torch.rsqrt(var_ln[:, :prefix] + eps)[..., None, None]
            torch.sub(x[:, :prefix], mu_ln[:, :prefix, None, None], out=y[:, :prefix])
            y[:, :prefix].mul_(rstd_p)
        # mu_in and second share one storage (chunks of one matmul output): saving second costs nothing,
        # var_in is recomputed in backward
        ctx.save_for_backward(y, rstd, mu_in, second, mu_ln, var_ln, lam_mu, lam_var, weight)
        ctx.eps, ctx.prefix, ctx.from_moments = eps, prefix, from_moments
        return torch.addcmul(bias.view(nh, d), y, weight.view(nh, d))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        y, rstd, mu_in, second, mu_ln, var_ln, lam_mu, lam_var, weight = ctx.saved_tensors
        eps, prefix = ctx.eps, ctx.prefix
        var_in, keep = _MixStandardize._var_in(mu_in, second, ctx.from_moments)
        b, n, nh, d = y.shape
        grid = (mu_in.shape[2], mu_in.shape[3])
        heads = (nh, 1, 1, 1)
        grad = grad.contiguous()
        g_bias = grad.sum((0, 1)).view(-1)
        g_weight = (grad * y).sum((0, 1)).view(-1)
        gy = grad * weight.view(nh, d)  # dL/dy
        gx = torch.empty_like(gy)

        # grid tokens, head-major views. y = (x - mu) * r with r = (var + eps)^-1/2:
        # dL/dx = gy r;  dL/dmu = -gy r;  dL/dvar = -1/2 gy y r^2
        gx_g = _head_major(gx, prefix, grid)
        torch.mul(_head_major(gy, prefix, grid), rstd, out=gx_g)
        g_var = (gx_g * _head_major(y, prefix, grid)).mul_(rstd).mul_(-0.5)
        g_var_d = g_var.sum(-1)
        var_ln_g = var_ln[:, prefix:].view(1, b, *grid)
        g_var_ln = (g_var_d * lam_var.view(heads)).sum(0)
        g_lam_var = (g_var_d * var_ln_g).sum((1, 2, 3)) - (g_var * var_in).sum((1, 2, 3, 4))
        g_second = g_var.mul_((1 - lam_var).view(nh, 1, 1, 1, 1))  # dL/dvar_in
        if keep is not None:
            g_second.masked_fill_(~keep, 0)  # through the clamp: now dL/dE[z^2]
        g_x_d = gx_g.sum(-1)  # = -dL/dmu summed over the head's channels
        if lam_mu is None:
            g_mu_ln = -g_x_d.sum(0)
            g_lam_mu = g_mu_in = None
        else:
            mu_ln_g = mu_ln[:, prefix:].view(1, b, *grid)
            g_mu_ln = -(g_x_d * lam_mu.view(heads)).sum(0)
            g_lam_mu = (gx_g * mu_in).sum((1, 2, 3, 4)) - (g_x_d * mu_ln_g).sum((1, 2, 3))
            g_mu_in = gx_g * (lam_mu - 1).view(nh, 1, 1, 1, 1)
        if keep is not None:  # var_in = E[z^2] - mu_in^2 also depends on mu_in
            if g_mu_in is None:
                g_mu_in = -2 * mu_in * g_second
            else:
                g_mu_in.addcmul_(mu_in, g_second, value=-2)
        g_mu_ln, g_var_ln = g_mu_ln.reshape(b, -1), g_var_ln.reshape(b, -1)

        if prefix:  # LN statistics only
            rstd_p = torch.rsqrt(var_ln[:, :prefix] + eps)[..., None, None]
            gx_p = torch.mul(gy[:, :prefix], rstd_p, out=gx[:, :prefix])
            g_mu_ln = torch.cat((-gx_p.sum((2, 3)), g_mu_ln), dim=1)
            g_var_p = -0.5 * (gx_p * y[:, :prefix]).sum((2, 3)) * rstd_p[..., 0, 0]
            g_var_ln = torch.cat((g_var_p, g_var_ln), dim=1)
        return (gx, g_mu_in, g_second, g_mu_ln, g_var_ln, g_lam_mu, g_lam_var, g_weight, g_bias,
                None, None, None)


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
        local_init: bool = True,
        separable: bool = True,
        num_prefix_tokens: int | None = None,
    ) -> None:
        super().__init__()
        if num_heads is None:
            raise ValueError("DTN needs num_heads (the head count of the attention block it sits in); "
                             "the model must pass it as norm context")
        if dim % num_heads != 0:
            raise ValueError(f"DTN: num_heads={num_heads} must divide dim={dim} (channels split per head)")
        if pool_size is not None and pool_size < 1:
            raise ValueError(f"DTN: pool_size must be a positive int or None, got {pool_size}")
        self.dim, self.num_heads, self.head_dim = dim, num_heads, dim // num_heads
        self.layout = layout  # shared, mutable, not a submodule (see layout.py)
        self.num_prefix_tokens = num_prefix_tokens
        self.data_format = check_data_format(data_format)
        self.eps, self.pool_size, self.only_var, self.separable = eps, pool_size, only_var, separable
        self.locality_strength = locality_strength

        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))
        # theta for lambda = sigmoid(theta); zeros -> 0.5 (dtn.md 1.2). Names as in the official code.
        self.mean_norm_weight = None if only_var else nn.Parameter(torch.zeros(num_heads))
        self.var_norm_weight = nn.Parameter(torch.zeros(num_heads))
        # input features in the official column order [dx, dy, dx^2 + dy^2]
        self.pos_proj = nn.Linear(3, num_heads)
        nn.init.trunc_normal_(self.pos_proj.weight, std=0.02)
        nn.init.zeros_(self.pos_proj.bias)
        if local_init:
            self.local_init(locality_strength)

        # relative offsets of the last grid seen; non-persistent so state_dicts match the official ones
        self.register_buffer("rel_indices", torch.zeros(0, 0, 3), persistent=False)
        self._rel_grid: tuple[int, int] | None = None
        # eager: steps (3)-(4) as one autograd Function with a hand-written backward (same math)
        self.custom_backward = True

    # ------------------------------------------------------------------ parameters
    @torch.no_grad()
    def local_init(self, locality_strength: float = 1.0) -> None:
        """ConViT-style local init (dtn.md 1.2): head p = h1 + k*h2 of the first k*k heads (k = isqrt(H))
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
                y = self._normalize(x.permute(0, 2, 3, 1).reshape(b, h * w, c), (h, w), 0)
                y = y.view(b, h, w, c).permute(0, 3, 1, 2).contiguous()
            elif x.dim() == 4:
                b, h, w, c = x.shape
                y = self._normalize(x.reshape(b, h * w, c), (h, w), 0).view(b, h, w, c)
            elif x.dim() == 3:
                grid, prefix = self._grid_of_tokens(x.shape[1])
                y = self._normalize(x, grid, prefix)
            else:
                raise ValueError(f"DTN expects (B, N, C), (B, H, W, C) or (B, C, H, W), got {tuple(x.shape)}")
        return y.to(in_dtype)

    def _normalize(self, x: torch.Tensor, grid: tuple[int, int], prefix: int) -> torch.Tensor:
        """x: (B, N, C) with ``prefix`` leading non-grid tokens and H*W grid tokens in raster order."""
        b, n, c = x.shape
        if c != self.dim:
            raise ValueError(f"DTN built for {self.dim} channels got {c}")
        nh, d = self.num_heads, self.head_dim
        gh, gw = grid

        # (0) per-token, per-head RMS pre-scaling
        x = F.rms_norm(x.reshape(b, n, nh, d), (d,), eps=self.eps).view(b, n, c)
        # (1) LN statistics over all C channels, unbiased variance as in the official torch.var call
        mu_ln = x.mean(dim=-1)
        var_ln = (x.square().mean(dim=-1) - mu_ln.square()).clamp_min(0) * (c / (c - 1))

        # (2) inter-token statistics, computed in the layout (H, h, w, B, d): each head's P then contracts
        # leading spatial dims, so every matmul is one large GEMM per head (no batches of tiny matrices).
        xg = x[:, prefix:].view(b, gh, gw, nh, d)
        ps = self.pool_size
        pooled = ps is not None and (gh > ps or gw > ps)
        if pooled:
            size = (min(gh, ps), min(gw, ps))
            z = F.adaptive_avg_pool2d(xg.view(b, gh, gw, c).permute(0, 3, 1, 2), size).permute(0, 2, 3, 1)
            z = z.reshape(b, *size, nh, d).permute(3, 1, 2, 0, 4)
        else:
            z = xg.permute(3, 1, 2, 0, 4)
        # one copy into (H, h, w, 2B, d): the mean and the second moment share the matmuls
        s = torch.cat((z, z * z), dim=3)
        mu_in, second = (t.permute(0, 3, 1, 2, 4) for t in self._apply_position(s).chunk(2, dim=3))
        # mu_in, second: (H, B, h', w', d) views
        if pooled:
            var_in = torch.addcmul(second, mu_in, mu_in, value=-1.0).clamp_min(0)
            # nearest upsampling of both statistics in one call; (N, h', w', d) viewed channels-last
            st = torch.stack((mu_in, var_in)).reshape(2 * nh * b, *mu_in.shape[2:])
            st = F.interpolate(st.permute(0, 3, 1, 2), size=(gh, gw), mode="nearest").permute(0, 2, 3, 1)
            mu_in, second = st.reshape(2, nh, b, gh, gw, d).unbind(0)

        # (3) mix per head and (4) standardise + affine
        lam_mu, lam_var = self.mixing_weights()
        args = (x.view(b, n, nh, d), mu_in, second, mu_ln, var_ln, lam_mu, lam_var, self.weight, self.bias,
                self.eps, prefix, not pooled)
        if self.custom_backward and not torch.compiler.is_compiling():
            y = _MixStandardize.apply(*args)
        else:  # the compiler fuses the plain ops itself (and does not trace the custom Function's writes)
            y = _mix_standardize(*args)
        return y.reshape(b, n, c)

    def _apply_position(self, s: torch.Tensor) -> torch.Tensor:
        """out[h, q] = sum_p P^h[p, q] s[h, p] for s of shape (H, h, w, M, d), tokens p, q = (row, col)."""
        nh, h, w, m, d = s.shape
        if self.separable:
            py, px = self.position_factors((h, w))
            # contract the source rows, then the source columns; the target index takes the source's place
            s = torch.bmm(py.transpose(1, 2), s.reshape(nh, h, w * m * d))
            s = torch.matmul(px.transpose(1, 2).unsqueeze(1), s.view(nh, h, w, m * d))
        else:
            p = self.position_matrix((h, w))
            s = torch.bmm(p.transpose(1, 2), s.reshape(nh, h * w, m * d))
        return s.view(nh, h, w, m, d)

    def extra_repr(self) -> str:
        return (f"{self.dim}, num_heads={self.num_heads}, eps={self.eps}, pool_size={self.pool_size}, "
                f"only_var={self.only_var}, separable={self.separable}, data_format={self.data_format}")
