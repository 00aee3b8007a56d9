"""Loader workers: a sample's augmentation depends on (seed, epoch, position) alone, so a resumed run sees
the pixels an uninterrupted one sees."""

from __future__ import annotations

import random

import numpy as np
import torch
from torch.utils.data import Dataset

from normexp.data.loaders import make_loader, set_epoch


class RandomAugment(Dataset):
    """Sample i is i plus one draw from each RNG an augmentation may use (torch, numpy, python)."""

    def __len__(self) -> int:
        return 24

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([index, torch.rand(()).item(), np.random.rand(), random.random()])


def epoch_batches(loader, epoch: int, start_batch: int = 0) -> list[torch.Tensor]:
    set_epoch(loader, epoch, start_batch)
    return list(loader)


def test_workers_resumed_mid_epoch_see_the_same_augmentation():
    first = make_loader(RandomAugment(), batch_size=4, train=True, num_workers=2, seed=3, repeats=2)
    uninterrupted = [epoch_batches(first, epoch) for epoch in range(2)]  # persistent workers go on
    resumed = make_loader(RandomAugment(), batch_size=4, train=True, num_workers=2, seed=3, repeats=2)
    tail = epoch_batches(resumed, 1, start_batch=2)  # fresh workers, their streams at the start
    assert len(tail) == len(uninterrupted[1]) - 2
    for a, b in zip(uninterrupted[1][2:], tail, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # every sample, each repeat of it included, got its own draws
    draws = torch.cat(uninterrupted[0])[:, 1:]
    assert len(set(draws[:, 0].tolist())) == len(draws)
    # in the main process the augmentation draws from the process's RNG (which checkpoints hold)
    assert not hasattr(make_loader(RandomAugment(), 4, True, 0, seed=3).dataset, "dataset")
