"""Detectors from torchvision over any normexp backbone: RetinaNet and Mask R-CNN, each with an FPN.

The backbone (``body``, with whatever normalizer it was built with) gives ``features(x)``: NCHW maps at
``feature_strides``. An FPN (``torchvision.ops.FeaturePyramidNetwork``, no norm, as mmdet's) turns the chosen
levels into ``fpn_channels`` maps and adds the coarser ones:

- RetinaNet (Lin et al. 2017; the PVT paper's config): the three coarsest of four backbone levels (P3-P5 at
  strides 8-32) plus P6 and P7 by stride-2 convolutions on C5 (mmdet ``add_extra_convs='on_input'``);
  anchors ``scale * stride * 2^(k/3)``, k = 0, 1, 2, aspect ratios 0.5, 1, 2.
- Mask R-CNN (He et al. 2017): all four levels (P2-P5) plus a max-pooled P6 for the RPN; RPN anchors
  ``scale * stride``, ratios 0.5, 1, 2; RoIAlign 7x7 (boxes) and 14x14 (masks) over P2-P5; a box head of two
  ``box_head_dim`` (1024) fully connected layers and a mask head of four 3x3 convolutions as wide as the FPN
  (torchvision's and mmdet's heads at 256 channels).

torchvision's ``GeneralizedRCNNTransform`` resizes (``min_size``/``max_size``), normalises and pads to a
multiple of 32; NMS and RoIAlign are torchvision's compiled ops. Fixed-resolution backbones (LeViT) get
every image resized to their ``img_size``.
"""

from __future__ import annotations

import inspect
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torchvision.models.detection import FasterRCNN, MaskRCNN, RetinaNet
from torchvision.models.detection.anchor_utils import AnchorGenerator
from torchvision.models.detection.faster_rcnn import FastRCNNPredictor, TwoMLPHead
from torchvision.models.detection.mask_rcnn import MaskRCNNHeads, MaskRCNNPredictor
from torchvision.ops import FeaturePyramidNetwork, MultiScaleRoIAlign
from torchvision.ops.feature_pyramid_network import LastLevelMaxPool, LastLevelP6P7

DETECTORS = ("retinanet", "mask_rcnn")
DEFAULT_ANCHOR_SCALE = {"retinanet": 4.0, "mask_rcnn": 8.0}  # torchvision's: 32 px at stride 8 / stride 4


class BackboneFPN(nn.Module):
    """``body.features`` at ``levels`` -> FPN maps '0', '1', ... (+ extra levels); ``strides`` of each."""

    def __init__(self, body: nn.Module, levels: Sequence[int], out_channels: int, extra: str) -> None:
        super().__init__()
        self.body, self.levels, self.out_channels = body, list(levels), out_channels
        in_channels = [body.feature_channels[i] for i in self.levels]
        strides = [body.feature_strides[i] for i in self.levels]
        if extra == "p6p7":
            extra_block = LastLevelP6P7(in_channels[-1], out_channels)
            extra_block.use_P5 = False  # P6 from C5 whatever its width (mmdet's 'on_input'); torchvision
            # would switch to P5 when C5 is as wide as the FPN (pvt_v2_b0: 256)
            strides += [strides[-1] * 2, strides[-1] * 4]
        elif extra == "maxpool":
            extra_block = LastLevelMaxPool()
            strides += [strides[-1] * 2]
        else:
            raise ValueError(f"extra must be 'p6p7' or 'maxpool', got {extra!r}")
        self.fpn = FeaturePyramidNetwork(in_channels, out_channels, extra_blocks=extra_block)
        self.strides = strides

    def forward(self, x: torch.Tensor) -> OrderedDict[str, torch.Tensor]:
        maps = self.body.features(x)
        return self.fpn(OrderedDict((str(i), maps[level]) for i, level in enumerate(self.levels)))


def check_options(detector: str, options: dict[str, Any]) -> None:
    """Unknown names would vanish into the transform's ``**kwargs``: refuse them instead."""
    classes = (RetinaNet,) if detector == "retinanet" else (MaskRCNN, FasterRCNN)
    known = {name for cls in classes for name in inspect.signature(cls.__init__).parameters}
    known -= {"self", "kwargs", "backbone", "num_classes"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"task.{detector} has no option {unknown}; torchvision's {classes[0].__name__} "
                         f"takes {', '.join(sorted(known))}")


