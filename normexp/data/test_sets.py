"""Test sets beyond ImageNet-C, scored as timm's ``validate.py`` does: ImageNet-ReaL (any of an image's
reassessed labels counts, arXiv 2006.07159), -V2, -A and -R (logits restricted to their 200 classes) and
-Sketch, from user-given roots; on the digits, stand-ins. Targets are multi-hot rows over the model's classes,
so one counter scores single- and multi-label sets."""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset, TensorDataset

from ..errors import UserError
from .digits import digits_arrays, standardisation
from .images import BadImages, class_folders, image_files, load_rgb
from .transforms import build_transforms

IMAGENET_CLASSES = 1000


@dataclass(frozen=True)
class TestSet:
    """A published test set: its file in timm's ``results/``, where it is published, and timm's file of
    its ImageNet-1k classes (None: all 1000)."""

    name: str
    title: str
    results_file: str
    published: str
    class_file: str | None = None
    real_labels: bool = False


TEST_SETS = {s.name: s for s in (
    TestSet("imagenet_real", "ImageNet-ReaL", "results-imagenet-real.csv",
            "the ImageNet validation images; labels: https://github.com/google-research/reassessed-imagenet",
            real_labels=True),
    TestSet("imagenet_v2", "ImageNet-V2", "results-imagenetv2-matched-frequency.csv",
            "https://github.com/modestyachts/ImageNetV2"),
    TestSet("imagenet_a", "ImageNet-A", "results-imagenet-a.csv",
            "https://github.com/hendrycks/natural-adv-examples", class_file="imagenet_a_indices.txt"),
    TestSet("imagenet_r", "ImageNet-R", "results-imagenet-r.csv", "https://github.com/hendrycks/imagenet-r",
            class_file="imagenet_r_indices.txt"),
    TestSet("imagenet_sketch", "ImageNet-Sketch", "results-sketch.csv",
            "https://github.com/HaohanWang/ImageNet-Sketch"),
)}


def timm_info(file: str) -> str:
    """A file timm packages in ``timm/data/_info``."""
    return (resources.files("timm.data") / "_info" / file).read_text()


def subset_classes(test_set: TestSet) -> list[int] | None:
    """The ImageNet-1k indices of a 200-class set (sorted, as its sorted class folders are), else None."""
    return None if test_set.class_file is None else [int(i) for i in timm_info(test_set.class_file).split()]


def real_labels(labels_file: str | None) -> dict[str, list[int]]:
    """File name -> ReaL labels, from ``labels_file`` or timm's packaged ``imagenet_real_labels.json``
    (the i-th list belongs to ``ILSVRC2012_val_<i+1:08d>.JPEG``)."""
    text = Path(labels_file).read_text() if labels_file else timm_info("imagenet_real_labels.json")
    return {f"ILSVRC2012_val_{i + 1:08d}.JPEG": labels for i, labels in enumerate(json.loads(text))}


@dataclass
class LoadedTestSet:
    """A test set ready to score: i -> (model input, multi-hot target over the model's classes)."""

    spec: TestSet
    images: Dataset
    classes: list[int] | None  # the logits' columns it is scored on (None: all)
    source: str                # its root, or what stands in for it
    stand_in: bool


# ---------------------------------------------------------------- real image trees
def missing_root(test_set: TestSet, key: str) -> UserError:
    return UserError(f"{test_set.title} has no images: set {key}=/path/to/it (published at "
                     f"{test_set.published})")


def folder_class(name: str, wnids: dict[str, int]) -> int | None:
    """A class folder's ImageNet-1k index: a WordNet id (ImageNet, -A, -R, -Sketch) or the index itself
    (ImageNetV2's folders ``0`` ... ``999``)."""
    return int(name) if name.isdigit() else wnids.get(name)


def labelled_files(test_set: TestSet, root: Path, labels_file: str | None) -> list[tuple[str, list[int]]]:
    """Every image under ``root`` with its ImageNet-1k labels; a root of the wrong classes is one line."""
    if test_set.real_labels:
        labels = real_labels(labels_file)
        files = image_files(root, set())
        unknown = next((f for f in files if Path(f).name not in labels), None)
        if unknown is not None:
            raise UserError(f"{test_set.title}: '{unknown}' is not an ImageNet validation image named in the "
                            "ReaL labels (ILSVRC2012_val_<8 digits>.JPEG)")
        return [(f, labels[Path(f).name]) for f in files]
    expected = subset_classes(test_set) or list(range(IMAGENET_CLASSES))
    folders = class_folders(root)
    if len(folders) != len(expected):
        raise UserError(f"{test_set.title} root '{root}' has {len(folders)} class folders, {test_set.title} "
                        f"has {len(expected)}: point it at the release's top folder ({test_set.published})")
    wnids = {wnid: i for i, wnid in enumerate(timm_info("imagenet_synsets.txt").split())}
    found = [folder_class(name, wnids) for name in folders]
    foreign = next((name for name, index in zip(folders, found, strict=True) if index not in expected), None)
    if foreign is not None:
        which = f"timm's {test_set.class_file}" if test_set.class_file else "a WordNet id or an index 0-999"
        raise UserError(f"{test_set.title} root '{root}': class folder '{foreign}' is not one of its "
                        f"{len(expected)} classes ({which})")
    return [(f, [index]) for name, index in zip(folders, found, strict=True)
            for f in image_files(root / name, set())]


