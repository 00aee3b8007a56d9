"""DINO's network (Caron et al. 2021, arXiv 2104.14294): a backbone and a projection head over the views of
an image at several resolutions -- facebookresearch/dino ``vision_transformer.DINOHead`` and
``utils.MultiCropWrapper``, written from their behaviour. The head has no norm slot."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from timm.layers import trunc_normal_
from torch import nn
from torch.nn.utils.parametrizations import weight_norm

from .base import NormContext


def interpolate_positions(table: torch.Tensor, grid: tuple[int, int], prefix: int) -> torch.Tensor:
    """A square position table for a grid of ``grid`` patches, as DINO's ``interpolate_pos_encoding``
    (facebookresearch/dino ``vision_transformer.py``) resamples it for the local crops: unchanged at its own
    square size, else bicubic by the scale factor ``(grid + 0.1) / sqrt(N)`` (the factor, not the size,
    sets the sampling positions; no antialiasing). ``prefix``: the leading rows of the class token(s)."""
    n = table.shape[1] - prefix
    side = math.isqrt(n)
    if side * side != n:
        raise ValueError(f"DINO's position interpolation needs a square table, got {n} positions")
    if tuple(grid) == (side, side):
        return table
    patches = table[:, prefix:].reshape(1, side, side, -1).permute(0, 3, 1, 2)
    scale = ((grid[0] + 0.1) / math.sqrt(n), (grid[1] + 0.1) / math.sqrt(n))
    patches = F.interpolate(patches, scale_factor=scale, mode="bicubic")
    if tuple(patches.shape[-2:]) != tuple(grid):
        raise ValueError(f"DINO's position interpolation gave a {tuple(patches.shape[-2:])} grid for {grid}")
    return torch.cat([table[:, :prefix], patches.permute(0, 2, 3, 1).reshape(1, -1, table.shape[-1])], dim=1)


class DINOHead(nn.Module):
    """DINO's projection head: an MLP, L2 normalisation, a weight-normalised last layer
    (``norm_last_layer``)."""

    def __init__(self, in_dim: int, out_dim: int, hidden_dim: int = 2048, bottleneck_dim: int = 256,
                 nlayers: int = 3, norm_last_layer: bool = True) -> None:
        super().__init__()
        nlayers = max(nlayers, 1)
        dims = [in_dim, *[hidden_dim] * (nlayers - 1), bottleneck_dim]
        layers: list[nn.Module] = []
        for i, (a, b) in enumerate(zip(dims[:-1], dims[1:], strict=True)):
            layers.append(nn.Linear(a, b))
            if i < nlayers - 1:
                layers.append(nn.GELU())
        self.mlp = nn.Sequential(*layers)
        for layer in self.mlp:
            if isinstance(layer, nn.Linear):
                trunc_normal_(layer.weight, std=0.02)
                nn.init.zeros_(layer.bias)
        self.last_layer = weight_norm(nn.Linear(bottleneck_dim, out_dim, bias=False))
        magnitude = self.last_layer.parametrizations.weight.original0
        with torch.no_grad():
            magnitude.fill_(1)
        magnitude.requires_grad_(not norm_last_layer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last_layer(F.normalize(self.mlp(x), dim=-1, p=2))


class MultiCropNetwork(nn.Module):
    """A classifier-free backbone and a head over a list of views, one backbone pass per run of equal
    sizes."""

    def __init__(self, backbone: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.backbone, self.head = backbone, head
        self.norm_keep = [f"backbone.{pattern}" for pattern in getattr(backbone, "norm_keep", ())]

    def features(self, views: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
        views = views if isinstance(views, (list, tuple)) else [views]
        sizes = torch.tensor([tuple(v.shape[-2:]) for v in views])
        changes = [0, *[i for i in range(1, len(views)) if not torch.equal(sizes[i], sizes[i - 1])],
                   len(views)]
        return torch.cat([self.backbone(torch.cat(views[a:b])) for a, b in zip(changes[:-1], changes[1:],
                                                                                strict=True)])

    def forward(self, views: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
        return self.head(self.features(views))

    def get_classifier(self) -> None:
        """None: DINO's head is no classifier (its last layer is weight-normed, never zeroed or re-drawn)."""
        return None

    def norm_context(self, name: str) -> NormContext:
        if not name.startswith("backbone."):
            raise ValueError(f"{name} is no norm slot of the backbone (DINO's head has none)")
        return self.backbone.norm_context(name.removeprefix("backbone."))

    def no_weight_decay(self) -> set[str]:
        """None beyond 1-D parameters and biases (DINO's ``utils.get_params_groups`` decays the rest)."""
        return set()
