"""The embedded default: scikit-learn's 1,797 real 8x8 handwritten digits, no network needed.

Images are upscaled (bilinear) to ``img_size``, replicated to 3 channels so every model and corruption
sees RGB like ImageNet, and standardised with the train split's mean/std. The train/val split is
stratified and fixed by ``split_seed`` (independent of the run seed), so every run validates on the same
images.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, TensorDataset

from .loaders import (
    ClassificationData,
    ImageSpec,
    TrainTransform,
    TransformedImages,
    make_loader,
    stratified_subset,
)

NUM_CLASSES = 10


def digits_arrays(img_size: int, val_fraction: float, split_seed: int) -> dict[str, np.ndarray]:
    """Raw digit images in [0, 1], shape (N, img_size, img_size), labels and ids (index in the full set)."""
    from sklearn.datasets import load_digits  # here: importing scikit-learn costs every command 2 s
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = torch.from_numpy(digits.images.astype(np.float32) / 16.0)[:, None]
    images = F.interpolate(images, size=(img_size, img_size), mode="bilinear", align_corners=False)
    images = images.clamp_(0, 1)[:, 0].numpy()
    idx_train, idx_val = train_test_split(
        np.arange(len(images)), test_size=val_fraction, random_state=split_seed, stratify=digits.target
    )
    return {
        "train_images": images[idx_train], "train_labels": digits.target[idx_train],
        "val_images": images[idx_val], "val_labels": digits.target[idx_val],
        "train_ids": idx_train, "val_ids": idx_val,
    }


def standardisation(arrays: dict[str, np.ndarray]) -> tuple[float, float]:
    """The train split's pixel mean and std: what every digits model input is standardised with."""
    return float(arrays["train_images"].mean()), float(arrays["train_images"].std())


def build_digits(cfg, seed: int, train_transform: TrainTransform | None = None, eval_train: bool = False,
                 eval_transform: TrainTransform | None = None) -> ClassificationData:
    """The digits' loaders (the training split's ``data.train_fraction``, seeded by ``seed``);
    ``train_transform`` / ``eval_transform``: a task's own (they get the images in [0, 1], 3 channels), else
    the images standardised and nothing else."""
    arrays = digits_arrays(cfg.img_size, cfg.val_fraction, cfg.split_seed)
    mean, std = standardisation(arrays)  # the whole split's: a subset changes the images seen, not the inputs
    keep = stratified_subset(arrays["train_labels"], cfg.train_fraction, seed)
    arrays.update({f"train_{key}": arrays[f"train_{key}"][keep] for key in ("images", "labels", "ids")})
    spec = ImageSpec(cfg.img_size, (mean,) * 3, (std,) * 3)

    def dataset(split: str, transform: TrainTransform | None) -> Dataset:
        labels = torch.from_numpy(arrays[f"{split}_labels"]).long()
        if transform is not None:
            images = torch.from_numpy(arrays[f"{split}_images"])[:, None].expand(-1, 3, -1, -1).contiguous()
            return TransformedImages(images, labels, transform(spec))
        x = torch.from_numpy((arrays[f"{split}_images"] - mean) / std)[:, None].expand(-1, 3, -1, -1)
        return TensorDataset(x.contiguous(), labels)

    train = dataset("train", train_transform)
    return ClassificationData(
        train=make_loader(train, cfg.batch_size, True, cfg.num_workers, seed),
        val=make_loader(dataset("val", eval_transform), cfg.eval_batch_size, False, cfg.num_workers, seed),
        num_classes=NUM_CLASSES,
        img_size=cfg.img_size,
        in_chans=3,
        train_eval=make_loader(dataset("train", eval_transform), cfg.eval_batch_size, False, cfg.num_workers,
                               seed)
        if eval_train else None,
    )
