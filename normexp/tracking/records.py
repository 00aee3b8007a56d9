"""Local run records: the single source of truth for tables, plots, comparison and resume.

A run directory holds:
- ``config.yaml``   the fully resolved config, written when the run starts -- after the config is valid and
                    the start is decided (``normexp.run``): a refused start leaves the directory as it was;
- ``metrics.jsonl`` one JSON object per logged step or epoch (always with ``step`` and ``epoch``); a resumed
                    run keeps the rows up to its checkpoint and appends;
- ``summary.json``  the schema below, rewritten atomically at the end (and marked ``running`` at start);
- ``checkpoint.pth`` the last checkpoint (written by the engine);
- ``run.lock``      while a process runs it (``normexp.tracking.lock``).

Every file is replaced atomically (:func:`write_atomic`): a temporary file of its own, fsync'ed, renamed
over the old one. A killed writer leaves the old file whole and a ``.<name>.*.tmp``, which the run's next
start removes.

``summary.json`` schema (version 1)::

    schema_version: 1
    status:        running | completed | diverged | failed | interrupted (a stop signal or Ctrl-C; a
                   ``running`` record whose process is gone reads as interrupted: ``effective_status``)
    error:         one line, when diverged or failed
    diverged:      {step, epoch, loss} of the first non-finite (or too large) training loss, when diverged
    run_id:        config hash (resolved config + seed, less logger settings)
    name, task, seed
    metrics:       {"final": {...last evaluation...}, "best": {...best evaluation...}}; a diverged run keeps
                   the last finite ones and adds "last_finite": {step, epoch, train/loss}
    params:        trainable + frozen parameter count
    gmacs:         multiply-accumulates of one forward pass at the input size, in 1e9 (papers' "FLOPs")
    images_per_s:  training throughput over the run (images / second of training steps)
    wall_time_s, started_at, finished_at, git {commit, dirty}, versions {package: version},
    hardware {device, gpus, cpu_count, platform}
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import secrets
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Any, Protocol

import yaml

from .lock import live_owner
from .provenance import config_hash, git_state, hardware, package_versions

SCHEMA_VERSION = 1
DONE = ("completed", "diverged")  # statuses that are results: such a run is never repeated


class MetricsMirror(Protocol):
    """Anything that mirrors the record (W&B): gets every logged row and the final summary."""

    def log(self, row: dict[str, Any]) -> None: ...

    def finish(self, summary: dict[str, Any]) -> None: ...


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else str(value)
    if hasattr(value, "item"):  # tensors and numpy scalars
        return _jsonable(value.item())
    return value


# ---------------------------------------------------------------- atomic files
def fsync_dir(path: Path) -> None:
    """Make a rename in ``path`` durable."""
    directory = os.open(path, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def write_atomic(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    """``path`` whole or not at all: ``write`` fills a temporary file of this writer's own in the same
    directory, which is flushed, fsync'ed and renamed over ``path`` (then the directory is fsync'ed). An
    error removes the temporary file; a kill leaves it (``remove_stale_temporaries``)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        with open(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666), "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fsync_dir(path.parent)


def write_json_atomic(path: Path, obj: Any) -> None:
    text = json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n"
    write_atomic(path, lambda f: f.write(text.encode()))


def remove_stale_temporaries(run_dir: Path) -> list[Path]:
    """The temporary files killed writers left in ``run_dir`` (only call while holding its lock)."""
    stale = [*run_dir.glob(".*.tmp"), *(run_dir / n for n in ("summary.json.tmp", "checkpoint.pth.tmp"))]
    removed = []
    for path in stale:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed.append(path)
    return removed


# ---------------------------------------------------------------- one run's record
class RunRecord:
    """The record of one run. In a distributed job every process has one, but only process 0's
    (``writes=True``) touches the files and the mirrors; the others keep the summary in memory.

    Created once the run has been accepted (``normexp.run``): it writes ``config.yaml`` and a ``running``
    summary, keeps the rows of ``metrics.jsonl`` up to ``keep_rows_until`` (the step of the checkpoint a
    resumed run continues from; 0 for a fresh start) and appends to it. ``resume_state`` is that checkpoint,
    already read and verified, for the trainer.
    """

    def __init__(self, run_dir: str | Path, config: dict[str, Any],
                 mirrors: Iterable[MetricsMirror] = (), writes: bool = True, keep_rows_until: int = 0,
                 resume_state: dict[str, Any] | None = None) -> None:
        self.dir = Path(run_dir)
        self.config = config
        self.writes = writes
        self.mirrors = list(mirrors) if writes else []
        self.resume_state = resume_state
        self.started = time.time()
        self.summary: dict[str, Any] = {
            "schema_version": SCHEMA_VERSION,
            "status": "running",
            "run_id": config_hash(config),
            "name": config.get("name"),
            "task": (config.get("task") or {}).get("name"),
            "seed": config.get("seed"),
            "metrics": {},
            "started_at": _now(),
            "git": git_state(),
            "versions": package_versions(),
            "hardware": hardware(),
        }
        self._metrics = None
        if not writes:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        text = yaml.safe_dump(config, sort_keys=False)
        write_atomic(self.dir / "config.yaml", lambda f: f.write(text.encode()))
        write_json_atomic(self.dir / "summary.json", self.summary)
        metrics = self.dir / "metrics.jsonl"
        if metrics.is_file():  # a rerun in this directory: its rows up to the checkpoint it continues from
            rows = read_metrics(self.dir)
            kept = [row for row in rows if (row.get("step") or 0) <= keep_rows_until]
            if len(kept) != len(rows):
                lines = "".join(json.dumps(row) + "\n" for row in kept)
                write_atomic(metrics, lambda f: f.write(lines.encode()))
        self._metrics = metrics.open("a")

    @property
    def checkpoint_path(self) -> Path:
        return self.dir / "checkpoint.pth"

    def log(self, row: dict[str, Any]) -> None:
        if self._metrics is None:
            return
        row = {k: _jsonable(v) for k, v in row.items()}
        self._metrics.write(json.dumps(row) + "\n")
        self._metrics.flush()
        for mirror in self.mirrors:
            mirror.log(row)

    def update(self, **fields: Any) -> None:
        """Add fields to the summary (params, gmacs, metrics...), written at ``finish``."""
        self.summary.update({k: _jsonable(v) if not isinstance(v, dict) else v for k, v in fields.items()})

    def finish(self, status: str, error: str | None = None) -> dict[str, Any]:
        wall_time = round(time.time() - self.started, 2)
        self.summary.update(status=status, finished_at=_now(), wall_time_s=wall_time)
        if error:
            self.summary["error"] = error
        if self._metrics is None:
            return self.summary
        write_json_atomic(self.dir / "summary.json", self.summary)
        self._metrics.close()
        for mirror in self.mirrors:
            mirror.finish(self.summary)
        return self.summary


