"""What every data module returns, and seeded loader construction."""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset


@dataclass
class ClassificationData:
    train: DataLoader
    val: DataLoader
    num_classes: int
    img_size: int
    in_chans: int


def default_cache_dir(kind: str) -> Path:
    """Where generated data is kept: $NORMEXP_CACHE_DIR, else <outputs>/<kind>. Read from the environment,
    not the config, so that where a cache lives never changes a run's identity."""
    if os.environ.get("NORMEXP_CACHE_DIR"):
        return Path(os.environ["NORMEXP_CACHE_DIR"])
    return Path(os.environ.get("NORMEXP_OUTPUT_DIR", "outputs")) / kind


def seed_worker(worker_id: int) -> None:
    """Seed python and numpy in each loader worker from torch's per-worker seed."""
    seed = torch.initial_seed() % 2**32
    np.random.seed(seed)
    random.seed(seed)


def make_loader(dataset: Dataset, batch_size: int, train: bool, num_workers: int, seed: int,
                pin_memory: bool = False, collate_fn: Callable | None = None) -> DataLoader:
    """A loader whose shuffling and worker seeds follow ``seed`` (train: shuffled, full batches)."""
    generator = torch.Generator().manual_seed(seed)
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=train,
        drop_last=train,
        num_workers=num_workers,
        pin_memory=pin_memory,
        worker_init_fn=seed_worker,
        generator=generator,
        persistent_workers=num_workers > 0,
        collate_fn=collate_fn,
    )
