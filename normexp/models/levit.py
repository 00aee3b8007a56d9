"""LeViT (Graham et al. 2021, arXiv 2104.01136) on timm's ``Levit`` / ``LevitDistilled`` (linear mode).

Sizes follow the official ``specification`` (facebookresearch/LeViT ``levit.py``). LeViT has no LayerNorm:
its normalizer is the BatchNorm after every conv and linear (``Conv2d_BN`` / ``Linear_BN``), so ``norm=bn``
is LeViT as published (tested against timm) and ``norm=<x>`` puts x in each of those slots. The token
linears' slots (:class:`TokenLinearNorm`) see the (B, N, C) output as the (B, C, H, W) map of the stage's
grid, since BatchNorm slots are ``channels_first``; the classifier's ``BN_Linear`` sees pooled vectors and
stays BatchNorm (``norm_keep``). A normalizer in a residual branch's last slot starts with its weight scaled
by LeViT's 0 init. ``block`` counts the subsample attention as a block; ``num_heads`` is the slot
attention's head count where it divides the channels, else its largest divisor below it.

``distilled=True`` (default; the published parameter counts include ``head_dist``) averages the two heads in
training and eval (timm's ``distilled_training=False``): there is no teacher. LeViT is fixed-resolution:
``img_size`` must be divisible by the stem stride and the input must have that size. ``features(x)`` returns
the three stage maps (NCHW, strides ``stem_stride * (1, 2, 4)``). ``levit_micro`` (the CPU demo) has a
16 px input and a stride-2 stem, so its stages run on 8x8, 4x4 and 2x2 grids.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from timm.layers import get_act_layer, to_2tuple
from timm.models.levit import ConvNorm, Levit, LevitDistilled, LevitDownsample, LinearNorm
from torch import nn

from ..norms.layout import TokenLayout
from .base import CLASSIFICATION, DENSE_FEATURES, Backbone, GridHook, NormContext
from .registry import register_size


def slot_heads(channels: int, heads: int) -> int:
    """``heads`` if it divides ``channels``, else the largest divisor of ``channels`` below ``heads``."""
    return next(h for h in range(min(heads, channels), 0, -1) if channels % h == 0)


class TokenLinearNorm(nn.Module):
    """Linear + norm for (B, N, C) tokens (timm's ``LinearNorm`` keys); ``bn`` sees the (B, C, H, W) map."""

    def __init__(self, linear: nn.Linear, layout: TokenLayout, bn_weight_init: float = 1.0) -> None:
        super().__init__()
        self.bn_weight_init = bn_weight_init  # set before ``bn``: __setattr__ reads it
        self.layout = layout  # shared with the stage, not a submodule
        self.linear = linear
        self.bn = nn.BatchNorm2d(linear.out_features)

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if name == "bn":  # also when replace_norms swaps another normalizer in
            self._scale_weight_init(value)

    @torch.no_grad()
    def _scale_weight_init(self, norm: nn.Module) -> None:
        """LeViT's residual-branch init (weight 0) for any normalizer: scale its own weight init."""
        weight = getattr(norm, "weight", None)
        if self.bn_weight_init != 1.0 and isinstance(weight, torch.Tensor):
            weight.mul_(self.bn_weight_init)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.linear(x)
        b, n, c = x.shape
        grid = self.layout.grid
        if grid is None or grid[0] * grid[1] != n:
            raise RuntimeError(f"LeViT: {n} tokens do not match the stage grid {grid}")
        # (B, N, C) -> (B, C, H, W) without a copy (channels-last memory), and back
        y = self.bn(x.transpose(1, 2).view(b, c, *grid))
        return y.flatten(2).transpose(1, 2).contiguous()

    @classmethod
    def from_timm(cls, module: LinearNorm, layout: TokenLayout) -> TokenLinearNorm:
        weight = module.bn.weight.detach()
        init = 1.0 if weight.is_meta else float(weight.flatten()[0])  # meta device (a dry build): no values
        new = cls(module.linear, layout, bn_weight_init=init)
        new.bn.load_state_dict(module.bn.state_dict())
        return new


def conv_stem(in_chans: int, out_chs: int, stride: int, act_layer: type[nn.Module]) -> nn.Sequential:
    """LeViT's stem cut to ``log2(stride)`` 3x3 stride-2 ConvNorms (channels C / 2^(k-1) ... C), as Stem16."""
    num = int(math.log2(stride))
    stem = nn.Sequential()
    prev = in_chans
    for k in range(num):
        if k:
            stem.add_module(f"act{k}", act_layer())
        out = out_chs // 2 ** (num - 1 - k)
        stem.add_module(f"conv{k + 1}", ConvNorm(prev, out, 3, stride=2, padding=1))
        prev = out
    return stem


class _SubsampleGridHook:
    """Forward pre-hook on a subsample attention: the next stage's grid is the subsampled previous grid."""

    def __init__(self, source: TokenLayout, target: TokenLayout, stride: int) -> None:
        self.source, self.target, self.stride = source, target, stride

    def __call__(self, _module: nn.Module, _args: Any) -> None:
        h, w = self.source.grid
        self.target.set_grid((h - 1) // self.stride + 1, (w - 1) // self.stride + 1)


class _LeViTNorms:
    """What our LeViT adds to timm's: token-aware norm slots, norm context, size check, features()."""

    serves = frozenset({CLASSIFICATION, DENSE_FEATURES})
    config_options = ("in_chans", "drop_path_rate", "stem_stride", "distilled")
    residual_scales = ("stages.*.blocks.*.attn", "stages.*.blocks.*.mlp", "stages.*.downsample.mlp")

    def __init__(self, img_size: int | tuple[int, int] = 224, stem_stride: int = 16,
                 act_layer: str = "hard_swish", use_conv: bool = False, **kwargs: Any) -> None:
        if use_conv:
            raise ValueError("only the linear-mode LeViT is supported (use_conv=False)")
        if stem_stride < 2 or stem_stride & (stem_stride - 1):
            raise ValueError(f"stem_stride must be a power of two >= 2, got {stem_stride}")
        size = to_2tuple(img_size)
        if any(s % stem_stride for s in size):
            raise ValueError(f"LeViT: img_size {img_size} must be divisible by the stem stride {stem_stride}")
        if stem_stride in (8, 16):
            kwargs["stem_type"] = f"s{stem_stride}"  # timm's Stem8 / Stem16
        else:
            embed_dim = kwargs.get("embed_dim", (192,))
            kwargs["stem_backbone"] = conv_stem(kwargs.get("in_chans", 3), embed_dim[0], stem_stride,
                                                get_act_layer(act_layer))
            kwargs["stem_stride"] = stem_stride
        super().__init__(img_size=img_size, act_layer=act_layer, use_conv=False, **kwargs)
        self.img_size, self.stem_stride = tuple(size), stem_stride
        self.fixed_input_size = self.img_size  # dense tasks resize every input to it

        # one token layout per stage; stage 0's grid from the stem, the next ones from each subsampling
        layouts = [TokenLayout(num_prefix_tokens=0) for _ in self.stages]
        self.stage_layouts = layouts
        self.stem.register_forward_hook(GridHook(layouts[0]))
        self._blocks: dict[str, tuple[int, int]] = {}  # module prefix -> (global block index, heads)
        for i, stage in enumerate(self.stages):
            if isinstance(stage.downsample, LevitDownsample):
                attn = stage.downsample.attn_downsample
                stage.downsample.register_forward_pre_hook(_SubsampleGridHook(layouts[i - 1], layouts[i],
                                                                              attn.stride))
                self._blocks[f"stages.{i}.downsample"] = (len(self._blocks), attn.num_heads)
            for j, block in enumerate(stage.blocks):
                self._blocks[f"stages.{i}.blocks.{j}"] = (len(self._blocks), block.attn.num_heads)
            for name, module in list(stage.named_modules()):
                if type(module) is LinearNorm:
                    parent, _, attr = name.rpartition(".")
                    setattr(stage.get_submodule(parent), attr,
                            TokenLinearNorm.from_timm(module, self._token_layout(i, name)))
        self.norm_keep = ["head.bn", "head_dist.bn"]  # BN_Linear on pooled vectors: no tokens, no grid
        self.feature_channels = list(self.embed_dim)
        self.feature_strides = [stem_stride * 2 ** i for i in range(len(self.stages))]

    def _token_layout(self, stage: int, name: str) -> TokenLayout:
        # the subsample attention's keys/values are computed on the previous stage's grid
        kv = name.startswith("downsample.attn_downsample.kv")
        return self.stage_layouts[stage - 1 if kv else stage]

    def norm_context(self, name: str) -> NormContext:
        """Context for the norm slot ``name``: block index, head count, token layout."""
        slot = self.get_submodule(name)
        channels = getattr(slot, "num_features", None) or getattr(slot, "dim", None) \
            or slot.normalized_shape[-1]
        parts = name.split(".")
        if parts[0] == "stages":
            stage = int(parts[1])
            prefix = ".".join(parts[:4] if parts[2] == "blocks" else parts[:3])
            block, heads = self._blocks[prefix]
            layout = self._token_layout(stage, ".".join(parts[2:]))
        else:  # stem maps (nearest stage: 0) and classifiers (last stage) carry no token layout
            block, layout = None, None
            stage = 0 if parts[0] == "stem" else len(self.stages) - 1
            heads = self.stages[stage].blocks[0].attn.num_heads
        return {"block": block, "num_heads": slot_heads(channels, heads), "layout": layout,
                "num_prefix_tokens": 0}

    def _check_size(self, x: torch.Tensor) -> None:
        if tuple(x.shape[-2:]) != self.img_size:
            raise ValueError(f"LeViT is fixed-resolution: built for {self.img_size}, got input "
                             f"{tuple(x.shape[-2:])} (set img_size; the attention biases depend on it)")

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        self._check_size(x)
        return super().forward_features(x)

    def features(self, x: torch.Tensor) -> list[torch.Tensor]:
        self._check_size(x)
        x = self.stem(x).flatten(2).transpose(1, 2)
        maps = []
        for stage, layout in zip(self.stages, self.stage_layouts, strict=True):
            x = stage(x)
            maps.append(x.transpose(1, 2).reshape(x.shape[0], x.shape[2], *layout.grid))
        return maps


class LeViT(_LeViTNorms, Levit, Backbone):
    """Single-head LeViT (``distilled=False``)."""


class LeViTDistilled(_LeViTNorms, LevitDistilled, Backbone):
    """LeViT with the distillation head, averaged with the class head (timm's default build)."""


def _levit(*, distilled: bool, **kwargs: Any) -> LeViT | LeViTDistilled:
    return (LeViTDistilled if distilled else LeViT)(**kwargs)


# timm's LevitDistilled: head and head_dist (counted in the published parameters), averaged; levit.py's drop
# path is 0 for every size but LeViT-384's 0.1
DISTILLED = {"distilled": True}

for _name, _settings, _doc in [
    ("levit_micro", dict(img_size=16, stem_stride=2, embed_dim=(64, 96, 128), key_dim=16, num_heads=(2, 3, 4),
                         depth=(1, 1, 1)), "The CPU member: 16 px, a stride-2 stem."),
    ("levit_128s", dict(embed_dim=(128, 256, 384), key_dim=16, num_heads=(4, 6, 8), depth=(2, 3, 4)),
     "LeViT-128S."),
    ("levit_128", dict(embed_dim=(128, 256, 384), key_dim=16, num_heads=(4, 8, 12), depth=(4, 4, 4)),
     "LeViT-128."),
    ("levit_192", dict(embed_dim=(192, 288, 384), key_dim=32, num_heads=(3, 5, 6), depth=(4, 4, 4)),
     "LeViT-192."),
    ("levit_256", dict(embed_dim=(256, 384, 512), key_dim=32, num_heads=(4, 6, 8), depth=(4, 4, 4)),
     "LeViT-256."),
    ("levit_384", dict(embed_dim=(384, 512, 768), key_dim=32, num_heads=(6, 9, 12), depth=(4, 4, 4),
                       drop_path_rate=0.1), "LeViT-384."),
]:
    register_size(_name, _levit, {**DISTILLED, **_settings}, _doc)
