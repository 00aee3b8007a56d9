"""Stop signals: a preempted or interrupted run (SIGTERM, SIGUSR1/2, Ctrl-C) finishes its update,
checkpoints, then stops, handing the signal to the previous handler (submitit's requeue). A second Ctrl-C
stops at once."""

from __future__ import annotations

import contextlib
import logging
import signal
from typing import Any

import torch

from .. import distributed
from ..errors import Interrupted

log = logging.getLogger(__name__)

STOP_SIGNALS = tuple(getattr(signal, s) for s in ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2")
                     if hasattr(signal, s))


class StopSignals:
    """While installed: remember a stop signal and restore the handlers afterwards; processes agree on a
    stop every ``check_interval`` updates and at epoch ends."""

    def __init__(self, device: torch.device, check_interval: int) -> None:
        self.device, self.check_interval = device, max(check_interval, 1)
        self.received: int | None = None
        self.previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        with contextlib.suppress(ValueError):  # only the main thread may install handlers
            for signum in STOP_SIGNALS:
                self.previous[signum] = signal.signal(signum, self._note)
        return self

    def _note(self, signum: int, _frame: Any) -> None:
        if signum == signal.SIGINT and self.received == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: at once, without a checkpoint
        hint = " (Ctrl-C again: stop at once, without it)" if signum == signal.SIGINT else ""
        log.warning("%s: stopping after the current update and saving a checkpoint%s",
                    signal.Signals(signum).name, hint)
        self.received = signum

    def __exit__(self, *exc: Any) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)

    def requested(self, update: int, every_update: bool = False) -> bool:
        """Whether a stop signal arrived (on any process, once they agree)."""
        if not distributed.info().enabled:
            return self.received is not None
        if not every_update and update % self.check_interval:
            return False
        flag = torch.tensor([float(self.received is not None)], device=self.device)
        return bool(distributed.all_reduce_sum(flag).item())

    def interrupted(self, update: int) -> Interrupted:
        """The error that ends the run after its checkpoint at ``update``."""
        return Interrupted(self.received or signal.SIGTERM, update, self.hand_over)

    def hand_over(self) -> None:
        """After checkpointing: the previous handler, if any, takes the signal (submitit requeues)."""
        handler = self.previous.get(self.received) if self.received is not None else None
        if callable(handler) and handler is not signal.default_int_handler:  # that one only raises Ctrl-C
            handler(self.received, None)
