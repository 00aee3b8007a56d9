"""ConvNeXt (Liu et al., CVPR 2022, arXiv 2201.03545) on timm's ``ConvNeXt``: the ConvNeXt-B/L rows of DyT's
Table 1 (arXiv 2503.10622); sizes follow the paper's Sec. 2.6 / timm's definitions.

Every slot keeps its layer's layout, so ``norm=dyt`` gives what the official ``convert_ln_to_dyt``
(jiachenzhu/DyT ``dynamic_tanh.py``) gives; ``head.norm`` is ``pooled``. ``feature_norms=True`` adds a norm on
each stage output, as the official detection backbone (facebookresearch/ConvNeXt ``object_detection``) does.
ConvNeXt has no attention; for DTN, GroupNorm and PowerNorm a slot gets Swin's ``width / 32`` heads (ConvNeXt
mirrors Swin's widths, paper Sec. 2). ``convnext_micro`` (the CPU demo) uses 3x3 depthwise kernels on its
16..2 px grids (docs/benchmarks.md).
"""

from __future__ import annotations

import re
from typing import Any

import torch
from timm.layers import LayerNorm2d
from timm.models.convnext import ConvNeXt as TimmConvNeXt
from torch import nn

from .base import CLASSIFICATION, DENSE_FEATURES, Backbone, NormContext
from .registry import register_size

HEAD_DIM = 32  # Swin's head width at the same stage widths (see the module docstring)


def convnext_heads(channels: int) -> int:
    """``channels / 32`` heads, or the largest divisor of ``channels`` below it; at least 1."""
    return next(h for h in range(max(1, channels // HEAD_DIM), 0, -1) if channels % h == 0)


class ConvNeXt(TimmConvNeXt, Backbone):
    """timm's ConvNeXt with the backbone contract: norm context per slot, ``features()``."""

    serves = frozenset({CLASSIFICATION, DENSE_FEATURES})
    dense_weights = ("feature_norms.",)  # the official detection backbone's norm on each stage output
    config_options = ("in_chans", "drop_path_rate")
    residual_scales = ("stages.*.blocks.*.mlp",)  # the branch: depthwise conv, norm, MLP, layer scale

    def __init__(self, img_size: int | tuple[int, int] = 224, feature_norms: bool = False,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.img_size = img_size  # any input size runs (no position embedding); recorded only
        self.feature_channels = [info["num_chs"] for info in self.feature_info]
        self.feature_strides = [info["reduction"] for info in self.feature_info]
        self.block_offsets = [sum(len(s.blocks) for s in self.stages[:i]) for i in range(len(self.stages))]
        self.feature_norms = nn.ModuleList(LayerNorm2d(c) for c in self.feature_channels) \
            if feature_norms else None

    def norm_context(self, name: str) -> NormContext:
        block, stage = None, len(self.stages) - 1  # head: the last stage's width
        if m := re.match(r"(stages|feature_norms)\.(\d+)(?:\.(blocks\.(\d+)|downsample))?", name):
            stage = int(m.group(2))
            if m.group(3) == "downsample":  # normalises the previous stage's map, before the conv
                stage -= 1
            elif m.group(4) is not None:
                block = self.block_offsets[stage] + int(m.group(4))
        elif name.startswith("stem."):
            stage = 0
        channels = self.feature_channels[stage]
        return {"block": block, "num_heads": convnext_heads(channels), "layout": None, "num_prefix_tokens": 0,
                "pooled": name.startswith("head.")}

    def features(self, x: torch.Tensor) -> list[torch.Tensor]:
        """The 4 stage maps, NCHW, at ``feature_strides`` (normed when built with ``feature_norms``)."""
        maps = self.forward_intermediates(x, intermediates_only=True)
        if self.feature_norms is not None:
            maps = [norm(m) for norm, m in zip(self.feature_norms, maps, strict=True)]
        return maps


for _name, _settings, _doc in [
    ("convnext_micro", dict(img_size=16, patch_size=1, depths=(1, 1, 2, 1), dims=(32, 64, 128, 256),
                            kernel_sizes=3), "The CPU member: 16 px, 1 px stem, 3x3 depthwise kernels."),
    ("convnext_tiny", dict(depths=(3, 3, 9, 3), dims=(96, 192, 384, 768)), "ConvNeXt-T."),
    ("convnext_small", dict(depths=(3, 3, 27, 3), dims=(96, 192, 384, 768)), "ConvNeXt-S."),
    ("convnext_base", dict(depths=(3, 3, 27, 3), dims=(128, 256, 512, 1024)), "ConvNeXt-B."),
    ("convnext_large", dict(depths=(3, 3, 27, 3), dims=(192, 384, 768, 1536)), "ConvNeXt-L."),
]:
    register_size(_name, ConvNeXt, _settings, _doc)