class LabelledImages(Dataset):
    """Image files and their labels, through ``transform``; unreadable ones follow ``data.on_bad_image``."""

    def __init__(self, samples: list[tuple[str, list[int]]], transform: Any, num_classes: int,
                 on_bad_image: str, where: Path) -> None:
        self.samples, self.transform, self.num_classes = samples, transform, num_classes
        self.bad = BadImages([f for f, _ in samples], on_bad_image, where)

    def __len__(self) -> int:
        return len(self.samples)

    def _load(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        path, labels = self.samples[i]
        target = torch.zeros(self.num_classes, dtype=torch.bool)
        target[labels] = True
        return self.transform(load_rgb(path)), target

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self.bad.read(i, self._load, replace=False)

    def bad_files(self) -> list[str]:
        return self.bad.bad_files()


def check_imagenet_test_set(name: str, root: str | None, key: str, labels_file: str | None) -> None:
    """Refuse a missing root, or one of the wrong classes, in one line before any work."""
    test_set = TEST_SETS[name]
    if not root:
        raise missing_root(test_set, key)
    if not Path(root).is_dir():
        raise UserError(f"{test_set.title} root '{root}' ({key}) does not exist (published at "
                        f"{test_set.published})")
    if not labelled_files(test_set, Path(root), labels_file):
        raise UserError(f"{test_set.title} root '{root}' holds no images")


def imagenet_test_set(name: str, root: str, labels_file: str | None, data_cfg: Any) -> LoadedTestSet:
    test_set = TEST_SETS[name]
    samples = labelled_files(test_set, Path(root), labels_file)
    images = LabelledImages(samples, build_transforms(data_cfg, is_training=False), data_cfg.num_classes,
                            data_cfg.get("on_bad_image", "skip"), Path(root))
    return LoadedTestSet(test_set, images, subset_classes(test_set), str(root), stand_in=False)


# ---------------------------------------------------------------- the digits' stand-ins
ODD, EVEN = [1, 3, 5, 7, 9], [0, 2, 4, 6, 8]
DIGITS_STAND_INS = {  # name -> (what stands in, its classes)
    "imagenet_real": ("label sets: each digit's own, plus the next digit for every third image, none for "
                      "every tenth (left out, as ReaL's unlabelled images)", None),
    "imagenet_v2": ("the validation digits shifted by one pixel right and down", None),
    "imagenet_a": ("the odd validation digits with Gaussian noise (std 0.3, seed 0), logits restricted to "
                   "the odd classes", ODD),
    "imagenet_r": ("the even validation digits inverted, logits restricted to the even classes", EVEN),
    "imagenet_sketch": ("the validation digits binarised at half intensity (strokes only)", None),
}


def digits_stand_in(name: str, data_cfg: Any) -> LoadedTestSet:
    """A stand-in for test set ``name`` made from the digits' validation images (for tests and the demo)."""
    arrays = digits_arrays(data_cfg.img_size, data_cfg.val_fraction, data_cfg.split_seed)
    mean, std = standardisation(arrays)
    images = torch.from_numpy(arrays["val_images"])
    labels = torch.from_numpy(arrays["val_labels"]).long()
    described, classes = DIGITS_STAND_INS[name]
    if classes is not None:
        keep = torch.isin(labels, torch.tensor(classes))
        images, labels = images[keep], labels[keep]
    targets = torch.nn.functional.one_hot(labels, data_cfg.num_classes).bool()
    if name == "imagenet_real":
        index = torch.arange(len(labels))
        targets[index % 3 == 1, (labels[index % 3 == 1] + 1) % data_cfg.num_classes] = True
        targets[index % 10 == 0] = False
    elif name == "imagenet_v2":
        images = torch.nn.functional.pad(images, (1, 0, 1, 0))[:, :-1, :-1]
    elif name == "imagenet_a":
        noise = torch.randn(images.shape, generator=torch.Generator().manual_seed(0))
        images = (images + 0.3 * noise).clamp(0, 1)
    elif name == "imagenet_r":
        images = 1 - images
    else:
        images = (images > 0.5).float()
    x = ((images - mean) / std)[:, None].expand(-1, 3, -1, -1).contiguous()
    return LoadedTestSet(TEST_SETS[name], TensorDataset(x, targets), classes, f"stand-in: {described}",
                         stand_in=True)