def default_levels(detector: str, num_levels: int) -> list[int]:
    """RetinaNet: the three coarsest of four or more levels (P3-P5); Mask R-CNN: all."""
    if detector == "retinanet" and num_levels >= 4:
        return list(range(num_levels - 3, num_levels))
    return list(range(num_levels))


def build_detector(body: nn.Module, detector: str, num_classes: int, *, min_size: int | Sequence[int],
                   max_size: int,
                   image_mean: Sequence[float], image_std: Sequence[float], fpn_channels: int = 256,
                   levels: Sequence[int] | None = None, anchor_scale: float | None = None,
                   score_thresh: float = 0.05, detections_per_img: int = 100, box_head_dim: int = 1024,
                   options: dict[str, Any] | None = None) -> nn.Module:
    """A torchvision detector with ``body`` as its backbone; ``num_classes`` includes the background.

    ``options``: further keyword arguments of torchvision's ``RetinaNet`` / ``MaskRCNN`` (proposal counts).
    """
    if detector not in DETECTORS:
        raise ValueError(f"unknown detector '{detector}'; available: {', '.join(DETECTORS)}")
    if not hasattr(body, "features"):
        raise ValueError(f"{type(body).__name__} has no features(): it cannot feed a detector")
    check_options(detector, options or {})
    levels = list(levels) if levels is not None else default_levels(detector, len(body.feature_strides))
    backbone = BackboneFPN(body, levels, fpn_channels, "p6p7" if detector == "retinanet" else "maxpool")
    scale = anchor_scale or DEFAULT_ANCHOR_SCALE[detector]
    # min_size: one size, or several drawn from per training batch (multi-scale; evaluation uses the last)
    min_size = tuple(min_size) if isinstance(min_size, Sequence) else min_size
    common: dict[str, Any] = dict(min_size=min_size, max_size=max_size, image_mean=list(image_mean),
                                  image_std=list(image_std), **(options or {}))
    fixed = getattr(body, "fixed_input_size", None)
    if fixed is not None:
        common["fixed_size"] = tuple(fixed)
    if detector == "retinanet":
        sizes = tuple(tuple(scale * s * 2 ** (k / 3) for k in range(3)) for s in backbone.strides)
        anchors = AnchorGenerator(sizes, ((0.5, 1.0, 2.0),) * len(sizes))
        model = RetinaNet(backbone, num_classes, anchor_generator=anchors, score_thresh=score_thresh,
                          detections_per_img=detections_per_img, **common)
    else:
        model = _mask_rcnn(backbone, num_classes, scale, len(levels), score_thresh, detections_per_img,
                           box_head_dim, common)
    if hasattr(body, "no_weight_decay"):  # the optimizer factory reads it from the top-level model
        names = {f"backbone.body.{name}" for name in body.no_weight_decay()}
        model.no_weight_decay = lambda: names
    return model


def _mask_rcnn(backbone: BackboneFPN, num_classes: int, scale: float, num_levels: int, score_thresh: float,
               detections_per_img: int, box_head_dim: int, common: dict[str, Any]) -> MaskRCNN:
    sizes = tuple((scale * s,) for s in backbone.strides)
    anchors = AnchorGenerator(sizes, ((0.5, 1.0, 2.0),) * len(sizes))
    names = [str(i) for i in range(num_levels)]
    width = backbone.out_channels
    return MaskRCNN(  # num_classes goes to the predictors
        backbone, None, rpn_anchor_generator=anchors, box_score_thresh=score_thresh,
        box_detections_per_img=detections_per_img, box_head=TwoMLPHead(width * 7 * 7, box_head_dim),
        box_predictor=FastRCNNPredictor(box_head_dim, num_classes),
        mask_head=MaskRCNNHeads(width, [width] * 4, dilation=1),
        mask_predictor=MaskRCNNPredictor(width, width, num_classes),
        box_roi_pool=MultiScaleRoIAlign(names, output_size=7, sampling_ratio=0),
        mask_roi_pool=MultiScaleRoIAlign(names, output_size=14, sampling_ratio=0), **common,
    )
