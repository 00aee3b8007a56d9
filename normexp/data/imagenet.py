"""ImageNet in the standard ImageFolder layout with the DeiT transforms built by timm.

Expected layout: ``<root>/train/<wnid>/*.JPEG`` and ``<root>/val/<wnid>/*.JPEG`` (the validation images
sorted into class folders, as the usual ``valprep.sh`` does).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.data import DataLoader, default_collate
from torchvision.datasets import ImageFolder
from torchvision.datasets.folder import IMG_EXTENSIONS

from ..errors import UserError
from .images import BadImages, class_folders, folder_key, image_files, load_rgb
from .loaders import ClassificationData, ImageSpec, TrainTransform, make_loader, stratified_subset
from .transforms import build_transforms

LAYOUT = "<root>/train/<wnid>/*.JPEG and <root>/val/<wnid>/*.JPEG"


def check_imagefolder_root(root: str | None, splits: tuple[str, ...], num_classes: int) -> None:
    """Fail with one clear line unless ``root`` holds every split as class folders with images."""
    if not root:
        raise UserError("data.root is not set: pass data.root=/path/to/imagenet or set NORMEXP_IMAGENET_ROOT "
                        f"(expected layout {LAYOUT})")
    root_path = Path(root)
    if not root_path.is_dir():
        raise UserError(f"ImageNet root '{root}' does not exist: expected layout {LAYOUT}")
    class_sets = {}
    for split in splits:
        split_dir = root_path / split
        if not split_dir.is_dir():
            raise UserError(f"ImageNet root '{root}' has no '{split}/' folder: expected layout {LAYOUT}")
        classes = class_folders(split_dir)
        if not classes:
            raise UserError(f"'{split_dir}' holds no class folders: expected layout {LAYOUT}")
        empty = next((c for c in classes if not any(
            f.suffix.lower() in IMG_EXTENSIONS for f in (split_dir / c).iterdir())), None)
        if empty is not None:
            raise UserError(f"class folder '{split_dir / empty}' holds no images: expected layout {LAYOUT}")
        class_sets[split] = classes
    first, *rest = splits
    for split in rest:
        if class_sets[split] != class_sets[first]:
            raise UserError(f"'{root}/{split}' and '{root}/{first}' have different class folders")
    if len(class_sets[first]) != num_classes:
        raise UserError(f"found {len(class_sets[first])} classes in '{root}/{first}' but data.num_classes="
                        f"{num_classes}; set data.num_classes={len(class_sets[first])}")


class SafeImageFolder(ImageFolder):
    """ImageFolder for real trees: unreadable files under ``data.on_bad_image`` (:class:`BadImages`; in
    training (``replace=True``) one is replaced by the next readable image, as timm's ``ImageDataset`` does,
    so every batch keeps its size -- Mixup / CutMix need an even one, and the processes of a job the same;
    in evaluation it is left out of its batch, so every image is counted at most once), 16-bit images
    scaled, and symbolic links followed once each (:func:`image_files`)."""

    def __init__(self, root: Path, transform: Any, on_bad_image: str, replace: bool = False,
                 keep: Callable[[list[int]], np.ndarray] | None = None) -> None:
        super().__init__(root, transform=transform, loader=load_rgb)
        if keep is not None:  # a subset of the images (data.train_fraction), chosen from their labels
            self.samples = self.imgs = [self.samples[i] for i in keep(self.targets)]
            self.targets = [label for _, label in self.samples]
        self.replace = replace
        self.bad = BadImages([path for path, _ in self.samples], on_bad_image, root)

    def find_classes(self, directory: str | Path) -> tuple[list[str], dict[str, int]]:
        classes = class_folders(Path(directory))
        return classes, {name: i for i, name in enumerate(classes)}

    @staticmethod
    def make_dataset(directory: str | Path, class_to_idx: dict[str, int], extensions: Any = None,
                     is_valid_file: Any = None, allow_empty: bool = False) -> list[tuple[str, int]]:
        directory = Path(directory)
        seen = {folder_key(directory), *(folder_key(directory / c) for c in class_to_idx)}  # shared: no
        return [(path, index) for name, index in sorted(class_to_idx.items(), key=lambda item: item[1])
                for path in image_files(directory / name, seen)]  # folder is listed under two labels

    def __getitem__(self, index: int) -> tuple[Any, int] | None:
        return self.bad.read(index, super().__getitem__, self.replace)

    def bad_files(self) -> list[str]:
        return self.bad.bad_files()


def collate_readable(batch: list[Any]) -> Any:
    """The default collate of the samples that could be read (evaluation batches); None when none could."""
    readable = [sample for sample in batch if sample is not None]
    return default_collate(readable) if readable else None


def build_imagenet(cfg, seed: int, train_transform: TrainTransform | None = None, eval_train: bool = False,
                   eval_transform: TrainTransform | None = None) -> ClassificationData:
    """ImageNet's loaders (the training folder's ``data.train_fraction``, seeded by ``seed``);
    ``train_transform`` / ``eval_transform``: a task's own (they get PIL images), else DeiT's."""
    check_imagefolder_root(cfg.root, (cfg.train_split, cfg.val_split), cfg.num_classes)
    root = Path(cfg.root)
    on_bad = cfg.get("on_bad_image", "skip")
    spec = ImageSpec(cfg.img_size, tuple(cfg.mean), tuple(cfg.std))
    training = build_transforms(cfg, is_training=True) if train_transform is None else train_transform(spec)
    evaluation = build_transforms(cfg, is_training=False) if eval_transform is None else eval_transform(spec)
    def subset(labels: list[int]) -> np.ndarray:
        return stratified_subset(labels, cfg.train_fraction, seed)

    train = SafeImageFolder(root / cfg.train_split, training, on_bad, replace=True, keep=subset)
    val = SafeImageFolder(root / cfg.val_split, evaluation, on_bad)
    pin = cfg.get("pin_memory", True)

    def evaluation_loader(dataset: SafeImageFolder) -> DataLoader:
        return make_loader(dataset, cfg.eval_batch_size, False, cfg.num_workers, seed, pin_memory=pin,
                           collate_fn=collate_readable)

    return ClassificationData(
        train=make_loader(train, cfg.batch_size, True, cfg.num_workers, seed, pin_memory=pin,
                          repeats=max(cfg.get("aug_repeats") or 1, 1)),
        val=evaluation_loader(val),
        num_classes=cfg.num_classes,
        img_size=cfg.img_size,
        in_chans=3,
        train_eval=evaluation_loader(SafeImageFolder(root / cfg.train_split, evaluation, on_bad, keep=subset))
        if eval_train else None,
    )
