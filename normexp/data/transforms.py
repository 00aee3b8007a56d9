"""Image transforms of the recipes: timm's ``create_transform`` (DeiT's pipelines), with timm's RandAugment
``posterize`` repaired for 0 bits (the ``inc1`` schedule asks for it; Pillow 13 refuses it, Pillow <= 12,
which the recipes trained with, gave a black image), and the training crop drawn as torchvision draws it or,
``crop_sampler: tf``, as TensorFlow does (MAE's linear probe)."""

from __future__ import annotations

import math
from typing import Any

import torch
from PIL import Image, ImageOps
from timm.data import auto_augment, create_transform
from timm.data.transforms import RandomResizedCropAndInterpolation
from torchvision.transforms.functional import get_image_size


def posterize(img: Image.Image, bits_to_keep: int, **_: Any) -> Image.Image:
    """Keep the ``bits_to_keep`` most significant bits of each channel; 0 bits is a black image."""
    if bits_to_keep >= 8:
        return img
    if bits_to_keep <= 0:
        return Image.new(img.mode, img.size)  # all bits cleared: black, as Pillow <= 12 returned
    return ImageOps.posterize(img, bits_to_keep)


for _name in ("Posterize", "PosterizeIncreasing", "PosterizeOriginal"):
    auto_augment.NAME_TO_OP[_name] = posterize


class TFRandomResizedCrop(RandomResizedCropAndInterpolation):
    """timm's random resized crop, its box drawn as TensorFlow's (BYOL's) ``distorted_bounding_box_crop`` and
    MAE's ``util/crop.py`` draw it: one area share and one log aspect ratio, the box clamped to the image, no
    retries and no centre-crop fallback (torchvision's ``get_params`` tries 10 boxes that fit, then crops
    the centre)."""

    @staticmethod
    def get_params(img: Any, scale: tuple[float, float], ratio: tuple[float, float]) -> tuple[int, ...]:
        width, height = get_image_size(img)
        area = width * height * torch.empty(1).uniform_(scale[0], scale[1]).item()
        aspect = math.exp(torch.empty(1).uniform_(math.log(ratio[0]), math.log(ratio[1])).item())
        w = min(int(round(math.sqrt(area * aspect))), width)
        h = min(int(round(math.sqrt(area / aspect))), height)
        i = int(torch.randint(0, height - h + 1, size=(1,)).item())
        j = int(torch.randint(0, width - w + 1, size=(1,)).item())
        return i, j, h, w


def build_transforms(cfg: Any, is_training: bool) -> Any:
    """A data config's training (RandAugment, colour jitter, random erasing ...) or evaluation pipeline."""
    if is_training:
        pipeline = create_transform(
            input_size=cfg.img_size, is_training=True, auto_augment=cfg.auto_augment,
            color_jitter=cfg.color_jitter, interpolation=cfg.get("train_interpolation") or cfg.interpolation,
            re_prob=cfg.reprob,
            re_mode=cfg.remode, re_count=cfg.recount, mean=tuple(cfg.mean), std=tuple(cfg.std),
        )
        if cfg.get("crop_sampler", "torchvision") == "tf":
            crop = pipeline.transforms[0]
            if not isinstance(crop, RandomResizedCropAndInterpolation):
                raise ValueError(f"data.crop_sampler=tf replaces timm's random resized crop, not {crop}")
            tf_crop = TFRandomResizedCrop(crop.size, scale=crop.scale, ratio=crop.ratio)
            tf_crop.interpolation = crop.interpolation
            pipeline.transforms[0] = tf_crop
        return pipeline
    return create_transform(
        input_size=cfg.img_size, is_training=False, interpolation=cfg.interpolation,
        crop_pct=cfg.crop_pct, mean=tuple(cfg.mean), std=tuple(cfg.std),
    )
