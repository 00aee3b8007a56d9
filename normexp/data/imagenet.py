"""ImageNet in the standard ImageFolder layout with the DeiT transforms built by timm.

Expected layout: ``<root>/train/<wnid>/*.JPEG`` and ``<root>/val/<wnid>/*.JPEG`` (the validation images
sorted into class folders, as the usual ``valprep.sh`` does).
"""

from __future__ import annotations

import logging
import multiprocessing
from pathlib import Path
from typing import Any

from torch.utils.data import default_collate
from torchvision.datasets import ImageFolder
from torchvision.datasets.folder import IMG_EXTENSIONS

from ..errors import UserError
from .loaders import ClassificationData, make_loader
from .transforms import build_transforms

log = logging.getLogger(__name__)

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
        classes = sorted(d.name for d in split_dir.iterdir() if d.is_dir())
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
    """ImageFolder that survives unreadable files (real ImageNet trees hold a few corrupt or mislabeled-format
    files). ``skip``: each unreadable file is marked (in memory shared with the loader workers, so every
    process's count is exact) and, in training (``replace=True``), replaced by the next readable image of
    the folder -- as timm's ``ImageDataset`` does -- so every batch keeps its size (Mixup / CutMix need an
    even one, and the processes of a job the same); in evaluation it is left out of its batch, so every
    image is counted at most once. ``fail`` stops with one line naming the file."""

    def __init__(self, root: Path, transform: Any, on_bad_image: str, replace: bool = False) -> None:
        super().__init__(root, transform=transform)
        self.on_bad_image, self.replace = on_bad_image, replace
        self.bad = multiprocessing.Array("b", len(self.samples), lock=False)  # 1: this file could not be read

    def __getitem__(self, index: int) -> tuple[Any, int] | None:
        for offset in range(len(self.samples)):
            i = (index + offset) % len(self.samples)
            try:
                return super().__getitem__(i)
            except (OSError, SyntaxError, ValueError) as e:  # truncated, not an image, bad header
                path = self.samples[i][0]
                if self.on_bad_image == "fail":
                    raise UserError(f"cannot read image '{path}' ({type(e).__name__}: {e}): remove or "
                                    "replace it, or skip unreadable images: data.on_bad_image=skip") from None
                if not self.bad[i]:
                    log.warning("skipping unreadable image %s (%s: %s)", path, type(e).__name__, e)
                self.bad[i] = 1
                if not self.replace:
                    return None
        raise UserError(f"none of the {len(self.samples)} images under '{self.root}' can be read")

    def bad_files(self) -> list[str]:
        return [self.samples[i][0] for i, flag in enumerate(self.bad) if flag]


def collate_readable(batch: list[Any]) -> Any:
    """The default collate of the samples that could be read (evaluation batches)."""
    readable = [sample for sample in batch if sample is not None]
    if not readable:
        raise UserError(f"none of the {len(batch)} images of a batch could be read: check the dataset "
                        "(the log names each unreadable file)")
    return default_collate(readable)


def build_imagenet(cfg, seed: int) -> ClassificationData:
    check_imagefolder_root(cfg.root, (cfg.train_split, cfg.val_split), cfg.num_classes)
    root = Path(cfg.root)
    on_bad = cfg.get("on_bad_image", "skip")
    train = SafeImageFolder(root / cfg.train_split, build_transforms(cfg, is_training=True), on_bad,
                            replace=True)
    val = SafeImageFolder(root / cfg.val_split, build_transforms(cfg, is_training=False), on_bad)
    pin = cfg.get("pin_memory", True)
    return ClassificationData(
        train=make_loader(train, cfg.batch_size, True, cfg.num_workers, seed, pin_memory=pin,
                          repeats=max(cfg.get("aug_repeats") or 1, 1)),
        val=make_loader(val, cfg.eval_batch_size, False, cfg.num_workers, seed, pin_memory=pin,
                        collate_fn=collate_readable),
        num_classes=cfg.num_classes,
        img_size=cfg.img_size,
        in_chans=3,
    )
