"""Divergence detection without a host sync per step: losses are folded into a window on the device and read
every ``log_interval`` updates; a non-finite loss (or one above ``trainer.max_loss``) stops every process at
the earliest bad step (:class:`~normexp.errors.Diverged`)."""

from __future__ import annotations

from typing import Any

import torch

from .. import distributed
from ..errors import Diverged


class LossWindow:
    """The training losses since the last ``train/loss`` row, and what they say about divergence."""

    def __init__(self, device: torch.device, max_loss: float | None = None) -> None:
        self.device, self.max_loss = device, max_loss
        self.last_finite_loss: dict[str, Any] | None = None  # step, epoch, train/loss: for the record
        self.reset()

    def reset(self) -> None:
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        no_step = torch.full((), -1, dtype=torch.long, device=self.device)
        self.window = {"sum": zero.clone(), "count": zero.clone(), "first_bad": no_step.clone(),
                       "bad_loss": zero.clone(), "last_good": zero.clone(), "last_good_step": no_step.clone()}

    def track(self, loss: torch.Tensor, step: int) -> None:
        """Fold one micro-batch's loss into the window, on the device (``step``: the update it is part of)."""
        w, loss = self.window, loss.double()
        bad = ~torch.isfinite(loss)
        if self.max_loss is not None:
            bad |= loss > self.max_loss
        first = (w["first_bad"] < 0) & bad
        w["first_bad"] = torch.where(first, step, w["first_bad"])
        w["bad_loss"] = torch.where(first, loss, w["bad_loss"])
        ok = ~bad & (w["first_bad"] < 0)
        w["last_good"] = torch.where(ok, loss, w["last_good"])
        w["last_good_step"] = torch.where(ok, step, w["last_good_step"])
        w["sum"] += loss
        w["count"] += 1

    def check(self, epoch: int, metrics: dict[str, Any]) -> None:
        """Read the window; on any process's bad loss, every process raises Diverged at the earliest step."""
        w = self.window
        first = int(w["first_bad"])
        if distributed.info().enabled:
            steps = distributed.all_gather_objects(first)
            first = min((s for s in steps if s >= 0), default=-1)
        if int(w["last_good_step"]) >= 0:
            self.last_finite_loss = {"step": int(w["last_good_step"]), "epoch": epoch,
                                     "train/loss": float(w["last_good"])}
        if first >= 0:
            raise Diverged(first, epoch, float(w["bad_loss"]), metrics, self.last_finite_loss)

    def mean(self) -> float:
        """The mean loss over the window's micro-batches of every process (NaN for an empty window)."""
        total = distributed.all_reduce_sum(torch.stack([self.window["sum"], self.window["count"]]))
        return float(total[0] / total[1]) if float(total[1]) else float("nan")

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.cpu() for k, v in self.window.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.window = {k: v.to(self.device) for k, v in state.items()}
