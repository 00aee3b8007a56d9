"""The order in which samples are seen: the same global batches whatever the number of processes.

``ShardedSampler`` makes an epoch's order from ``(seed, epoch)`` and deals it round-robin over processes, so
the k-th batches of all processes form the k-th global batch; evaluation keeps every sample exactly once
(no padding). ``repeats`` is repeated augmentation (Hoffer et al. 2020; DeiT's ``RASampler``, timm's
``RepeatAugSampler``). Resuming needs only ``set_epoch(epoch, start_batch)``; ``keyed=True`` deals
``(index, sample_seed)`` pairs so that augmentation does not depend on the worker.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import Sampler

from ..tracking.provenance import stream_generator, stream_seed

SAMPLE_SPREAD = (1_000_003, 1_000_033)  # the per-sample seeds' base, apart from the epoch order's


class ShardedSampler(Sampler[int]):
    def __init__(self, num_samples: int, *, shuffle: bool, seed: int, rank: int = 0, world_size: int = 1,
                 batch_size: int = 1, drop_last: bool = False, repeats: int = 1,
                 update_multiple: int = 1, keyed: bool = False) -> None:
        """``batch_size`` is per process; ``update_multiple`` (gradient accumulation) rounds training epochs
        to whole updates; ``keyed``: deal ``(index, sample_seed)`` pairs."""
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
            generator = stream_generator(self.seed, self.epoch)
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
        base = stream_seed(self.seed, self.epoch, 0, spread=SAMPLE_SPREAD) % 2**62
        positions = range(self.rank + first * self.world_size, 2**62, self.world_size)
        return iter([(index, base + position) for index, position in zip(mine, positions, strict=False)])

    def __len__(self) -> int:
        mine = (self.epoch_length - self.rank + self.world_size - 1) // self.world_size
        return max(mine - self.start_batch * self.batch_size, 0)
