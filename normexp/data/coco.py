"""COCO-format detection data: the standard COCO 2017 tree (``annotations/instances_<split>.json``,
``<split>/``), or the embedded ``coco_digits`` generated as one. Annotations are checked field by field (one
line naming the broken one). Training sets are filtered as MMDetection 2.x's ``CocoDataset._filter_imgs``;
crowd regions and degenerate boxes are not training targets but stay in COCOeval's ground truth."""

from __future__ import annotations

import contextlib
import io
import json
import math
from dataclasses import dataclass
from numbers import Number
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import OmegaConf
from pycocotools.coco import COCO
from torch.utils.data import DataLoader, Dataset

from ..errors import UserError
from .coco_digits import generate_coco_digits
from .images import BadImages, load_rgb
from .loaders import default_cache_dir, make_loader

LAYOUT = "<root>/annotations/instances_<split>.json and <root>/<split>/*.jpg"


def annotation_path(root: str | Path, split: str) -> Path:
    return Path(root) / "annotations" / f"instances_{split}.json"


def check_coco_root(root: str | None, splits: tuple[str, ...]) -> None:
    """Fail with one line unless ``root`` holds an annotation file and an image folder for every split."""
    if not root:
        raise UserError(f"data.root is not set: pass data.root=/path/to/coco (expected layout {LAYOUT})")
    if not Path(root).is_dir():
        raise UserError(f"COCO root '{root}' does not exist: expected layout {LAYOUT}")
    for split in splits:
        if not annotation_path(root, split).is_file():
            raise UserError(f"COCO root '{root}' has no '{annotation_path(root, split)}': "
                            f"expected layout {LAYOUT}")
        if not (Path(root) / split).is_dir():
            raise UserError(f"COCO root '{root}' has no image folder '{split}/': expected layout {LAYOUT}")


