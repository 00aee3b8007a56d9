"""The token layout shared by the norm layers of one stage: the grid changes at run time, so the stage's
patch embedding updates ``layout.grid`` on every forward. A plain object, not a module, so that it stays out
of ``state_dict`` and ``copy.deepcopy`` (EMA) keeps it shared."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(eq=False)
class TokenLayout:
    """The token sequence of one stage: ``grid`` (H, W) in raster order (None while unknown),
    ``num_prefix_tokens`` before the grid, and ``positions`` (B, M): the grid tokens present when only some
    are (MAE's visible ones), else None."""

    grid: tuple[int, int] | None = None
    num_prefix_tokens: int = 0
    positions: torch.Tensor | None = None

    def set_grid(self, height: int, width: int) -> None:
        """Called by the patch embedding on every forward with the grid it just produced (all tokens
        present)."""
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
    """The layout a per-head slot (q / k / v norm) sees: ``layout``'s tokens with the heads folded into the
    batch, ``(B * num_heads, N, head_dim)``; grid and prefix read through, ``positions`` repeated per head."""

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
        """``(B * num_heads, N, head_dim)`` -> the ``(B, N, num_heads * head_dim)`` tokens they came from."""
        bh, n, d = x.shape
        return x.reshape(bh // self.num_heads, self.num_heads, n, d).transpose(1, 2).reshape(
            bh // self.num_heads, n, self.num_heads * d)
