"""ViTDet's simple feature pyramid (Li et al. 2022, arXiv 2203.16527) for plain models: deconvolutions for
x4 and x2, identity, a max-pool for x0.5."""

from __future__ import annotations

import torch
from timm.layers import LayerNorm2d
from torch import nn


def _scale_adapter(dim: int, scale: float) -> tuple[nn.Module, int]:
    """Resampling branch for one pyramid level and its output channel count."""
    if scale == 4.0:
        return nn.Sequential(
            nn.ConvTranspose2d(dim, dim // 2, 2, stride=2), LayerNorm2d(dim // 2), nn.GELU(),
            nn.ConvTranspose2d(dim // 2, dim // 4, 2, stride=2),
        ), dim // 4
    if scale == 2.0:
        return nn.ConvTranspose2d(dim, dim // 2, 2, stride=2), dim // 2
    if scale == 1.0:
        return nn.Identity(), dim
    if scale == 0.5:
        return nn.MaxPool2d(2, 2), dim
    raise ValueError(f"pyramid scale must be one of 4, 2, 1, 0.5; got {scale}")


class SimpleFeaturePyramid(nn.Module):
    """Maps at ``scales`` of one (B, C, H, W) map of stride ``stride``."""

    def __init__(self, dim: int, stride: int, scales: tuple[float, ...] = (4.0, 2.0, 1.0, 0.5)) -> None:
        super().__init__()
        branches, channels, strides = [], [], []
        for scale in scales:
            branch, out_dim = _scale_adapter(dim, float(scale))
            if stride / scale != int(stride / scale) or stride / scale < 1:
                raise ValueError(f"scale {scale} of a stride-{stride} map gives a non-integer stride")
            branches.append(branch)
            channels.append(out_dim)
            strides.append(int(stride / scale))
        self.branches = nn.ModuleList(branches)
        self.channels, self.strides = channels, strides

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [branch(x) for branch in self.branches]