def _bad(path: Path, where: str, field: str, why: str) -> UserError:
    return UserError(f"malformed annotation file '{path}': {where}: field '{field}' {why}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_finite(v: Any) -> bool:
    return isinstance(v, Number) and not isinstance(v, bool) and math.isfinite(v)


def check_annotations(dataset: Any, path: Path, masks: bool) -> None:
    """Every field the loader and COCOeval read, with the annotation that breaks it named."""
    if not isinstance(dataset, dict):
        raise UserError(f"malformed annotation file '{path}': the top level must be a JSON object")
    for key in ("images", "annotations", "categories"):
        if not isinstance(dataset.get(key), list):
            raise UserError(f"malformed annotation file '{path}': top-level field '{key}' must be a list")
    category_ids = set()
    for i, cat in enumerate(dataset["categories"]):
        if not isinstance(cat, dict) or not _is_int(cat.get("id")):
            raise _bad(path, f"category {i}", "id", "must be an integer")
        category_ids.add(cat["id"])
    image_ids = set()
    for i, image in enumerate(dataset["images"]):
        where = f"image {i} (id {image.get('id') if isinstance(image, dict) else '?'})"
        if not isinstance(image, dict) or not _is_int(image.get("id")):
            raise _bad(path, where, "id", "must be an integer")
        if not isinstance(image.get("file_name"), str):
            raise _bad(path, where, "file_name", "must be a string")
        for key in ("width", "height"):
            if not _is_int(image.get(key)) or image[key] <= 0:
                raise _bad(path, where, key, f"must be a positive integer, got {image.get(key)!r}")
        image_ids.add(image["id"])
    for i, ann in enumerate(dataset["annotations"]):
        where = f"annotation {i} (id {ann.get('id') if isinstance(ann, dict) else '?'})"
        if not isinstance(ann, dict) or not _is_int(ann.get("id")):
            raise _bad(path, where, "id", "must be an integer")
        if ann.get("image_id") not in image_ids:
            raise _bad(path, where, "image_id", f"names no image in 'images' ({ann.get('image_id')!r})")
        if ann.get("category_id") not in category_ids:
            raise _bad(path, where, "category_id", f"names no category ({ann.get('category_id')!r})")
        box = ann.get("bbox")
        if (not isinstance(box, list) or len(box) != 4 or not all(_is_finite(v) for v in box)
                or box[2] < 0 or box[3] < 0):
            raise _bad(path, where, "bbox", f"must be [x, y, width, height] of finite numbers, width and "
                       f"height >= 0: {box!r}")
        if not _is_finite(ann.get("area")):
            raise _bad(path, where, "area", f"must be a finite number, got {ann.get('area')!r}")
        if ann.get("iscrowd") not in (0, 1):  # COCOeval reads it for every annotation
            raise _bad(path, where, "iscrowd", f"must be 0 or 1, got {ann.get('iscrowd')!r}")
        segmentation = ann.get("segmentation")
        if masks and not (isinstance(segmentation, dict) and {"counts", "size"} <= set(segmentation)
                          or isinstance(segmentation, list)
                          and all(isinstance(p, list) for p in segmentation)):
            raise _bad(path, where, "segmentation", "must be polygons [[x0, y0, x1, y1, ...], ...] or RLE "
                       "{'counts', 'size'} (masks are needed for mask_rcnn)")


def mask_annotation(ann: dict[str, Any]) -> dict[str, Any] | None:
    """``ann`` with only its drawable polygons (3+ points; COCO has a few degenerate ones), None if none."""
    segmentation = ann["segmentation"]
    if isinstance(segmentation, dict):
        return ann
    polygons = [p for p in segmentation if len(p) >= 6]
    return {**ann, "segmentation": polygons} if polygons else None


def load_coco(path: Path, masks: bool) -> COCO:
    """A pycocotools COCO index of a checked annotation file."""
    try:
        dataset = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read annotation file '{path}': {e}") from e
    check_annotations(dataset, path, masks)
    coco = COCO()
    coco.dataset = dataset
    with contextlib.redirect_stdout(io.StringIO()):  # pycocotools prints progress lines
        coco.createIndex()
    return coco


class CocoDetection(Dataset):
    """One split of a COCO tree: items ``(image in [0, 1], target)``; ``hflip``: flip probability.
    ``filter_empty_gt`` / ``min_image_size``: training filters. Unreadable images follow ``on_bad_image``
    (:class:`normexp.data.images.BadImages`)."""

    def __init__(self, root: str | Path, split: str, masks: bool, hflip: float = 0.0,
                 filter_empty_gt: bool = False, min_image_size: int = 0, on_bad_image: str = "skip",
                 replace: bool = False) -> None:
        self.folder = Path(root) / split
        path = annotation_path(root, split)
        self.coco = load_coco(path, masks)
        small = {i for i, info in self.coco.imgs.items()
                 if min(info["width"], info["height"]) < min_image_size}
        empty = {i for i in self.coco.imgs if filter_empty_gt and not self.coco.imgToAnns[i]}
        self.image_ids = [i for i in sorted(self.coco.imgs) if i not in small | empty]
        if not self.image_ids:
            why = [f"{len(small)} smaller than data.min_image_size={min_image_size} px" if small else "",
                   f"{len(empty)} without annotations (data.filter_empty_gt)" if empty else ""]
            raise UserError(f"'{path}' leaves no image to read: of its {len(self.coco.imgs)} images, "
                            + (", ".join(w for w in why if w) or "there are none") + ": check the file and "
                            "those settings")
        self.category_ids = sorted(self.coco.cats)
        self.label_of = {cat: i + 1 for i, cat in enumerate(self.category_ids)}
        self.masks, self.hflip, self.replace = masks, hflip, replace
        self.bad = BadImages([str(self.folder / self.coco.imgs[i]["file_name"]) for i in self.image_ids],
                             on_bad_image, self.folder)
        self.bad.check_present()

    def __len__(self) -> int:
        return len(self.image_ids)

    def bad_files(self) -> list[str]:
        return self.bad.bad_files()

    def __getitem__(self, i: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]] | None:
        return self.bad.read(i, self.load, self.replace)

    def load(self, i: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        image_id = self.image_ids[i]
        image = load_rgb(self.bad.files[i])
        image = torch.from_numpy(np.asarray(image, dtype=np.float32) / 255).permute(2, 0, 1)
        anns = [a for a in self.coco.imgToAnns[image_id]
                if not a["iscrowd"] and a["bbox"][2] >= 1 and a["bbox"][3] >= 1 and a["area"] > 0]
        if self.masks:  # an instance without a drawable mask is no Mask R-CNN target
            anns = [m for m in map(mask_annotation, anns) if m is not None]
        boxes = torch.tensor([[x, y, x + w, y + h] for x, y, w, h in (a["bbox"] for a in anns)],
                             dtype=torch.float32).reshape(-1, 4)
        target = {"boxes": boxes, "image_id": torch.tensor(image_id),
                  "labels": torch.tensor([self.label_of[a["category_id"]] for a in anns], dtype=torch.int64)}
        if self.masks:
            height, width = image.shape[1:]
            target["masks"] = torch.from_numpy(
                np.stack([self.coco.annToMask(a) for a in anns]) if anns
                else np.zeros((0, height, width), dtype=np.uint8))
        if self.hflip and torch.rand(()) < self.hflip:
            image = image.flip(-1)
            width = image.shape[-1]
            x0, y0, x1, y1 = boxes.unbind(dim=1)
            target["boxes"] = torch.stack([width - x1, y0, width - x0, y1], dim=1)
            if self.masks:
                target["masks"] = target["masks"].flip(-1)
        return image, target


def collate(batch: list[tuple[torch.Tensor, dict[str, Any]] | None]) -> tuple[list, list]:
    """A list batch (the detector resizes and pads); unreadable images (None) are left out."""
    readable = [item for item in batch if item is not None]
    return [image for image, _ in readable], [target for _, target in readable]


@dataclass
class DetectionData:
    train: DataLoader
    val: DataLoader
    num_classes: int            # including background (label 0)
    category_ids: list[int]     # label i -> COCO category_ids[i - 1]
    val_coco: COCO              # ground truth for COCOeval
    root: Path


def detection_root(cfg: Any) -> Path:
    """The COCO tree of ``data``: the given root, or the generated digits dataset."""
    if cfg.name == "coco_digits" and not cfg.root:
        return generate_coco_digits(default_cache_dir("dataset_cache"),
                                    OmegaConf.to_container(cfg, resolve=True))
    check_coco_root(cfg.root, (cfg.train_split, cfg.val_split))
    return Path(cfg.root)


def build_detection_data(cfg: Any, seed: int, masks: bool) -> DetectionData:
    root = detection_root(cfg)
    train_split, val_split = cfg.train_split, cfg.val_split
    on_bad = cfg.get("on_bad_image", "skip")
    train = CocoDetection(root, train_split, masks, hflip=cfg.hflip, filter_empty_gt=cfg.filter_empty_gt,
                          min_image_size=cfg.min_image_size, on_bad_image=on_bad, replace=True)
    val = CocoDetection(root, val_split, masks, on_bad_image=on_bad)
    if train.category_ids != val.category_ids:
        raise UserError(f"'{annotation_path(root, train_split)}' and '{annotation_path(root, val_split)}' "
                        "have different categories")
    if len(train.category_ids) != cfg.num_classes:
        found = len(train.category_ids)
        raise UserError(f"'{annotation_path(root, train_split)}' has {found} categories but "
                        f"data.num_classes={cfg.num_classes}; set data.num_classes={found}")
    return DetectionData(
        train=make_loader(train, cfg.batch_size, True, cfg.num_workers, seed, collate_fn=collate),
        val=make_loader(val, cfg.eval_batch_size, False, cfg.num_workers, seed, collate_fn=collate),
        num_classes=cfg.num_classes + 1, category_ids=train.category_ids, val_coco=val.coco, root=root,
    )
