"""Image transforms of the recipes: timm's ``create_transform`` (DeiT's pipelines), with timm's RandAugment
``posterize`` repaired for 0 bits (the ``inc1`` schedule asks for it; Pillow 13 refuses it, Pillow <= 12,
which the recipes trained with, gave a black image)."""

from __future__ import annotations

from typing import Any

from PIL import Image, ImageOps
from timm.data import auto_augment, create_transform


def posterize(img: Image.Image, bits_to_keep: int, **_: Any) -> Image.Image:
    """Keep the ``bits_to_keep`` most significant bits of each channel; 0 bits is a black image."""
    if bits_to_keep >= 8:
        return img
    if bits_to_keep <= 0:
        return Image.new(img.mode, img.size)  # all bits cleared: black, as Pillow <= 12 returned
    return ImageOps.posterize(img, bits_to_keep)


for _name in ("Posterize", "PosterizeIncreasing", "PosterizeOriginal"):
    auto_augment.NAME_TO_OP[_name] = posterize


def build_transforms(cfg: Any, is_training: bool) -> Any:
    """A data config's training (RandAugment, colour jitter, random erasing ...) or evaluation pipeline."""
    if is_training:
        return create_transform(
            input_size=cfg.img_size, is_training=True, auto_augment=cfg.auto_augment,
            color_jitter=cfg.color_jitter, interpolation=cfg.get("train_interpolation") or cfg.interpolation,
            re_prob=cfg.reprob,
            re_mode=cfg.remode, re_count=cfg.recount, mean=tuple(cfg.mean), std=tuple(cfg.std),
        )
    return create_transform(
        input_size=cfg.img_size, is_training=False, interpolation=cfg.interpolation,
        crop_pct=cfg.crop_pct, mean=tuple(cfg.mean), std=tuple(cfg.std),
    )
