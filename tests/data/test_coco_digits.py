"""The embedded detection dataset: a real COCO dataset, deterministic, generated once."""

from __future__ import annotations

import hashlib
import json
from itertools import combinations

import numpy as np
import pytest
from pycocotools import mask as mask_utils
from pycocotools.coco import COCO

from normexp.data.coco import check_annotations
from normexp.data.coco_digits import generate_coco_digits

SETTINGS = dict(canvas_size=64, num_train=24, num_val=8, digits_per_image=[2, 4], digit_size=[12, 28],
                max_overlap=0.3, generator_seed=0)


def tree_digest(root) -> str:
    h = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return generate_coco_digits(tmp_path_factory.mktemp("cache"), SETTINGS)


@pytest.mark.parametrize("split,count", [("train2017", 24), ("val2017", 8)])
def test_loads_with_pycocotools_and_passes_the_schema_check(dataset, split, count):
    path = dataset / "annotations" / f"instances_{split}.json"
    raw = json.loads(path.read_text())
    check_annotations(raw, path, masks=True)
    coco = COCO(str(path))
    assert len(coco.imgs) == count and sorted(coco.cats) == list(range(1, 11))
    assert [coco.cats[i]["name"] for i in range(1, 11)] == [str(d) for d in range(10)]
    assert len({a["id"] for a in raw["annotations"]}) == len(raw["annotations"])
    for image_id, image in coco.imgs.items():
        assert (dataset / split / image["file_name"]).is_file()
        anns = coco.imgToAnns[image_id]
        assert 1 <= len(anns) <= 4
        for a in anns:
            mask = coco.annToMask(a)
            assert mask.shape == (64, 64) and a["iscrowd"] == 0
            assert a["area"] == mask.sum() > 0
            assert a["bbox"] == list(mask_utils.toBbox(a["segmentation"]))  # box = the visible strokes
            x, y, w, h = a["bbox"]
            assert x >= 0 and y >= 0 and x + w <= 64 and y + h <= 64 and w >= 1 and h >= 1


def test_several_digits_per_canvas_some_overlapping(dataset):
    coco = COCO(str(dataset / "annotations" / "instances_train2017.json"))
    counts = [len(coco.imgToAnns[i]) for i in coco.imgs]
    assert max(counts) >= 3 and np.mean(counts) > 2

    def iou(a, b):
        return mask_utils.iou([a], [b], [0])[0][0]

    overlaps = [iou(a["bbox"], b["bbox"]) for i in coco.imgs for a, b in combinations(coco.imgToAnns[i], 2)]
    assert max(overlaps) > 0  # some digits overlap ...
    masks = [[coco.annToMask(a) for a in coco.imgToAnns[i]] for i in coco.imgs]
    assert all((sum(m) <= 1).all() for m in masks)  # ... and each pixel belongs to at most one visible digit


def test_same_seed_same_bytes_other_seed_other_data(dataset, tmp_path):
    again = generate_coco_digits(tmp_path / "again", SETTINGS)
    assert again.name == dataset.name and tree_digest(again) == tree_digest(dataset)
    other = generate_coco_digits(tmp_path / "other", {**SETTINGS, "generator_seed": 1})
    assert other.name != dataset.name and tree_digest(other) != tree_digest(dataset)


def test_generated_once_then_reused(tmp_path):
    root = generate_coco_digits(tmp_path, SETTINGS)
    stamp = (root / "annotations" / "instances_val2017.json").stat().st_mtime_ns
    assert generate_coco_digits(tmp_path, SETTINGS) == root
    assert (root / "annotations" / "instances_val2017.json").stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [root.name]  # no temporary tree left behind
