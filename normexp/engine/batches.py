"""Batches: how many micro-batches make one update (a recipe's global batch); batches onto the device."""

from __future__ import annotations

from typing import Any

import torch

from ..errors import UserError


def accumulation_steps(global_batch: int | None, batch_size: int, world_size: int, accum_steps: int) -> int:
    """Micro-batches per update: ``accum_steps``, or -- when a recipe states ``global_batch`` -- the
    accumulation that reaches it with ``batch_size`` images on each of ``world_size`` processes."""
    if not global_batch:
        return int(accum_steps)
    per_step = batch_size * world_size
    procs = f"{world_size} process{'es' if world_size > 1 else ''}"
    if global_batch % per_step:
        if global_batch % world_size:
            raise UserError(f"trainer.global_batch={global_batch} cannot be split over {procs}: run on a "
                            f"number of processes that divides it, or drop it (trainer.global_batch=null)")
        per_process = global_batch // world_size
        fits = max(d for d in range(1, min(batch_size, per_process) + 1) if per_process % d == 0)
        raise UserError(f"trainer.global_batch={global_batch} is not a whole number of steps of "
                        f"data.batch_size={batch_size} on {procs}: use a data.batch_size that divides "
                        f"{per_process} (e.g. data.batch_size={fits}), or drop the recipe's global batch "
                        "(trainer.global_batch=null; trainer.accum_steps then sets the accumulation)")
    steps = global_batch // per_step
    if accum_steps not in (1, steps):
        raise UserError(f"trainer.accum_steps={accum_steps} contradicts trainer.global_batch={global_batch} "
                        f"at {per_step} images per step (it needs {steps}): set only one of them")
    return steps


def to_device(batch: Any, device: torch.device) -> Any:
    """Tensors, or lists / dicts of them (detection targets), on ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


def batch_size_of(images: torch.Tensor | list[torch.Tensor]) -> int:
    """Images in a batch: a stacked tensor (classification), a list of images (detection) or a list of
    stacked views of the same images (multi-crop: the images of one)."""
    if isinstance(images, torch.Tensor):
        return images.shape[0]
    return images[0].shape[0] if images and images[0].dim() == 4 else len(images)
