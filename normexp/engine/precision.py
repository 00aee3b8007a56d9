"""Numeric precision in one place: the device, autocast, (for float16) the gradient scaler, and TF32."""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch

from ..errors import UserError

log = logging.getLogger(__name__)

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """``auto``: this process's GPU (its local rank's) when CUDA is available, else the CPU."""
    if name == "auto":
        return torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"trainer.device={name} but CUDA is not available; use trainer.device=cpu or auto")
    if name == "cuda":
        return torch.device(f"cuda:{local_rank}")
    return torch.device(name)


class Precision:
    """``amp``: null (float32), ``bf16`` or ``fp16`` autocast -- CUDA only; elsewhere float32, warned.
    ``tf32``: float32 matrix products and convolutions on TF32 tensor cores (CUDA; DiT's train.py and DyT's
    MAE patch set ``torch.backends.cuda.matmul.allow_tf32`` and ``cudnn.allow_tf32``); ``self.tf32``: whether
    it is on (on a CPU it is not)."""

    def __init__(self, amp: str | None, device: torch.device, tf32: bool = False) -> None:
        if amp and amp not in AMP_DTYPES:
            raise UserError(f"trainer.amp={amp} is not one of {sorted(AMP_DTYPES)} (or null for float32)")
        self.device = device
        self.dtype = AMP_DTYPES.get(amp) if amp else None
        if self.dtype is not None and device.type != "cuda":
            log.warning("trainer.amp=%s is CUDA-only; running in float32 on %s", amp, device)
            self.dtype = None
        self.scaler = torch.amp.GradScaler("cuda") if self.dtype is torch.float16 else None
        self.tf32 = bool(tf32) and device.type == "cuda"
        if device.type == "cuda":  # set either way: a process may train several runs
            torch.backends.cuda.matmul.allow_tf32 = self.tf32
            if self.tf32:  # cuDNN's is on by default
                torch.backends.cudnn.allow_tf32 = True

    def autocast(self) -> Any:
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Before clipping: gradients in their true scale."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is not None:
            self.scaler.step(optimizer)
            self.scaler.update()
        else:
            optimizer.step()
