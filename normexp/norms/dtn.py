"""Dynamic Token Normalization (Shao et al., ICLR 2022, arXiv 2112.02624), as the official module computes it
(github.com/wqshao126/DTN, ``models/normkit/norms/dtn.py``). Per head h, on RMS-pre-scaled tokens, the LN
statistics (over each token's channels) and inter-token ones (``mu_in = z @ P^h``, ``var_in = (z*z) @ P^h -
mu_in^2``, P^h a softmax over relative grid offsets) are mixed by ``sigmoid(theta)``, then standardised and
scaled; ``only_var`` mixes the variance only (the official ``dtn_var``). Steps: :meth:`DTN.normalize`; the
fused kernels: ``normexp.norms.kernels.dtn``.

Beyond the official module: grids above ``pool_size`` take inter-token statistics on a pooled grid (the
official ``dtn_pool``); prefix tokens get LN statistics only; the grid comes from the shape or ``layout``;
``separable=True`` applies P^h as its two Kronecker factors (the same numbers); with ``layout.positions``
(MAE's visible tokens) P^h is over the present tokens. ``pos_init="random"`` starts ``pos_proj`` as the
released models train it (their ``vit_norm_mix.py`` re-initialises every Linear); ``"local"`` keeps the
module's ConViT-style local init.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from .functional import check_data_format, output_dtype
from .kernels import KERNEL_MODES, check_kernels, resolve_kernels
from .kernels.dtn import grid_moments, ln_prefix, mix, nearest_index, pool_grid, prescale_stats
from .layout import TokenLayout
from .registry import register_norm

POS_INITS = ("random", "local")  # the official models' effective init, or the module's own


@register_norm("dtn")
class DTN(nn.Module):
    """DTN for (B, N, C) tokens (grid from ``layout``), (B, H, W, C) and (B, C, H, W) maps, and (B, C) pooled
    vectors (a 1x1 map). ``N`` must be ``H*W`` or ``num_prefix_tokens + H*W``."""

    hparam_checks: ClassVar[dict[str, dict[str, Any]]] = {
        "pool_size": {"min": 1}, "locality_strength": {"min": 0}, "kernels": {"choices": list(KERNEL_MODES)}}

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
        """ConViT-style local init (official code): each of the first k*k heads peaks at one neighbour offset,
        the whole weight scaled by ``locality_strength``."""
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

    def position_matrix(self, grid: tuple[int, int], dtype: torch.dtype | None = None) -> torch.Tensor:
        """Dense ``P[h, p, q]`` of shape [H, T', T'] for a (pooled) grid; sums over sources p are 1."""
        dtype = dtype or self.pos_proj.weight.dtype
        rel = self._rel(grid, self.pos_proj.weight.device).to(dtype)
        logits = F.linear(rel, self.pos_proj.weight.to(dtype), self.pos_proj.bias.to(dtype))
        return logits.permute(2, 0, 1).softmax(dim=1)  # [H, p, q]

    def position_factors(self, grid: tuple[int, int], dtype: torch.dtype | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """(Py [H, h, h], Px [H, w, w]) with ``P[h, (r', c'), (r, c)] = Py[h, r', r] * Px[h, c', c]``."""
        h, w = grid
        dtype = dtype or self.pos_proj.weight.dtype
        rel = self._rel(grid, self.pos_proj.weight.device).to(dtype)
        dx = rel[:w, :w, 0]  # sources and targets in row 0
        dy = rel[::w, ::w, 1]  # sources and targets in column 0
        a = self.pos_proj.weight.to(dtype)  # [H, 3]: coefficients of dx, dy, dx^2 + dy^2
        logit_x = a[:, 0, None, None] * dx + a[:, 2, None, None] * dx * dx
        # the bias cancels in the softmax; adding it keeps it in the graph (DDP expects every param used)
        logit_x = logit_x + self.pos_proj.bias.to(dtype)[:, None, None]
        logit_y = a[:, 1, None, None] * dy + a[:, 2, None, None] * dy * dy
        return logit_y.softmax(dim=1), logit_x.softmax(dim=1)

    # ------------------------------------------------------------------ steps (0)-(4)
    def normalize(self, x: torch.Tensor, grid: tuple[int, int], prefix: int,
                  map_size: tuple[int, int] | None = None) -> torch.Tensor:
        """x: (B, N, C) with ``prefix`` leading non-grid tokens and H*W grid tokens in raster order."""
        b, n, c = x.shape
        if c != self.dim:
            raise ValueError(f"DTN built for {self.dim} channels got {c}")
        nh, d = self.num_heads, self.head_dim
        gh, gw = grid
        ps = self.pool_size
        pooled = ps is not None and (gh > ps or gw > ps)
        mode = resolve_kernels(self.kernels, x, ("dtn", nh, grid, ps, self.separable, self.only_var))

        # (0) per-token, per-head RMS pre-scaling; (1) LN statistics over all C channels (unbiased variance,
        # as the official torch.var call); unpooled grids also get their moments for step (2) here
        moments_grid = None if pooled else grid
        xs, mu_ln, var_ln, *moments = prescale_stats(x, nh, self.eps, prefix, moments_grid, mode)

        # (2) inter-token statistics, computed in the layout (H, h, w, B, d): each head's P then contracts
        # leading spatial dims, so every matmul is one large GEMM per head (no batches of tiny matrices).
        if pooled:
            size = (min(gh, ps), min(gw, ps))
            moments = grid_moments(pool_grid(xs[:, prefix:].view(b, gh, gw, c), size).view(b, *size, nh, d))
        else:
            moments = moments[0]
        # separable P: nearest upsampling folds into the factors (a gather of target columns), so the
        # statistics come out at full resolution and var_in = E_P[z^2] - mu_in^2 is formed in the mix kernel
        from_moments = not pooled or self.separable
        st = self.apply_position(moments, grid if from_moments else None)  # mu_in and E_P[z^2]
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
        # parameters in the statistics' dtype (a bfloat16 model computes them in float32, see forward)
        lam_mu, lam_var = (None if t is None else t.to(x.dtype) for t in self.mixing_weights())
        weight, bias = self.weight.to(x.dtype), self.bias.to(x.dtype)
        return mix(xs, stats, mu_ln, var_ln, lam_mu, lam_var, weight, bias, self.eps, prefix, from_moments,
                   map_size, mode)

    def normalize_subset(self, x: torch.Tensor, positions: torch.Tensor, prefix: int) -> torch.Tensor:
        """x: (B, N, C) with ``prefix`` tokens, then the grid tokens at ``positions`` (B, M) of
        ``layout.grid``; P^h over the tokens present (plain ops)."""
        b, n, c = x.shape
        nh, d = self.num_heads, self.head_dim
        xs, mu_ln, var_ln = prescale_stats(x, nh, self.eps, prefix, None, "autograd")
        width = self.layout.grid[1]
        rows, cols = (positions // width).to(x.dtype), (positions % width).to(x.dtype)
        dx, dy = cols[:, None, :] - cols[:, :, None], rows[:, None, :] - rows[:, :, None]  # [b, p, q]: q - p
        rel = torch.stack((dx, dy, dx * dx + dy * dy), dim=-1)
        weight, bias = self.pos_proj.weight.to(x.dtype), self.pos_proj.bias.to(x.dtype)
        p = F.linear(rel, weight, bias).permute(0, 3, 1, 2).softmax(dim=2)  # [b, H, p, q], sums over p are 1
        z = xs[:, prefix:].view(b, n - prefix, nh, d)
        mu_in = torch.einsum("bhpq,bphd->bqhd", p, z)
        var_in = (torch.einsum("bhpq,bphd->bqhd", p, z * z) - mu_in * mu_in).clamp_min(0)
        lam_mu, lam_var = (None if t is None else t.to(x.dtype) for t in self.mixing_weights())
        mu_g, var_g = mu_ln[:, prefix:, None, None], var_ln[:, prefix:, None, None]
        mu = mu_g if lam_mu is None else mu_in + lam_mu.view(nh, 1) * (mu_g - mu_in)
        rstd = torch.rsqrt(var_in + lam_var.view(nh, 1) * (var_g - var_in) + self.eps)
        grid_out = ((z - mu) * rstd).reshape(b, n - prefix, c)
        prefix_out = ln_prefix(xs[:, :prefix], mu_ln[:, :prefix], var_ln[:, :prefix], self.eps)
        return torch.cat((prefix_out, grid_out), dim=1) * self.weight.to(x.dtype) + self.bias.to(x.dtype)

    def apply_position(self, s: torch.Tensor, target_grid: tuple[int, int] | None = None) -> torch.Tensor:
        """out[h, q] = sum_p P^h[p, up(q)] s[h, p] for s of shape (H, h', w', M, d); ``target_grid``
        (separable only): targets on that finer grid, nearest-upsampled."""
        nh, h, w, m, d = s.shape
        if self.separable:
            py, px = self.position_factors((h, w), s.dtype)
            if target_grid is not None and target_grid != (h, w):
                py = py[:, :, nearest_index(h, target_grid[0], py.device)]
                px = px[:, :, nearest_index(w, target_grid[1], px.device)]
            # contract the source rows, then the source columns; the target index takes the source's place
            s = torch.bmm(py.transpose(1, 2), s.reshape(nh, h, w * m * d))
            s = torch.matmul(px.transpose(1, 2).unsqueeze(1), s.view(nh, py.shape[2], w, m * d))
            return s.view(nh, py.shape[2], px.shape[2], m, d)
        if target_grid is not None and target_grid != (h, w):
            raise ValueError("the dense position matrix takes targets on the grid of its input")
        p = self.position_matrix((h, w), s.dtype)
        s = torch.bmm(p.transpose(1, 2), s.reshape(nh, h * w, m * d))
        return s.view(nh, h, w, m, d)

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

    def _prefix_of_subset(self, num_tokens: int) -> int:
        present = self.layout.positions.shape[1]
        expected = self.layout.num_prefix_tokens if self.num_prefix_tokens is None else self.num_prefix_tokens
        if num_tokens - present not in (0, expected):
            raise ValueError(f"DTN: {num_tokens} tokens do not match the {present} grid tokens present with "
                             f"{expected} prefix tokens")
        return num_tokens - present

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out_dtype = output_dtype(x)
        if x.dtype in (torch.float16, torch.bfloat16):
            x = x.float()
        with torch.autocast(device_type=x.device.type, enabled=False):
            if self.data_format == "channels_first":
                if x.dim() != 4:
                    raise ValueError(f"channels_first DTN expects (B, C, H, W), got {tuple(x.shape)}")
                b, c, h, w = x.shape
                # (B, H*W, C) views of the input and of the (B, C, H, W) output: no layout copies
                y = self.normalize(x.permute(0, 2, 3, 1).reshape(b, h * w, c), (h, w), 0, map_size=(h, w))
                y = y.view(b, h, w, c).permute(0, 3, 1, 2)
            elif x.dim() == 2:  # one pooled token per image (a classifier's fc_norm), as a 1x1 map
                y = self.normalize(x[:, None], (1, 1), 0)[:, 0]
            elif x.dim() == 4:
                b, h, w, c = x.shape
                y = self.normalize(x.reshape(b, h * w, c), (h, w), 0).view(b, h, w, c)
            elif x.dim() == 3 and self.layout is not None and self.layout.positions is not None:
                y = self.normalize_subset(x, self.layout.positions, self._prefix_of_subset(x.shape[1]))
            elif x.dim() == 3:
                grid, prefix = self._grid_of_tokens(x.shape[1])
                y = self.normalize(x, grid, prefix)
            else:
                raise ValueError(f"DTN expects (B, N, C), (B, H, W, C), (B, C, H, W) or pooled (B, C), "
                                 f"got {tuple(x.shape)}")
        return y.to(out_dtype)

    def extra_repr(self) -> str:
        return (f"{self.dim}, num_heads={self.num_heads}, eps={self.eps}, pool_size={self.pool_size}, "
                f"only_var={self.only_var}, separable={self.separable}, data_format={self.data_format}")
