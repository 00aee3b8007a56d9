"""COCOeval through our path: ground truth as predictions scores 1.0; worse predictions score less."""

from __future__ import annotations

import pytest
import torch

from normexp.data.coco import CocoDetection
from normexp.data.coco_digits import generate_coco_digits
from normexp.metrics.coco import STATS, coco_evaluate, coco_results

SETTINGS = dict(canvas_size=64, num_train=4, num_val=12, digits_per_image=[2, 4], digit_size=[12, 28],
                max_overlap=0.3, generator_seed=0)


@pytest.fixture(scope="module")
def val(tmp_path_factory):
    root = generate_coco_digits(tmp_path_factory.mktemp("cache"), SETTINGS)
    return CocoDetection(root, "val2017", masks=True)


def predictions(val, shift: float = 0.0):
    """Detector-style outputs made from the ground truth (mask probabilities, boxes moved by ``shift``)."""
    bbox, segm = [], []
    for i in range(len(val)):
        _, target = val[i]
        output = {"boxes": target["boxes"] + shift, "labels": target["labels"],
                  "scores": torch.ones(len(target["labels"])), "masks": target["masks"][:, None].float()}
        b, s = coco_results(int(target["image_id"]), output, val.category_ids, masks=True)
        bbox += b
        segm += s
    return bbox, segm


def test_ground_truth_as_predictions_scores_one(val):
    bbox, segm = predictions(val)
    for results, iou_type in ((bbox, "bbox"), (segm, "segm")):
        stats, table = coco_evaluate(val.coco, results, iou_type)
        assert set(stats) == set(STATS)
        assert stats["AP"] == stats["AP50"] == stats["AP75"] == 1.0, (iou_type, stats)
        assert stats["APl"] is None  # no object above 96^2 px: undefined, not 0 or 1 (nor divergence)
        assert "Average Precision" in table


def test_background_label_detections_are_dropped(val):
    _, target = val[0]
    output = {"boxes": torch.tensor([[1.0, 2.0, 30.0, 40.0], [5.0, 5.0, 20.0, 20.0]]),
              "labels": torch.tensor([0, 3]), "scores": torch.tensor([0.9, 0.8]),
              "masks": torch.ones(2, 1, 64, 64)}
    bbox, segm = coco_results(7, output, val.category_ids, masks=True)
    assert [r["category_id"] for r in bbox] == [r["category_id"] for r in segm] == [val.category_ids[2]]
    assert bbox[0]["bbox"] == [5.0, 5.0, 15.0, 15.0] and bbox[0]["score"] == pytest.approx(0.8)


def test_shifted_boxes_score_less_and_no_detections_score_zero(val):
    bbox, _ = predictions(val, shift=4.0)
    stats, _ = coco_evaluate(val.coco, bbox, "bbox")
    assert 0 < stats["AP"] < 1 and stats["AP75"] < stats["AP50"]
    assert coco_evaluate(val.coco, [], "bbox")[0]["AP"] == 0.0
