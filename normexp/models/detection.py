"""Detectors from torchvision over any normexp backbone: RetinaNet (Lin et al. 2017) and Mask R-CNN (He et al.
2017), each with an FPN on ``body.features(x)``, built to match the MMDetection 2.x configs the papers trained
with (whai362/PVT ``detection/configs/_base_/models/retinanet_r50_fpn.py`` and ``mask_rcnn_r50_fpn.py``,
mmdet 2.13; Swin's Mask R-CNN uses the same). The classes below are where torchvision's defaults differ from
mmdet's; what still differs is in docs/detection.md (*What differs from MMDetection*). Fixed-resolution
backbones (LeViT) get every image resized to their ``img_size``.
"""

from __future__ import annotations

import inspect
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torchvision.models.detection import FasterRCNN, MaskRCNN, RetinaNet
from torchvision.models.detection._utils import Matcher
from torchvision.models.detection.anchor_utils import AnchorGenerator
from torchvision.models.detection.faster_rcnn import FastRCNNPredictor, TwoMLPHead
from torchvision.models.detection.mask_rcnn import MaskRCNNHeads, MaskRCNNPredictor
from torchvision.ops import FeaturePyramidNetwork, MultiScaleRoIAlign, roi_align
from torchvision.ops.feature_pyramid_network import ExtraFPNBlock, LastLevelMaxPool

from .base import DENSE_FEATURES, Backbone, served

DETECTORS = ("retinanet", "mask_rcnn")
DEFAULT_ANCHOR_SCALE = {"retinanet": 4.0, "mask_rcnn": 8.0}  # mmdet's: 32 px at stride 8 / stride 4
RPN_MIN_POS_IOU = 0.3  # mmdet mask_rcnn_r50_fpn.py train_cfg.rpn.assigner.min_pos_iou
FINEST_SCALE = 56  # mmdet SingleRoIExtractor: RoIs below 112 px go to the finest level


def xavier_init(module: nn.Module) -> None:
    """Xavier-uniform weights and zero bias for every conv / linear in ``module`` (mmdet's FPN init)."""
    for m in module.modules():
        if isinstance(m, (nn.Conv2d, nn.Linear)):
            nn.init.xavier_uniform_(m.weight)
            if m.bias is not None:
                nn.init.zeros_(m.bias)


