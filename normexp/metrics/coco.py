"""COCO detection metrics with pycocotools' COCOeval: AP, AP50, AP75, APs, APm, APl per IoU type, as
fractions (0.374, not 37.4), from a torchvision detector's outputs."""

from __future__ import annotations

import contextlib
import copy
import io
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from pycocotools import mask as mask_utils
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval

STATS = ("AP", "AP50", "AP75", "APs", "APm", "APl")  # COCOeval.stats[0:6]


def coco_results(image_id: int, output: dict[str, torch.Tensor], category_ids: Sequence[int],
                 masks: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(bbox results, segm results) of one image; label i is category ``category_ids[i - 1]``, and
    background (label 0) detections are dropped."""
    keep = output["labels"] > 0
    output = {k: v[keep] for k, v in output.items() if k in ("boxes", "scores", "labels", "masks")}
    boxes = output["boxes"].detach().cpu().float()
    xywh = torch.cat([boxes[:, :2], boxes[:, 2:] - boxes[:, :2]], dim=1).tolist()
    scores = output["scores"].detach().cpu().tolist()
    categories = [category_ids[int(label) - 1] for label in output["labels"].cpu()]
    bbox = [{"image_id": image_id, "category_id": c, "bbox": b, "score": s}
            for b, c, s in zip(xywh, categories, scores, strict=True)]
    segm = []
    if masks:
        binary = (output["masks"][:, 0] > 0.5).cpu().numpy().astype(np.uint8)
        for m, c, s in zip(binary, categories, scores, strict=True):
            rle = mask_utils.encode(np.asfortranarray(m))
            rle["counts"] = rle["counts"].decode("ascii")
            segm.append({"image_id": image_id, "category_id": c, "segmentation": rle, "score": s})
    return bbox, segm


def coco_evaluate(ground_truth: COCO, results: list[dict[str, Any]], iou_type: str,
                  image_ids: Sequence[int] | None = None) -> tuple[dict[str, float | None], str]:
    """COCOeval of ``results`` (``iou_type`` 'bbox' or 'segm'): the six AP figures and the printed table; no
    detections at all score 0."""
    if not results:
        return {k: 0.0 for k in STATS}, f"{iou_type}: no detections"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        detections = ground_truth.loadRes(copy.deepcopy(results))  # loadRes adds fields in place
        evaluator = COCOeval(ground_truth, detections, iou_type)
        if image_ids is not None:
            evaluator.params.imgIds = list(image_ids)
        evaluator.evaluate()
        evaluator.accumulate()
        evaluator.summarize()
    # COCOeval reports -1 where a size range has no ground truth; that is "undefined" (None), not a score --
    # and not a non-finite number, which the record reads as divergence
    stats = {k: float(v) if v >= 0 else None for k, v in zip(STATS, evaluator.stats[:6], strict=True)}
    lines = printed.getvalue().splitlines()
    table = "\n".join(line for line in lines if line.startswith(" Average Precision"))
    return stats, table
