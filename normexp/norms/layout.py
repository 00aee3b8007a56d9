"""Token layout shared by the norm layers of one stage.

Token-grid-aware normalizers (DTN) need to know how the (B, N, C) tokens they receive map onto a 2-D
patch grid. That grid changes at run time (detection resolutions, dynamic image size), so it cannot be a
constructor argument: each stage owns one :class:`TokenLayout`, hands the *same object* to its norm
layers as the ``layout`` context, and its patch embedding updates ``layout.grid`` on every forward.

It is deliberately a plain Python object, not an ``nn.Module``: it holds no tensors, must not show up in
``state_dict``/``named_modules`` once per layer, and ``copy.deepcopy(model)`` (EMA) keeps it shared
between the copied patch embedding and the copied norms.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(eq=False)
class TokenLayout:
    """Mutable description of the token sequence of one stage.

    ``grid``: (H, W) of the patch grid in raster order (token index = row * W + col), or None while unknown.
    ``num_prefix_tokens``: class / distillation tokens that precede the grid tokens in (B, N, C) input.
    ``positions``: when only some grid tokens are present (a masked autoencoder's encoder sees the visible
    ones), their grid indices (B, M), in the order they come; None: all H*W, in raster order.
    """

    grid: tuple[int, int] | None = None
    num_prefix_tokens: int = 0
    positions: torch.Tensor | None = None

    def set_grid(self, height: int, width: int) -> None:
        """Called by the patch embedding on every forward with the grid it just produced (every grid token
        present until a model that drops some says which remain)."""
        self.grid = (int(height), int(width))
        self.positions = None

    @property
    def num_grid_tokens(self) -> int:
        if self.grid is None:
            raise RuntimeError("TokenLayout.grid is not set; the patch embedding must call set_grid()")
        return self.grid[0] * self.grid[1]

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Split (B, N, C) tokens into (prefix tokens (B, P, C), grid tokens (B, H*W, C)); views, no copy."""
        num_grid = self.num_grid_tokens
        prefix = x.shape[1] - num_grid
        if prefix != self.num_prefix_tokens:
            raise ValueError(f"got {x.shape[1]} tokens, expected {self.num_prefix_tokens} prefix + "
                             f"{num_grid} grid tokens for grid {self.grid}")
        return x[:, :prefix], x[:, prefix:]


class FoldedHeads:
    """The layout seen by a per-head norm slot (the q / k / v norms of an attention): the tokens of
    ``layout`` with the ``num_heads`` heads of each sample folded into the batch, ``(B * num_heads, N,
    head_dim)`` with sample b's head h at ``b * num_heads + h``. The same grid and prefix tokens as
    ``layout`` (read through, so the patch embedding's updates reach it), and ``positions`` -- the grid
    tokens present, (B, M) -- repeated for each head. Like :class:`TokenLayout`, a plain shared object.
    """

    def __init__(self, layout: TokenLayout, num_heads: int) -> None:
        self.layout, self.num_heads = layout, num_heads

    @property
    def grid(self) -> tuple[int, int] | None:
        return self.layout.grid

    @property
    def num_prefix_tokens(self) -> int:
        return self.layout.num_prefix_tokens

    @property
    def positions(self) -> torch.Tensor | None:
        positions = self.layout.positions
        return None if positions is None else positions.repeat_interleave(self.num_heads, dim=0)

    @property
    def num_grid_tokens(self) -> int:
        return self.layout.num_grid_tokens

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.layout.split(x)

    def unfold(self, x: torch.Tensor) -> torch.Tensor:
        """``(B * num_heads, N, head_dim)`` -> the ``(B, N, num_heads * head_dim)`` tokens they came from
        (each token's heads side by side, as the attention's channels are)."""
        bh, n, d = x.shape
        return x.reshape(bh // self.num_heads, self.num_heads, n, d).transpose(1, 2).reshape(
            bh // self.num_heads, n, self.num_heads * d)