class ExtraLevelsP6P7(ExtraFPNBlock):
    """RetinaNet's P6 = conv3x3/2(C5) and P7 = conv3x3/2(P6), no ReLU in between (mmdet's 'on_input')."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.p6 = nn.Conv2d(in_channels, out_channels, 3, stride=2, padding=1)
        self.p7 = nn.Conv2d(out_channels, out_channels, 3, stride=2, padding=1)

    def forward(self, p: list[torch.Tensor], c: list[torch.Tensor],
                names: list[str]) -> tuple[list[torch.Tensor], list[str]]:
        p6 = self.p6(c[-1])
        return [*p, p6, self.p7(p6)], [*names, "p6", "p7"]


class UnroundedAnchorGenerator(AnchorGenerator):
    """torchvision's anchors without rounding the cell anchors to whole pixels (mmdet 2.x's)."""

    def generate_anchors(self, scales: list[int], aspect_ratios: list[float],
                         dtype: torch.dtype = torch.float32,
                         device: torch.device | None = None) -> torch.Tensor:
        scales = torch.as_tensor(scales, dtype=dtype, device=device)
        h_ratios = torch.sqrt(torch.as_tensor(aspect_ratios, dtype=dtype, device=device))
        ws = (scales[None, :] / h_ratios[:, None]).view(-1)
        hs = (h_ratios[:, None] * scales[None, :]).view(-1)
        return torch.stack([-ws, -hs, ws, hs], dim=1) / 2


class MinIoUMatcher(Matcher):
    """torchvision's matcher with mmdet's ``min_pos_iou`` for low-quality matches (``MaxIoUAssigner``)."""

    def __init__(self, high_threshold: float, low_threshold: float, min_pos_iou: float) -> None:
        super().__init__(high_threshold, low_threshold, allow_low_quality_matches=True)
        self.min_pos_iou = min_pos_iou

    def set_low_quality_matches_(self, matches: torch.Tensor, all_matches: torch.Tensor,
                                 match_quality_matrix: torch.Tensor) -> None:
        highest = match_quality_matrix.max(dim=1, keepdim=True).values
        _, preds = torch.where((match_quality_matrix == highest) & (highest >= self.min_pos_iou))
        matches[preds] = all_matches[preds]


class AlignedRoIAlign(MultiScaleRoIAlign):
    """mmdet's ``SingleRoIExtractor`` over mmcv's ``RoIAlign``: ``aligned=True`` and level
    ``floor(log2(sqrt(wh) / 56 + 1e-6))``, clamped to the levels there are."""

    def __init__(self, featmap_names: list[str], strides: Sequence[int], output_size: int,
                 sampling_ratio: int = 0) -> None:
        super().__init__(featmap_names, output_size, sampling_ratio)
        self.strides = list(strides)

    def forward(self, x: dict[str, torch.Tensor], boxes: list[torch.Tensor],
                image_shapes: list[tuple[int, int]]) -> torch.Tensor:
        features = [x[name] for name in self.featmap_names]
        rois = torch.cat([torch.cat([torch.full_like(b[:, :1], i), b], dim=1) for i, b in enumerate(boxes)])
        scale = torch.sqrt((rois[:, 3] - rois[:, 1]) * (rois[:, 4] - rois[:, 2]))
        levels = torch.floor(torch.log2(scale / FINEST_SCALE + 1e-6)).clamp(0, len(features) - 1).long()
        out = rois.new_zeros((len(rois), features[0].shape[1], *self.output_size))
        for level, (feature, stride) in enumerate(zip(features, self.strides, strict=True)):
            idx = torch.where(levels == level)[0]
            out[idx] = roi_align(feature, rois[idx], self.output_size, spatial_scale=1 / stride,
                                 sampling_ratio=self.sampling_ratio, aligned=True).to(out.dtype)
        return out


class BackboneFPN(nn.Module):
    """``body.features`` at ``levels`` -> FPN maps '0', '1', ... (+ extra levels); ``strides`` of each."""

    def __init__(self, body: Backbone, levels: Sequence[int], out_channels: int, extra: str) -> None:
        super().__init__()
        self.body, self.levels, self.out_channels = body, list(levels), out_channels
        in_channels = [body.feature_channels[i] for i in self.levels]
        strides = [body.feature_strides[i] for i in self.levels]
        if extra == "p6p7":
            extra_block = ExtraLevelsP6P7(in_channels[-1], out_channels)
            strides += [strides[-1] * 2, strides[-1] * 4]
        elif extra == "maxpool":
            extra_block = LastLevelMaxPool()
            strides += [strides[-1] * 2]
        else:
            raise ValueError(f"extra must be 'p6p7' or 'maxpool', got {extra!r}")
        self.fpn = FeaturePyramidNetwork(in_channels, out_channels, extra_blocks=extra_block)
        xavier_init(self.fpn)
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


def build_detector(body: Backbone, detector: str, num_classes: int, *, min_size: int | Sequence[int],
                   max_size: int,
                   image_mean: Sequence[float], image_std: Sequence[float], fpn_channels: int = 256,
                   levels: Sequence[int] | None = None, anchor_scale: float | None = None,
                   score_thresh: float = 0.05, detections_per_img: int = 100, box_head_dim: int = 1024,
                   rpn_min_pos_iou: float | None = RPN_MIN_POS_IOU,
                   options: dict[str, Any] | None = None) -> nn.Module:
    """A torchvision detector with ``body`` as its backbone; ``num_classes`` includes the background.
    ``options``: further keyword arguments of torchvision's ``RetinaNet`` / ``MaskRCNN``;
    ``rpn_min_pos_iou``: the lowest IoU of the RPN's low-quality matches (None: any)."""
    if detector not in DETECTORS:
        raise ValueError(f"unknown detector '{detector}'; available: {', '.join(DETECTORS)}")
    if DENSE_FEATURES not in served(body):
        raise ValueError(f"{type(body).__name__} serves no dense features (a plain model: pyramid_scales): "
                         "it cannot feed a detector")
    check_options(detector, options or {})
    levels = list(levels) if levels is not None else default_levels(detector, len(body.feature_strides))
    backbone = BackboneFPN(body, levels, fpn_channels, "p6p7" if detector == "retinanet" else "maxpool")
    scale = anchor_scale or DEFAULT_ANCHOR_SCALE[detector]
    # min_size: one size, or several, one drawn per training image (multi-scale; evaluation uses the last)
    min_size = tuple(min_size) if isinstance(min_size, Sequence) else min_size
    common: dict[str, Any] = dict(min_size=min_size, max_size=max_size, image_mean=list(image_mean),
                                  image_std=list(image_std), **(options or {}))
    if body.fixed_input_size is not None:
        common["fixed_size"] = tuple(body.fixed_input_size)
    if detector == "retinanet":
        sizes = tuple(tuple(scale * s * 2 ** (k / 3) for k in range(3)) for s in backbone.strides)
        anchors = UnroundedAnchorGenerator(sizes, ((0.5, 1.0, 2.0),) * len(sizes))
        model = RetinaNet(backbone, num_classes, anchor_generator=anchors, score_thresh=score_thresh,
                          detections_per_img=detections_per_img, **common)
    else:
        model = _mask_rcnn(backbone, num_classes, scale, len(levels), score_thresh, detections_per_img,
                           box_head_dim, common)
        if rpn_min_pos_iou is not None:
            matcher = model.rpn.proposal_matcher
            model.rpn.proposal_matcher = MinIoUMatcher(matcher.high_threshold, matcher.low_threshold,
                                                       rpn_min_pos_iou)
    names = {f"backbone.body.{name}" for name in body.no_weight_decay()}
    model.no_weight_decay = lambda: names  # the optimizer factory reads it from the top-level model
    return model


