"""The COCO loader: layout and annotation checks in one line, targets as torchvision's detectors take them."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import coco_jpeg_tree

from normexp.data.coco import CocoDetection, build_detection_data, check_coco_root, collate
from normexp.data.coco_digits import generate_coco_digits
from normexp.errors import UserError

SETTINGS = dict(canvas_size=64, num_train=8, num_val=4, digits_per_image=[2, 4], digit_size=[12, 28],
                max_overlap=0.3, generator_seed=0)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return generate_coco_digits(tmp_path_factory.mktemp("cache"), SETTINGS)


def test_targets_are_boxes_labels_and_masks_of_the_annotations(root):
    data = CocoDetection(root, "val2017", masks=True)
    image, target = data[0]
    anns = data.coco.imgToAnns[data.image_ids[0]]
    assert image.shape == (3, 64, 64) and image.dtype == torch.float32
    assert 0 <= image.min() <= image.max() <= 1
    x, y, w, h = anns[0]["bbox"]
    assert target["boxes"][0].tolist() == [x, y, x + w, y + h]
    assert target["labels"].tolist() == [a["category_id"] for a in anns]  # ids 1..10 are already contiguous
    assert target["masks"].shape == (len(anns), 64, 64) and int(target["image_id"]) == data.image_ids[0]
    assert target["masks"].sum(dim=(1, 2)).tolist() == [a["area"] for a in anns]


def test_horizontal_flip_moves_boxes_with_the_masks(root):
    plain = CocoDetection(root, "val2017", masks=True)
    flipped = CocoDetection(root, "val2017", masks=True, hflip=1.0)
    (image, target), (image_f, target_f) = plain[1], flipped[1]
    assert torch.equal(image_f, image.flip(-1)) and torch.equal(target_f["masks"], target["masks"].flip(-1))
    for box, mask in zip(target_f["boxes"], target_f["masks"], strict=True):
        cols = mask.any(dim=0).nonzero()
        assert box[0] == cols.min() and box[2] == cols.max() + 1


def test_missing_tree_is_one_line(tmp_path, root):
    with pytest.raises(UserError, match="data.root is not set"):
        check_coco_root(None, ("train2017",))
    with pytest.raises(UserError, match="does not exist"):
        check_coco_root(str(tmp_path / "nowhere"), ("train2017",))
    (tmp_path / "coco" / "annotations").mkdir(parents=True)
    with pytest.raises(UserError, match="instances_train2017.json"):
        check_coco_root(str(tmp_path / "coco"), ("train2017",))
    (tmp_path / "coco" / "annotations" / "instances_train2017.json").write_text("{}")
    with pytest.raises(UserError, match="no image folder 'train2017/'"):
        check_coco_root(str(tmp_path / "coco"), ("train2017",))


def broken_copy(root, tmp_path, edit):
    """A copy of the val split with ``edit`` applied to its annotation file."""
    copy = tmp_path / "broken"
    (copy / "annotations").mkdir(parents=True)
    (copy / "val2017").symlink_to(root / "val2017")
    data = json.loads((root / "annotations" / "instances_val2017.json").read_text())
    edit(data)
    (copy / "annotations" / "instances_val2017.json").write_text(json.dumps(data))
    return copy


@pytest.mark.parametrize("edit,message", [
    (lambda d: d["annotations"][2].update(bbox=[1, 2, -3, 4]), r"annotation 2 \(id 3\): field 'bbox'"),
    (lambda d: d["annotations"][4].update(bbox=[1, 2, float("nan"), 4]),
     r"annotation 4 \(id 5\): field 'bbox' must be \[x, y, width, height\] of finite numbers"),
    (lambda d: d["annotations"][4].update(bbox=[float("-inf"), 2, 3, 4]),
     r"annotation 4 \(id 5\): field 'bbox'"),
    (lambda d: d["annotations"][4].update(area=float("inf")), r"annotation 4 \(id 5\): field 'area'"),
    (lambda d: d["annotations"][1].update(category_id=99), r"annotation 1 \(id 2\): field 'category_id'"),
    (lambda d: d["annotations"][0].update(image_id=12345), r"annotation 0 \(id 1\): field 'image_id'"),
    (lambda d: d["annotations"][3].pop("area"), r"annotation 3 \(id 4\): field 'area'"),
    (lambda d: d["annotations"][0].update(segmentation="a polygon"),
     r"annotation 0 \(id 1\): field 'segmentation'"),
    (lambda d: d["annotations"][5].pop("iscrowd"), r"annotation 5 \(id 6\): field 'iscrowd'"),
    (lambda d: d["images"][1].update(width="64"), r"image 1 \(id \d+\): field 'width'"),
    (lambda d: d.pop("categories"), "top-level field 'categories'"),
])
def test_malformed_annotation_names_the_annotation_and_field(root, tmp_path, edit, message):
    broken = broken_copy(root, tmp_path, edit)
    with pytest.raises(UserError, match=message) as e:
        CocoDetection(broken, "val2017", masks=True)
    assert "\n" not in str(e.value)


def test_category_count_must_match_the_config(root):
    from omegaconf import OmegaConf
    cfg = OmegaConf.create(dict(name="coco", root=str(root), train_split="train2017", val_split="val2017",
                                num_classes=80, hflip=0.0, filter_empty_gt=True, min_image_size=32,
                                batch_size=2,
                                eval_batch_size=2, num_workers=0))
    with pytest.raises(UserError, match="has 10 categories but data.num_classes=80"):
        build_detection_data(cfg, seed=0, masks=False)


def test_degenerate_polygons_are_dropped_not_fatal(root, tmp_path):
    """COCO 2017 holds a few polygons of under 3 points: such a polygon is dropped; an instance left
    without any is no Mask R-CNN target (it still counts as ground truth for COCOeval)."""
    def edit(d):
        first = [a for a in d["annotations"] if a["image_id"] == d["images"][0]["id"]]
        first[0]["segmentation"] = [[1, 2, 3, 4]]
        first[1]["segmentation"] = [[1, 2, 3, 4], [10, 10, 20, 10, 20, 20, 10, 20]]
    data = CocoDetection(broken_copy(root, tmp_path, edit), "val2017", masks=True)
    _, target = data[0]
    count = len(data.coco.imgToAnns[data.image_ids[0]])
    assert len(target["labels"]) == len(target["masks"]) == count - 1
    assert target["masks"][0].sum() == 100  # the square that remains


def test_gapped_category_ids_map_to_contiguous_labels_and_back(root, tmp_path):
    """COCO's ids run 1..90 with gaps: labels are 1..K in id order, and results name the original ids."""
    from normexp.metrics.coco import coco_evaluate, coco_results

    def edit(d):
        for cat in d["categories"]:
            cat["id"] = cat["id"] * 7 + 3
        for ann in d["annotations"]:
            ann["category_id"] = ann["category_id"] * 7 + 3
    data = CocoDetection(broken_copy(root, tmp_path, edit), "val2017", masks=False)
    assert data.category_ids == [d * 7 + 3 for d in range(1, 11)]
    results = []
    for i in range(len(data)):
        _, target = data[i]
        anns = data.coco.imgToAnns[data.image_ids[i]]
        assert target["labels"].tolist() == [data.category_ids.index(a["category_id"]) + 1 for a in anns]
        output = {**target, "scores": torch.ones(len(anns))}
        results += coco_results(int(target["image_id"]), output, data.category_ids, masks=False)[0]
    assert coco_evaluate(data.coco, results, "bbox")[0]["AP"] == 1.0


