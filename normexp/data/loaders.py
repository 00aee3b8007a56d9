"""What every data module returns, and seeded loader construction."""

from __future__ import annotations

import os
import random
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from .. import distributed
from ..tracking.provenance import stream_seed
from .samplers import ShardedSampler


@dataclass
class ClassificationData:
    """A labelled image data set's loaders; ``train_eval``: the training images through the eval transform."""

    train: DataLoader
    val: DataLoader
    num_classes: int
    img_size: int
    in_chans: int
    train_eval: DataLoader | None = None


@dataclass(frozen=True)
class ImageSpec:
    """What a task's training transform needs of a data set: image size, mean and std; the transform takes
    a PIL image or a (3, H, W) tensor in [0, 1]."""

    img_size: int
    mean: tuple[float, ...]
    std: tuple[float, ...]


TrainTransform = Callable[[ImageSpec], Callable[[Any], Any]]


class TransformedImages(Dataset):
    """(image, label) pairs of in-memory images, each image through ``transform`` when it is read."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, transform: Callable[[Any], Any]) -> None:
        self.images, self.labels, self.transform = images, labels, transform

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[Any, torch.Tensor]:
        return self.transform(self.images[index]), self.labels[index]


def stratified_subset(labels: Sequence[int] | np.ndarray, fraction: float, seed: int) -> np.ndarray:
    """``data.train_fraction``: the indices (ascending) of a seeded share ``fraction`` of each class --
    ``round(fraction x its count)``, at least one image -- so the subset keeps the classes' proportions."""
    labels = np.asarray(labels)
    if fraction >= 1:
        return np.arange(len(labels))
    generator = np.random.default_rng(seed)
    kept = [generator.permutation(members)[:max(1, round(fraction * len(members)))]
            for members in (np.flatnonzero(labels == c) for c in np.unique(labels))]
    return np.sort(np.concatenate(kept))


def default_cache_dir(kind: str) -> Path:
    """$NORMEXP_CACHE_DIR, else <outputs>/<kind> (not in the config: a cache never changes a run's
    identity)."""
    if os.environ.get("NORMEXP_CACHE_DIR"):
        return Path(os.environ["NORMEXP_CACHE_DIR"])
    return Path(os.environ.get("NORMEXP_OUTPUT_DIR", "outputs")) / kind


def seed_worker(worker_id: int) -> None:
    """Seed python and numpy in each loader worker; leave Ctrl-C to the main process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    seed = torch.initial_seed() % 2**32
    np.random.seed(seed)
    random.seed(seed)


class SeededSamples(Dataset):
    """A training set whose samples are seeded by a keyed :class:`ShardedSampler`'s ``sample_seed``, so an
    augmentation never depends on the worker (and a resumed run sees the same pixels)."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, key: tuple[int, int]) -> object:
        index, sample_seed = key
        torch.manual_seed(sample_seed)
        np.random.seed(sample_seed % 2**32)
        random.seed(sample_seed)
        return self.dataset[index]

    def __getattr__(self, name: str) -> object:  # the wrapped dataset's own attributes (bad_files, ...)
        if name == "dataset":  # not set yet (unpickling in a worker)
            raise AttributeError(name)
        return getattr(self.dataset, name)


def make_loader(dataset: Dataset, batch_size: int, train: bool, num_workers: int, seed: int,
                pin_memory: bool = False, collate_fn: Callable | None = None, repeats: int = 1) -> DataLoader:
    """This process's loader of ``dataset`` (train: shuffled, whole global batches; eval: each sample once),
    ``batch_size`` per process; call :func:`set_epoch` before each epoch."""
    world = distributed.info()
    keyed = train and num_workers > 0
    sampler = ShardedSampler(len(dataset), shuffle=train, seed=seed, rank=world.rank,
                             world_size=world.world_size, batch_size=batch_size, drop_last=train,
                             repeats=repeats if train else 1, keyed=keyed)
    if keyed:
        dataset = SeededSamples(dataset)
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        num_workers=num_workers,
        pin_memory=pin_memory,
        worker_init_fn=seed_worker,
        generator=torch.Generator().manual_seed(seed),
        persistent_workers=num_workers > 0,
        collate_fn=collate_fn,
    )


def set_epoch(loader: DataLoader, epoch: int, start_batch: int = 0) -> None:
    """Deal ``epoch`` from its ``start_batch``-th batch on, with worker seeds following (seed, rank,
    epoch)."""
    sampler = loader.sampler
    if isinstance(sampler, ShardedSampler):
        sampler.set_epoch(epoch, start_batch)
        if loader.generator is not None:
            loader.generator.manual_seed(stream_seed(sampler.seed, epoch, sampler.rank))