def _mask_rcnn(backbone: BackboneFPN, num_classes: int, scale: float, num_levels: int, score_thresh: float,
               detections_per_img: int, box_head_dim: int, common: dict[str, Any]) -> MaskRCNN:
    sizes = tuple((scale * s,) for s in backbone.strides)
    anchors = UnroundedAnchorGenerator(sizes, ((0.5, 1.0, 2.0),) * len(sizes))
    names = [str(i) for i in range(num_levels)]
    strides = backbone.strides[:num_levels]
    width = backbone.out_channels
    box_head = TwoMLPHead(width * 7 * 7, box_head_dim)
    box_predictor = FastRCNNPredictor(box_head_dim, num_classes)
    xavier_init(box_head)  # mmdet Shared2FCBBoxHead / BBoxHead init
    for layer, std in ((box_predictor.cls_score, 0.01), (box_predictor.bbox_pred, 0.001)):
        nn.init.normal_(layer.weight, std=std)
        nn.init.zeros_(layer.bias)
    return MaskRCNN(  # num_classes goes to the predictors
        backbone, None, rpn_anchor_generator=anchors, box_score_thresh=score_thresh,
        box_detections_per_img=detections_per_img, box_head=box_head, box_predictor=box_predictor,
        mask_head=MaskRCNNHeads(width, [width] * 4, dilation=1),
        mask_predictor=MaskRCNNPredictor(width, width, num_classes),
        box_roi_pool=AlignedRoIAlign(names, strides, output_size=7),
        mask_roi_pool=AlignedRoIAlign(names, strides, output_size=14), **common,
    )