def output_root() -> Path:
    """Where run records go: ``$NORMEXP_OUTPUT_DIR``, else ``outputs`` (as configs/train.yaml says)."""
    return Path(os.environ.get("NORMEXP_OUTPUT_DIR", "outputs"))


def run_labels(config: dict[str, Any]) -> dict[str, Any]:
    """What every mirror labels a run with: backbone, norm, task, data, seed, and its table and scale."""
    labels = {key: (config.get(key) or {}).get("name") for key in ("backbone", "norm", "task", "data")}
    labels["seed"] = config.get("seed")
    table = config.get("table") or {}
    labels.update({"table": table.get("id"), "scale": table.get("scale")})
    return {k: v for k, v in labels.items() if v is not None}


def display_name(config: dict[str, Any]) -> str:
    """What dashboards call a run: a table's run by its table, rows and seed (``table.run_name``, e.g.
    ``dyt_squash/ViT-S/identity/s0``), any other by its ``name``."""
    return (config.get("table") or {}).get("run_name") or str(config.get("name"))


def run_tags(config: dict[str, Any]) -> list[str]:
    """W&B-style tags: the labels' values (a table's seed and scale as ``seed:<n>``, ``scale:<s>``) and the
    config's own ``tags``."""
    labels = run_labels(config)
    tags = [str(labels[k]) for k in ("backbone", "norm", "task", "data") if k in labels]
    if "table" in labels:  # a table's run: its scale and seed too, so the runs table can group seeds of a row
        tags += [f"scale:{labels['scale']}", f"seed:{labels['seed']}"]
    return list(dict.fromkeys([*tags, *(str(t) for t in config.get("tags") or [])]))


def read_summary(run_dir: str | Path) -> dict[str, Any]:
    return json.loads((Path(run_dir) / "summary.json").read_text())


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    with (Path(run_dir) / "metrics.jsonl").open() as f:
        return [json.loads(line) for line in f if line.strip()]


def effective_status(run_dir: str | Path, summary: dict[str, Any]) -> str:
    """The record's status -- except that a ``running`` record whose process is gone (killed: no live lock)
    is ``interrupted``."""
    status = summary.get("status", "unknown")
    if status == "running" and live_owner(run_dir) is None:
        return "interrupted"
    return status


# ---------------------------------------------------------------- finding records
@dataclass
class Record:
    """A run record found on disk."""

    dir: Path
    summary: dict[str, Any]

    @property
    def status(self) -> str:
        return effective_status(self.dir, self.summary)

    @property
    def config(self) -> dict[str, Any]:
        return yaml.safe_load((self.dir / "config.yaml").read_text()) or {}


# directories under an output root that hold no run records (and can be large)
NOT_RECORDS = {"wandb", "mlflow", "dataset_cache", "corruption_cache", ".hydra", ".submitit", "__pycache__"}


def iter_records(root: Path) -> Iterator[Record]:
    """Every readable run record under ``root``."""
    for directory, subdirs, files in os.walk(root) if root.is_dir() else ():
        subdirs[:] = sorted(d for d in subdirs if d not in NOT_RECORDS)
        if "summary.json" not in files:
            continue
        try:
            summary = json.loads((Path(directory) / "summary.json").read_text())
        except (OSError, ValueError):
            continue  # a foreign file
        if isinstance(summary, dict) and summary.get("run_id"):
            yield Record(Path(directory), summary)


_RANK = {"completed": 3, "diverged": 3, "running": 2, "failed": 1, "interrupted": 1}  # running: a live one


def index_records(root: Path) -> dict[str, Record]:
    """``run_id -> record`` of the records under ``root`` (a result beats a failure, newer beats older)."""
    index: dict[str, Record] = {}
    for record in iter_records(root):
        run_id = record.summary["run_id"]
        old = index.get(run_id)
        key = (_RANK.get(record.status, 0), record.summary.get("finished_at") or "")
        if old is None or key > (_RANK.get(old.status, 0), old.summary.get("finished_at") or ""):
            index[run_id] = record
    return index
