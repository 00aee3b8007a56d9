"""Swin Transformer (Liu et al. 2021, arXiv 2103.14030) on timm's ``SwinTransformer``; sizes follow the
official configs (microsoft/Swin-Transformer ``configs/swin/*.yaml``), ``swin_micro`` is the CPU demo member.

Every norm slot is on its stage's grid: ``norm1`` sees the stage map before the window partition (DTN's
statistics are over the whole map, not per window), ``norm2`` the flattened tokens with the stage's layout.
``dynamic_img_size=True`` accepts any size divisible by the patch. ``features(x)`` returns the four stage maps
(NCHW); ``feature_norms=True`` adds a norm on each, as the official detection backbone does, and
``always_partition=True`` keeps 7x7 shifted windows in every stage as that code runs them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from timm.models import swin_transformer as timm_swin
from torch import nn

from ..norms.layout import TokenLayout
from .base import CLASSIFICATION, DENSE_FEATURES, Backbone, GridHook, NormContext
from .registry import register_size


class PadThenShiftBlock(timm_swin.SwinTransformerBlock):
    """timm's block with the window attention of Swin's detection code (SwinTransformer/Swin-Transformer-
    Object-Detection ``mmdet/models/backbones/swin_transformer.py``): pad to a window multiple, then shift,
    the mask built on the padded grid; timm shifts first. On a window multiple both are the same."""

    def _attn(self, x: torch.Tensor) -> torch.Tensor:
        _, h, w, c = x.shape
        wh, ww = self.window_size
        x = F.pad(x, (0, 0, 0, (ww - w % ww) % ww, 0, (wh - h % wh) % wh))  # zeros, attended to as keys
        hp, wp = x.shape[1:3]
        shift = tuple(self.shift_size)
        if any(shift):
            x = torch.roll(x, shifts=(-shift[0], -shift[1]), dims=(1, 2))
            mask = self.get_attn_mask(x) if self.dynamic_mask else self.attn_mask  # on the padded grid
        else:
            mask = None
        windows = timm_swin.window_partition(x, self.window_size).view(-1, self.window_area, c)
        windows = self.attn(windows, mask=mask)
        x = timm_swin.window_reverse(windows.view(-1, wh, ww, c), self.window_size, hp, wp)
        if any(shift):
            x = torch.roll(x, shifts=shift, dims=(1, 2))
        return x[:, :h, :w].contiguous()


class Swin(timm_swin.SwinTransformer, Backbone):
    """timm's Swin that tells each norm slot its block, head count and token layout (``norm_context``)."""

    serves = frozenset({CLASSIFICATION, DENSE_FEATURES})
    config_options = ("in_chans", "patch_size", "window_size", "drop_path_rate", "dynamic_img_size")
    dense_weights = ("feature_norms.",)  # the official detection backbone's norm on each stage output
    residual_scales = ("layers.*.blocks.*.attn", "layers.*.blocks.*.mlp")
    final_norms = ("norm",)

    def __init__(self, feature_norms: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        for stage in self.layers:
            for block in stage.blocks:
                block.__class__ = PadThenShiftBlock  # same parameters and buffers, the detection code's order
        self.stage_layouts = [TokenLayout(num_prefix_tokens=0) for _ in self.layers]
        self._block_offset = []
        offset = 0
        for stage, layout in zip(self.layers, self.stage_layouts, strict=True):
            stage.downsample.register_forward_hook(GridHook(layout, channels_last=True))
            self._block_offset.append(offset)
            offset += len(stage.blocks)
        patch = self.patch_embed.patch_size[0]
        self.feature_channels = [stage.blocks[0].dim for stage in self.layers]
        self.feature_strides = [patch * 2 ** i for i in range(len(self.layers))]
        # The official detection backbone normalises every stage output it hands to the FPN (dense tasks:
        # ``feature_norms=True``; LayerNorm here, swapped for the configured normalizer like every slot).
        self.feature_norms = nn.ModuleList(nn.LayerNorm(c) for c in self.feature_channels) \
            if feature_norms else None

    def norm_context(self, name: str) -> NormContext:
        parts = name.split(".")
        block = None
        if parts[0] == "layers":
            stage = int(parts[1])
            if parts[2] == "blocks":
                block = self._block_offset[stage] + int(parts[3])
        elif parts[0] == "patch_embed":
            stage = 0
        elif parts[0] == "feature_norms":
            stage = int(parts[1])
        else:  # final norm (and anything after the last stage)
            stage = len(self.layers) - 1
        layout = self.stage_layouts[stage]
        return {"block": block, "num_heads": self.layers[stage].blocks[0].attn.num_heads, "layout": layout,
                "num_prefix_tokens": layout.num_prefix_tokens}

    def features(self, x: torch.Tensor) -> list[torch.Tensor]:
        """The stage maps, NCHW, at ``feature_strides`` (timm's stage outputs; normed with feature_norms)."""
        x = self.patch_embed(x)
        maps = []
        for i, stage in enumerate(self.layers):
            x = stage(x)
            out = self.feature_norms[i](x) if self.feature_norms is not None else x
            maps.append(out.permute(0, 3, 1, 2).contiguous())
        return maps


for _name, _settings, _doc in [
    ("swin_micro", dict(img_size=16, patch_size=1, window_size=4, embed_dim=24, depths=(1, 1, 2, 1),
                        num_heads=(1, 2, 4, 8), drop_path_rate=0.0), "The CPU member: 16 px, 1 px patches."),
    ("swin_tiny", dict(embed_dim=96, depths=(2, 2, 6, 2), num_heads=(3, 6, 12, 24), drop_path_rate=0.2),
     "Swin-T (swin_tiny_patch4_window7_224.yaml)."),
    ("swin_small", dict(embed_dim=96, depths=(2, 2, 18, 2), num_heads=(3, 6, 12, 24), drop_path_rate=0.3),
     "Swin-S (swin_small_patch4_window7_224.yaml)."),
    ("swin_base", dict(embed_dim=128, depths=(2, 2, 18, 2), num_heads=(4, 8, 16, 32), drop_path_rate=0.5),
     "Swin-B (swin_base_patch4_window7_224.yaml)."),
]:
    register_size(_name, Swin, _settings, _doc)
