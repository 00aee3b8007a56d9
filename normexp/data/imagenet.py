"""ImageNet in the standard ImageFolder layout with the DeiT transforms built by timm.

Expected layout: ``<root>/train/<wnid>/*.JPEG`` and ``<root>/val/<wnid>/*.JPEG`` (the validation images
sorted into class folders, as the usual ``valprep.sh`` does).
"""

from __future__ import annotations

from pathlib import Path

from timm.data import create_transform
from torchvision.datasets import ImageFolder
from torchvision.datasets.folder import IMG_EXTENSIONS

from ..errors import UserError
from .loaders import ClassificationData, make_loader

LAYOUT = "<root>/train/<wnid>/*.JPEG and <root>/val/<wnid>/*.JPEG"


def check_imagefolder_root(root: str | None, splits: tuple[str, ...], num_classes: int) -> None:
    """Fail with one clear line unless ``root`` holds every split as class folders with images."""
    if not root:
        raise UserError(f"data.root is not set: pass data.root=/path/to/imagenet (expected layout {LAYOUT})")
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


def build_transforms(cfg, is_training: bool):
    if is_training:
        return create_transform(
            input_size=cfg.img_size, is_training=True, auto_augment=cfg.auto_augment,
            color_jitter=cfg.color_jitter, interpolation=cfg.interpolation, re_prob=cfg.reprob,
            re_mode=cfg.remode, re_count=cfg.recount, mean=tuple(cfg.mean), std=tuple(cfg.std),
        )
    return create_transform(
        input_size=cfg.img_size, is_training=False, interpolation=cfg.interpolation,
        crop_pct=cfg.crop_pct, mean=tuple(cfg.mean), std=tuple(cfg.std),
    )


def build_imagenet(cfg, seed: int) -> ClassificationData:
    check_imagefolder_root(cfg.root, (cfg.train_split, cfg.val_split), cfg.num_classes)
    root = Path(cfg.root)
    train = ImageFolder(root / cfg.train_split, transform=build_transforms(cfg, is_training=True))
    val = ImageFolder(root / cfg.val_split, transform=build_transforms(cfg, is_training=False))
    pin = cfg.get("pin_memory", True)
    return ClassificationData(
        train=make_loader(train, cfg.batch_size, True, cfg.num_workers, seed, pin_memory=pin),
        val=make_loader(val, cfg.eval_batch_size, False, cfg.num_workers, seed, pin_memory=pin),
        num_classes=cfg.num_classes,
        img_size=cfg.img_size,
        in_chans=3,
    )
