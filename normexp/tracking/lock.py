"""Who runs a run: an atomic claim on its directory (``run.lock``, ``O_CREAT | O_EXCL``) with the owner's
host, pid and start time and a heartbeat every ``HEARTBEAT_S`` seconds. A lock whose owner is gone (dead pid
on this host, heartbeat older than ``STALE_AFTER_S`` elsewhere) is taken over; a live one raises
:class:`RunBusy`. A killed run's ``running`` record then reads as ``interrupted``."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ..errors import UserError

log = logging.getLogger(__name__)

LOCK_NAME = "run.lock"
HEARTBEAT_S = 30.0
STALE_AFTER_S = 300.0  # a lock from another host without a heartbeat for this long: its owner is gone
UNREADABLE_AFTER_S = 2.0  # a lock still empty or unreadable this long after its creation: its writer died
_TAKEOVER_STALE_S = 60.0


def _process_start(pid: int) -> int | None:
    """The start time of process ``pid`` (clock ticks since boot, Linux), to tell it from a reused pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])  # field 22, counted after the parenthesised name


def pid_exists(pid: int) -> bool:
    """Whether a process ``pid`` runs on this host (anyone's)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


@dataclass(frozen=True)
class LockOwner:
    """What a lock file says about the process that holds it, and how old its heartbeat is."""

    host: str
    pid: int
    pid_start: int | None
    claimed_at: str
    heartbeat_age_s: float

    @property
    def alive(self) -> bool:
        if self.host == socket.gethostname():
            if not pid_exists(self.pid):
                return False
            start = _process_start(self.pid)
            return self.pid_start is None or start is None or start == self.pid_start
        return self.heartbeat_age_s < STALE_AFTER_S

    def describe(self) -> str:
        return (f"pid {self.pid} on {self.host}, since {self.claimed_at} (heartbeat "
                f"{self.heartbeat_age_s:.0f} s ago)")


def lock_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / LOCK_NAME


def read_owner(run_dir: str | Path) -> LockOwner | None:
    """The owner the lock of ``run_dir`` names (None: no lock, or one not yet written)."""
    path = lock_path(run_dir)
    try:
        info = json.loads(path.read_text())
        age = time.time() - path.stat().st_mtime
        return LockOwner(str(info["host"]), int(info["pid"]), info.get("pid_start"), str(info["claimed_at"]),
                         max(age, 0.0))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def live_owner(run_dir: str | Path) -> LockOwner | None:
    """The owner of ``run_dir``'s lock if it is alive, else None."""
    owner = read_owner(run_dir)
    return owner if owner is not None and owner.alive else None


class RunBusy(UserError):
    """The run directory is claimed by a live process."""

    def __init__(self, run_dir: Path, owner: LockOwner) -> None:
        super().__init__(f"run {run_dir} is running in another process ({owner.describe()}): wait for it "
                         "to end (a run it leaves unfinished is continued by the next start)")
        self.run_dir, self.owner = run_dir, owner


@contextlib.contextmanager
def _exclusive(path: Path, wait_s: float = 10.0) -> Iterator[None]:
    """A short critical section between processes: ``path`` created with O_EXCL, removed on exit."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
            break
        except FileExistsError:
            with contextlib.suppress(OSError):  # left by a process killed inside the section
                if time.time() - path.stat().st_mtime > _TAKEOVER_STALE_S:
                    path.unlink()
                    continue
            if time.monotonic() > deadline:
                raise UserError(f"'{path}' has been held for {wait_s:.0f} s: remove it if no normexp "
                                "process is starting in that directory") from None
            time.sleep(0.05)
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            path.unlink()


class RunLock:
    """This process's claim on a run directory."""

    def __init__(self, run_dir: Path, content: dict[str, Any]) -> None:
        self.run_dir, self.path, self.content = run_dir, lock_path(run_dir), content
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="normexp-run-lock", daemon=True)
        self._thread.start()

    @classmethod
    def acquire(cls, run_dir: str | Path) -> RunLock:
        """Claim ``run_dir`` (created if needed); :class:`RunBusy` when a live process holds it."""
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        path = lock_path(run_dir)
        pid = os.getpid()
        content = {"host": socket.gethostname(), "pid": pid, "pid_start": _process_start(pid),
                   "claimed_at": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        for _ in range(100):
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                owner = read_owner(run_dir)
                if owner is None:  # being written this instant -- or empty or garbage for good
                    with contextlib.suppress(OSError):
                        if time.time() - path.stat().st_mtime > UNREADABLE_AFTER_S:
                            log.warning("%s names no live owner (empty or unreadable): taking it over", path)
                            cls._take_over(run_dir, None)
                    time.sleep(0.05)
                    continue
                if owner.alive:
                    raise RunBusy(run_dir, owner) from None
                cls._take_over(run_dir, owner)
                continue
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(content) + "\n")
                f.flush()
                os.fsync(f.fileno())
            return cls(run_dir, content)
        raise UserError(f"could not claim {run_dir} ({path} keeps changing): is another normexp starting "
                        "there?")

    @staticmethod
    def _take_over(run_dir: Path, stale: LockOwner | None) -> None:
        """Remove a lock whose owner is gone -- unless, by the time we hold the take-over file, it changed."""
        path = lock_path(run_dir)
        with _exclusive(path.with_name(LOCK_NAME + ".takeover")):
            now = read_owner(run_dir)
            same = now is None if stale is None else (
                now is not None and (now.host, now.pid, now.claimed_at) == (stale.host, stale.pid,
                                                                           stale.claimed_at))
            if same:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)
            except OSError:  # taken over by someone who thought us gone, or the directory was removed
                return

    def owned(self) -> bool:
        try:
            return json.loads(self.path.read_text()) == self.content
        except (OSError, ValueError):
            return False

    def release(self) -> None:
        """Stop the heartbeat and remove the lock if it is still this process's."""
        self._stop.set()
        if self.owned():
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()
