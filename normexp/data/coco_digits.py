"""Embedded detection data: scikit-learn's digits composed onto canvases, written as a real COCO dataset.

Each canvas gets a few digits (``digits_per_image``) at random scales (``digit_size``, the digit's height) and
positions, each in a random colour on a dark, slightly noisy background. Digits may overlap (box IoU up to
``max_overlap``); a later digit covers an earlier one, and masks, boxes and areas are those of what stays
visible. Train canvases use digits of the classification train split, val canvases those of its val split.

The dataset is written once as ``<root>/{train2017,val2017}/<id>.png`` and
``<root>/annotations/instances_{train,val}2017.json`` (boxes ``[x, y, w, h]``, areas, ``iscrowd``, RLE
masks from the strokes; categories ``1..10`` named ``"0".."9"``), so the same COCO loader and evaluator
read it.
Same settings and seed -> the same bytes; the folder name is a hash of the settings.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from pycocotools import mask as mask_utils

from .digits import digits_arrays

log = logging.getLogger(__name__)

SPLITS = {"train": "train2017", "val": "val2017"}
INK_THRESHOLD = 0.3  # a pixel belongs to a digit's mask where its stroke intensity exceeds this
SETTINGS = ("canvas_size", "num_train", "num_val", "digits_per_image", "digit_size", "max_overlap",
            "generator_seed")


def _box_iou(a: tuple[int, int, int, int], b: tuple[int, int, int, int]) -> float:
    """IoU of two (x0, y0, x1, y1) boxes."""
    w = max(0, min(a[2], b[2]) - max(a[0], b[0]))
    h = max(0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = w * h
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union else 0.0


def _scaled(digit: np.ndarray, size: int) -> np.ndarray:
    """An 8x8 digit in [0, 1] resized (bilinear) to size x size."""
    t = torch.from_numpy(digit)[None, None]
    return F.interpolate(t, size=(size, size), mode="bilinear", align_corners=False)[0, 0].numpy()


def compose_canvas(rng: np.random.Generator, digits: np.ndarray, labels: np.ndarray,
                   settings: dict[str, Any]) -> tuple[np.ndarray, list[dict[str, Any]]]:
    """One uint8 RGB canvas and its objects (label, visible binary mask)."""
    size = settings["canvas_size"]
    canvas = rng.uniform(0.0, 0.12, size=(size, size, 3)).astype(np.float32)
    owner = np.full((size, size), -1, dtype=np.int64)  # which object's ink is visible at each pixel
    placed: list[tuple[int, int, int, int]] = []
    objects: list[dict[str, Any]] = []
    lo, hi = settings["digits_per_image"]
    for _ in range(int(rng.integers(lo, hi + 1))):
        side = int(rng.integers(settings["digit_size"][0], settings["digit_size"][1] + 1))
        for _attempt in range(20):  # a position that overlaps earlier digits at most max_overlap
            x, y = (int(v) for v in rng.integers(0, size - side + 1, size=2))
            box = (x, y, x + side, y + side)
            if all(_box_iou(box, other) <= settings["max_overlap"] for other in placed):
                break
        else:
            continue
        k = int(rng.integers(len(digits)))
        stroke = _scaled(digits[k], side)
        colour = rng.uniform(0.5, 1.0, size=3).astype(np.float32)
        region = canvas[y:y + side, x:x + side]
        alpha = stroke[..., None]
        region[:] = (1 - alpha) * region + alpha * colour
        owner[y:y + side, x:x + side][stroke > INK_THRESHOLD] = len(objects)
        placed.append(box)
        objects.append({"label": int(labels[k])})
    pixels = np.round(np.clip(canvas, 0, 1) * 255).astype(np.uint8)
    visible = []
    for i, obj in enumerate(objects):
        mask = owner == i
        if mask.sum() >= 4:  # a digit almost fully covered is no longer an object
            visible.append({**obj, "mask": mask})
    return pixels, visible


def annotation(mask: np.ndarray, label: int, ann_id: int, image_id: int) -> dict[str, Any]:
    rle = mask_utils.encode(np.asfortranarray(mask.astype(np.uint8)))
    x, y, w, h = (float(v) for v in mask_utils.toBbox(rle))
    rle["counts"] = rle["counts"].decode("ascii")
    return {"id": ann_id, "image_id": image_id, "category_id": label + 1, "bbox": [x, y, w, h],
            "area": float(mask.sum()), "iscrowd": 0, "segmentation": rle}


def write_split(root: Path, split: str, count: int, digits: np.ndarray, labels: np.ndarray,
                settings: dict[str, Any], first_image_id: int) -> None:
    folder = root / SPLITS[split]
    folder.mkdir(parents=True)
    images, annotations = [], []
    for n in range(count):
        image_id = first_image_id + n
        rng = np.random.default_rng([settings["generator_seed"], image_id])
        pixels, objects = compose_canvas(rng, digits, labels, settings)
        file_name = f"{image_id:012d}.png"
        Image.fromarray(pixels).save(folder / file_name)
        size = settings["canvas_size"]
        images.append({"id": image_id, "file_name": file_name, "width": size, "height": size})
        for obj in objects:
            annotations.append(annotation(obj["mask"], obj["label"], len(annotations) + 1, image_id))
    dataset = {
        "info": {"description": "normexp coco_digits: scikit-learn digits composed onto canvases",
                 "settings": settings},
        "images": images,
        "annotations": annotations,
        "categories": [{"id": d + 1, "name": str(d), "supercategory": "digit"} for d in range(10)],
    }
    (root / "annotations").mkdir(exist_ok=True)
    (root / "annotations" / f"instances_{SPLITS[split]}.json").write_text(json.dumps(dataset))


def generate_coco_digits(cache_dir: str | Path, settings: dict[str, Any]) -> Path:
    """The dataset's root under ``cache_dir``, generated on first use (atomically: a whole tree or none)."""
    settings = {k: settings[k] for k in SETTINGS}
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:10]
    root = Path(cache_dir) / f"coco_digits-{digest}"
    if root.is_dir():
        return root
    tmp = root.with_name(f"{root.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    arrays = digits_arrays(8, 0.2, 0)  # the 8x8 originals; the classification split keeps val digits unseen
    try:
        write_split(tmp, "train", settings["num_train"], arrays["train_images"], arrays["train_labels"],
                    settings, first_image_id=1)
        write_split(tmp, "val", settings["num_val"], arrays["val_images"], arrays["val_labels"],
                    settings, first_image_id=1 + settings["num_train"])
        os.replace(tmp, root)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not root.is_dir():  # another process finishing first is fine; anything else is not
            raise
    log.info("generated coco_digits at %s", root)
    return root
