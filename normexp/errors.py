"""How a run ends other than by completing: :class:`UserError` (one line, exit code 2), :class:`Diverged` (a
result), :class:`Interrupted` (checkpointed, to be continued)."""

from __future__ import annotations

import errno
import signal
from pathlib import Path
from typing import Any


class UserError(Exception):
    """Bad input (config, paths, checkpoints): the message says what is wrong and what to do."""


def one_line(error: BaseException) -> str:
    """The message of ``error`` as one line, also when a loader worker raised it."""
    text = str(error).strip()
    if "Traceback" in text:
        text = text.splitlines()[-1].split(f"{type(error).__name__}: ", 1)[-1]
    return text.splitlines()[0] if text else type(error).__name__


RETRY_AFTER_FIX = "run the same command again (a run continues from its last checkpoint)"


def storage_error(error: OSError, hint: str = "give an output root you can write: NORMEXP_OUTPUT_DIR=<dir>"
                  ) -> UserError | None:
    """A file-system error the user fixes (no space, quota, read-only, a file for a directory) as one line
    (``hint``: where else to write); None for any other error."""
    where = error.filename
    said = f"{error.strerror}: '{where}'" if where is not None else str(error.strerror)
    if error.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return UserError(f"{said}: free space (or raise the quota or the file-size limit), then "
                         f"{RETRY_AFTER_FIX}")
    if error.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return UserError(f"{said}: {hint}")
    if error.errno in (errno.ENOTDIR, errno.EEXIST) and where is not None:
        path = Path(where)
        culprit = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), path)
        return UserError(f"'{culprit}' is a file where a directory is needed: move it away, or {hint}")
    return None


class Diverged(Exception):
    """Training diverged: a non-finite loss, or one above ``trainer.max_loss``. A result, not a crash."""

    def __init__(self, step: int, epoch: int, loss: float, metrics: dict[str, Any],
                 last_finite: dict[str, Any] | None) -> None:
        super().__init__(f"diverged at step {step} (epoch {epoch}): loss {loss:.4g}")
        self.step, self.epoch, self.loss = step, epoch, loss
        self.metrics = metrics  # the evaluations before divergence: {"final": ..., "best": ...}
        self.last_finite = last_finite  # the last finite training loss, its step and epoch


class Interrupted(BaseException):
    """A stop signal arrived; the trainer checkpointed after the current update. ``hand_over()`` passes the
    signal to the previous handler (submitit's, which requeues)."""

    def __init__(self, signum: int, step: int, hand_over: Any = None) -> None:
        super().__init__(f"{signal.Signals(signum).name} at step {step}: checkpoint saved")
        self.signum, self.step = signum, step
        self.hand_over = hand_over or (lambda: None)
