"""PVT v2 (Wang et al., CVMJ 2022, arXiv 2106.13797) on timm's ``PyramidVisionTransformerV2``, whose
definitions give the official parameter counts (whai362/PVT README, branch v2).

This subclass adds ``norm_context`` (one :class:`TokenLayout` per stage, and one per stage for the
spatial-reduction norms ``attn.norm``, each set by a hook so it follows the input size), ``features()`` and an
``img_size`` keyword (only recorded: any input size runs). There is no class token. ``pvt_v2_micro`` is the
CPU demo member: B0's widths at 16 px with a stride-1 stem.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from timm.models.pvt_v2 import OverlapPatchEmbed, PyramidVisionTransformerV2

from ..norms.layout import TokenLayout
from .base import CLASSIFICATION, DENSE_FEATURES, Backbone, GridHook, NormContext
from .registry import register_size


class PVTv2(PyramidVisionTransformerV2, Backbone):
    """timm's PVT v2 that tells each norm slot its block, head count and token layout (``norm_context``)."""

    serves = frozenset({CLASSIFICATION, DENSE_FEATURES})
    config_options = ("in_chans", "drop_path_rate")
    residual_scales = ("stages.*.blocks.*.attn", "stages.*.blocks.*.mlp")

    def __init__(self, img_size: int | tuple[int, int] = 224, stem_patch_size: int = 7, stem_stride: int = 4,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.img_size = img_size
        if (stem_patch_size, stem_stride) != (7, 4):  # timm builds the 7/4 stem; the micro one is smaller
            self.patch_embed = OverlapPatchEmbed(patch_size=stem_patch_size, stride=stem_stride,
                                                 in_chans=self.in_chans,
                                                 embed_dim=self.feature_info[0]["num_chs"])
            self.patch_embed.apply(self._init_weights)
        for i, info in enumerate(self.feature_info):
            info["reduction"] = stem_stride * 2 ** i
        self.feature_channels = [info["num_chs"] for info in self.feature_info]
        self.feature_strides = [info["reduction"] for info in self.feature_info]
        self.block_offsets = [sum(self.depths[:i]) for i in range(len(self.stages))]

        # one layout per stage for its tokens and one for the reduced grid of its sr-branch norms
        self.stage_layouts = [TokenLayout(num_prefix_tokens=0) for _ in self.stages]
        self.sr_layouts = [TokenLayout(num_prefix_tokens=0) for _ in self.stages]
        for i, stage in enumerate(self.stages):
            embed = self.patch_embed if stage.downsample is None else stage.downsample
            embed.proj.register_forward_hook(GridHook(self.stage_layouts[i]))
            for blk in stage.blocks:
                if blk.attn.sr is not None:
                    blk.attn.sr.register_forward_hook(GridHook(self.sr_layouts[i]))

    def norm_context(self, name: str) -> NormContext:
        if name.startswith("patch_embed."):
            stage, block, layout = 0, None, self.stage_layouts[0]
        elif m := re.match(r"stages\.(\d+)\.blocks\.(\d+)\.", name):
            stage = int(m.group(1))
            block = self.block_offsets[stage] + int(m.group(2))
            sr_norm = name.startswith(f"{m.group(0)}attn.norm")
            layout = self.sr_layouts[stage] if sr_norm else self.stage_layouts[stage]
        elif m := re.match(r"stages\.(\d+)\.(downsample\.)?norm\b", name):
            stage, block, layout = int(m.group(1)), None, self.stage_layouts[int(m.group(1))]
        else:
            raise ValueError(f"PVT v2 has no norm slot '{name}'")
        return {"block": block, "num_heads": self.stages[stage].blocks[0].attn.num_heads, "layout": layout,
                "num_prefix_tokens": 0}

    def features(self, x: torch.Tensor) -> list[torch.Tensor]:
        """The 4 stage maps (after each stage's norm), NCHW, strides ``feature_strides`` (4, 8, 16, 32)."""
        return self.forward_intermediates(x, intermediates_only=True)


_B1 = dict(embed_dims=(64, 128, 320, 512), num_heads=(1, 2, 5, 8))

for _name, _settings, _doc in [
    ("pvt_v2_micro", dict(img_size=16, stem_patch_size=3, stem_stride=1, embed_dims=(32, 64, 160, 256),
                          num_heads=(1, 2, 5, 8), depths=(1, 1, 1, 1), sr_ratios=(4, 2, 1, 1)),
     "The CPU member: 16 px, a 3 px stride-1 stem, one block a stage."),
    ("pvt_v2_b0", dict(depths=(2, 2, 2, 2), embed_dims=(32, 64, 160, 256), num_heads=(1, 2, 5, 8)),
     "PVT v2-B0."),
    ("pvt_v2_b1", dict(depths=(2, 2, 2, 2), **_B1), "PVT v2-B1."),
    ("pvt_v2_b2", dict(depths=(3, 4, 6, 3), **_B1), "PVT v2-B2."),
    ("pvt_v2_b2_li", dict(depths=(3, 4, 6, 3), linear=True, **_B1), "PVT v2-B2-Li (linear SRA)."),
    ("pvt_v2_b3", dict(depths=(3, 4, 18, 3), **_B1), "PVT v2-B3."),
    ("pvt_v2_b4", dict(depths=(3, 8, 27, 3), **_B1), "PVT v2-B4."),
    ("pvt_v2_b5", dict(depths=(3, 6, 40, 3), mlp_ratios=(4, 4, 4, 4), **_B1), "PVT v2-B5."),
]:
    register_size(_name, PVTv2, _settings, _doc)
