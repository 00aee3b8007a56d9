"""Token magnitudes per head on the patch grid (DTN, Shao et al., ICLR 2022, arXiv 2112.02624, Fig. 1): the
L2 norm of each grid token's slice per head at a slot's input and output, as an (H, W) map per head."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from .slots import grid_tokens, slot_context, slot_format, unfold_heads


def head_magnitudes(tokens: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, N, C) tokens -> (B, N, heads): the L2 norm of each head's slice of each token."""
    b, n, c = tokens.shape
    if c % heads:
        raise ValueError(f"{c} channels do not split into {heads} heads")
    return tokens.reshape(b, n, heads, c // heads).norm(dim=-1)


@dataclass
class TokenMaps:
    """Per-head magnitude maps of one image at a slot's input and output: (heads, H, W) arrays."""

    slot: str
    heads: int
    grid: tuple[int, int]
    input: np.ndarray
    output: np.ndarray

    def numbers(self) -> dict[str, Any]:
        def stats(maps: np.ndarray) -> list[dict[str, float]]:
            flat = maps.reshape(maps.shape[0], -1)
            return [{"head": h, "mean": float(f.mean()), "std": float(f.std()),
                     "cv": float(f.std() / f.mean()) if f.mean() else float("nan")}
                    for h, f in enumerate(flat)]

        return {"slot": self.slot, "heads": self.heads, "grid": list(self.grid),
                "input": {"per_head": stats(self.input), "maps": self.input.round(6).tolist()},
                "output": {"per_head": stats(self.output), "maps": self.output.round(6).tolist()}}


class TokenRecorder:
    """Forward-hook callback: the per-head maps of image ``image`` of the first batch at ``slot``."""

    def __init__(self, model: nn.Module, slot: str, image: int = 0) -> None:
        self.model, self.slot, self.image = model, slot, image
        self.maps: TokenMaps | None = None

    def __call__(self, name: str, module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
        if name != self.slot or self.maps is not None:
            return
        fmt = slot_format(module)
        context = slot_context(self.model, name)
        heads = int(getattr(context.get("layout"), "num_heads", None) or context.get("num_heads") or 1)
        (x, _), (y, layout) = (unfold_heads(t.detach(), context.get("layout")) for t in (x, y))
        tin, tout = grid_tokens(x, fmt, layout), grid_tokens(y, fmt, layout)
        if tin.shape is None:
            raise ValueError(f"slot {name} sees pooled vectors: no token grid to map")
        h, w = tin.shape
        maps = [head_magnitudes(t.grid[self.image: self.image + 1].float(), heads)[0].T.reshape(heads, h, w)
                for t in (tin, tout)]
        self.maps = TokenMaps(name, heads, (h, w), maps[0].cpu().numpy(), maps[1].cpu().numpy())


def default_token_slot(model: nn.Module, names: list[str]) -> str:
    """The first block's first (not per-head) norm slot, as DTN Fig. 1; else the first slot."""
    for name in names:
        context = slot_context(model, name)
        if context.get("block") == 0 and not hasattr(context.get("layout"), "unfold"):
            return name
    return names[0]
