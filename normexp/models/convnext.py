"""ConvNeXt (Liu et al., CVPR 2022, arXiv 2201.03545) on timm's ``ConvNeXt``: the ConvNeXt-B/L rows of DyT's
Table 1 (arXiv 2503.10622).

Sizes follow the paper's Sec. 2.6 / timm's definitions (patch-4 stem, depthwise 7x7 blocks, layer scale
1e-6): tiny C = 96/192/384/768, depths 3-3-9-3; small 96.., 3-3-27-3; base 128/256/512/1024, 3-3-27-3; large
192/384/768/1536, 3-3-27-3. ``drop_path_rate`` in each yaml is the paper's (0.1 / 0.4 / 0.5 / 0.5), which
DyT's recipe keeps for B and L.

Norm slots (timm 1.0.31 ``convnext.py``) and what each sees:

* ``stem.1`` and ``stages.{i}.downsample.0`` (stages 1-3): ``LayerNorm2d`` on a (B, C, H, W) map --
  channels-first;
* ``stages.{i}.blocks.{j}.norm``: ``LayerNorm`` on the block's (B, H, W, C) map (timm permutes before the
  MLP) -- channels-last;
* ``head.norm``: ``LayerNorm2d`` on the pooled (B, C, 1, 1) vector (pool -> norm -> fc), marked ``pooled``;
* ``feature_norms.{i}`` (dense tasks, ``feature_norms=True``): a channels-first LayerNorm on each stage
  output, as the official detection backbone (facebookresearch/ConvNeXt ``object_detection/mmdet/models/
  backbones/convnext.py``) puts one there.

Every slot gets the layout its layer has, so ``norm=dyt`` gives what the official ``convert_ln_to_dyt``
(jiachenzhu/DyT ``dynamic_tanh.py``) gives: channels-first DyT for the ``LayerNorm2d`` slots and
channels-last DyT in the blocks, none left as LayerNorm. Every map carries its grid in its shape, so DTN
takes its inter-token statistics over each stage's map (pooled to its ``pool_size`` above that).

**Head count.** ConvNeXt has no attention, but DTN (per-head statistics), GroupNorm (groups) and PowerNorm
(group scaling) need one per slot. ConvNeXt is the convolutional counterpart of Swin at the same widths
(paper Sec. 2: ConvNeXt-T/B/L mirror Swin-T/B/L's 96/128/192-wide stages), and Swin gives every stage
``width / 32`` heads (3-6-12-24, 4-8-16-32, 6-12-24-48); so a slot with C channels gets C / 32 heads
(head dim 32), or the largest divisor of C below that, at least 1.

``convnext_micro`` is the CPU-demo member: 16 px input, a 1x1 stem (stride 1: stage grids 16, 8, 4, 2 -- no
1x1 stage, where per-sample token statistics would see one token), C = 32/64/128/256 (1/2/4/8 heads), depths
1-1-2-1, 3x3 depthwise kernels, MLP ratio 4 and layer scale 1e-6. The published 7x7 kernel spans a
1/8 of a 56x56 stage; on these 16..2 grids a 3x3 spans a comparable part, and the 7x7 depthwise backward
took about 5x longer per step on the CPU (mostly padding).
"""

from __future__ import annotations

import re
from typing import Any

import torch
from timm.layers import LayerNorm2d
from timm.models.convnext import ConvNeXt as TimmConvNeXt
from torch import nn

from .base import CLASSIFICATION, DENSE_FEATURES, Backbone, NormContext
from .registry import register_model

HEAD_DIM = 32  # Swin's head width at the same stage widths (see the module docstring)


def convnext_heads(channels: int) -> int:
    """``channels / 32`` heads, or the largest divisor of ``channels`` below it; at least 1."""
    return next(h for h in range(max(1, channels // HEAD_DIM), 0, -1) if channels % h == 0)


class ConvNeXt(TimmConvNeXt, Backbone):
    """timm's ConvNeXt with the backbone contract: norm context per slot, ``features()``."""

    serves = frozenset({CLASSIFICATION, DENSE_FEATURES})
    dense_weights = ("feature_norms.",)  # the official detection backbone's norm on each stage output
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
        """Block index and head count of the norm slot ``name`` (maps: the grid is in the shape)."""
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


def _convnext(arch: dict[str, Any], **kwargs: Any) -> ConvNeXt:
    return ConvNeXt(**{**arch, **kwargs})


@register_model
def convnext_micro(**kwargs: Any) -> ConvNeXt:
    return _convnext(dict(img_size=16, patch_size=1, depths=(1, 1, 2, 1), dims=(32, 64, 128, 256),
                          kernel_sizes=3), **kwargs)


@register_model
def convnext_tiny(**kwargs: Any) -> ConvNeXt:
    return _convnext(dict(depths=(3, 3, 9, 3), dims=(96, 192, 384, 768)), **kwargs)


@register_model
def convnext_small(**kwargs: Any) -> ConvNeXt:
    return _convnext(dict(depths=(3, 3, 27, 3), dims=(96, 192, 384, 768)), **kwargs)


@register_model
def convnext_base(**kwargs: Any) -> ConvNeXt:
    return _convnext(dict(depths=(3, 3, 27, 3), dims=(128, 256, 512, 1024)), **kwargs)


@register_model
def convnext_large(**kwargs: Any) -> ConvNeXt:
    return _convnext(dict(depths=(3, 3, 27, 3), dims=(192, 384, 768, 1536)), **kwargs)