def test_training_sets_are_filtered_as_mmdet_filters_them(root, tmp_path):
    """mmdet 2.x CocoDataset._filter_imgs: no image without annotations (a crowd one counts) and none under
    32 px on a side; and no target of zero area. Evaluation sets keep every image."""
    ids = sorted(json.loads((root / "annotations" / "instances_val2017.json").read_text())["images"][i]["id"]
                 for i in range(4))

    def edit(d):
        d["annotations"] = [a for a in d["annotations"] if a["image_id"] != ids[0]]  # no annotation left
        for a in d["annotations"]:
            a["iscrowd"] = int(a["image_id"] == ids[1])  # crowd annotations only: still an annotated image
        next(im for im in d["images"] if im["id"] == ids[2])["width"] = 31
        next(a for a in d["annotations"] if a["image_id"] == ids[3])["area"] = 0
    path = broken_copy(root, tmp_path, edit)
    train = CocoDetection(path, "val2017", masks=False, filter_empty_gt=True, min_image_size=32)
    assert train.image_ids == [ids[1], ids[3]]
    assert CocoDetection(path, "val2017", masks=False).image_ids == ids
    assert len(train[0][1]["boxes"]) == 0  # crowd regions are no targets
    assert len(train[1][1]["boxes"]) == len(train.coco.imgToAnns[ids[3]]) - 1  # nor a zero-area one


def test_missing_and_unreadable_images_are_skipped_and_counted_or_named(root, tmp_path, caplog):
    tree = coco_jpeg_tree(root, tmp_path / "coco")
    missing = sorted((tree / "train2017").iterdir())[0]
    missing.unlink()
    truncated = sorted((tree / "val2017").iterdir())[1]
    truncated.write_bytes(truncated.read_bytes()[:100])
    train = CocoDetection(tree, "train2017", masks=False, replace=True)
    assert train.bad_files() == [str(missing)]  # found by the check at construction, before any epoch
    assert "1 of the 8 images of" in caplog.text
    image, target = train[0]  # the next readable image takes its place
    assert int(target["image_id"]) == train.image_ids[1] and image.shape == (3, 64, 64)
    val = CocoDetection(tree, "val2017", masks=True)
    assert val[1] is None and val.bad_files() == [str(truncated)]  # left out of its batch, counted
    assert collate([val[0], val[1]])[0][0].shape == (3, 64, 64) and len(collate([val[1]])[0]) == 0

    with pytest.raises(UserError, match=f"1 of the 8 images of '{tree / 'train2017'}' are missing "
                                        f"\\(the first: '{missing}'\\): restore them, or skip"):
        CocoDetection(tree, "train2017", masks=False, on_bad_image="fail")
    with pytest.raises(UserError, match=f"cannot read image '{truncated}' \\(OSError: "):
        CocoDetection(tree, "val2017", masks=False, on_bad_image="fail")[1]


def test_a_set_with_no_image_left_says_why(root):
    with pytest.raises(UserError, match=r"instances_val2017.json' leaves no image to read: of its 4 "
                                        r"images, 4 smaller than data.min_image_size=100 px: check the file"):
        CocoDetection(root, "val2017", masks=False, min_image_size=100)
