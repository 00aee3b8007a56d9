"""The order in which samples are seen: the same global batches whatever the number of processes.

``ShardedSampler`` makes one epoch's order from ``(seed, epoch)`` alone -- a permutation of the dataset
(training) or the dataset in order (evaluation) -- and deals it out round-robin: process r of W takes
positions r, r + W, r + 2W, ... So the k-th batch of b samples on every process together hold exactly
positions [k*b*W, (k+1)*b*W) of the epoch's order: one global batch of b*W, as one process with batch b*W
would see it. Training cuts the order to whole global updates (``drop_last``); evaluation keeps every
sample exactly once (no padding, unlike ``DistributedSampler``), so summed counts are exact.

Repeated augmentation (Hoffer et al. 2020; the DeiT recipe's ``RASampler``, timm's ``RepeatAugSampler``):
``repeats=3`` repeats each index of the permutation 3 times in a row -- the copies land on neighbouring
processes, each with its own augmentation -- and keeps the epoch at ``len(dataset) // 256 * 256`` samples
(as timm does), so an epoch costs what it did without repeats.

Because an epoch's order is a function of (seed, epoch), resuming mid-epoch needs only the epoch and the
number of batches already taken (``set_epoch(epoch, start_batch)``). With ``keyed=True`` it deals
``(index, sample_seed)`` pairs, the seed a function of (seed, epoch, position in the epoch's order): loader
workers seed each sample's augmentation with it (``loaders.SeededSamples``), so the augmentation of a
sample does not depend on which worker drew it or on how much of its stream that worker used before.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import Sampler


class ShardedSampler(Sampler[int]):
    def __init__(self, num_samples: int, *, shuffle: bool, seed: int, rank: int = 0, world_size: int = 1,
                 batch_size: int = 1, drop_last: bool = False, repeats: int = 1,
                 update_multiple: int = 1, keyed: bool = False) -> None:
        """``batch_size`` is per process; ``update_multiple`` (gradient accumulation) makes training epochs
        whole multiples of ``batch_size * world_size * update_multiple`` samples; ``keyed``: deal
        ``(index, sample_seed)`` pairs."""
        if repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {repeats}")
        self.num_samples, self.shuffle, self.seed = num_samples, shuffle, seed
        self.rank, self.world_size, self.batch_size = rank, world_size, batch_size
        self.drop_last, self.repeats, self.update_multiple = drop_last, repeats, update_multiple
        self.keyed = keyed
        self.epoch, self.start_batch = 0, 0

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        """The epoch to deal, and how many of this process's batches of it were already taken."""
        self.epoch, self.start_batch = epoch, start_batch

    @property
    def epoch_length(self) -> int:
        """Samples in one epoch, over all processes."""
        length = self.num_samples
        if self.repeats > 1:
            length = min(length * self.repeats, self.num_samples // 256 * 256 or self.num_samples)
        if self.drop_last:
            unit = self.batch_size * self.world_size * self.update_multiple
            length = length // unit * unit
        return length

    def epoch_order(self) -> torch.Tensor:
        """The global order of this epoch's samples, before dealing."""
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
            order = torch.randperm(self.num_samples, generator=generator)
        else:
            order = torch.arange(self.num_samples)
        if self.repeats > 1:
            order = order.repeat_interleave(self.repeats)
        return order[: self.epoch_length]

    def __iter__(self) -> Iterator[int] | Iterator[tuple[int, int]]:
        first = self.start_batch * self.batch_size
        mine = self.epoch_order()[self.rank::self.world_size][first:].tolist()
        if not self.keyed:
            return iter(mine)
        # position p of this process's share is position rank + p * world_size of the epoch's order
        base = ((self.seed * 1_000_003 + self.epoch) * 1_000_033) % 2**62
        positions = range(self.rank + first * self.world_size, 2**62, self.world_size)
        return iter([(index, base + position) for index, position in zip(mine, positions, strict=False)])

    def __len__(self) -> int:
        mine = (self.epoch_length - self.rank + self.world_size - 1) // self.world_size
        return max(mine - self.start_batch * self.batch_size, 0)
