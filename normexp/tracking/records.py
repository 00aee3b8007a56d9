"""Local run records: the single source of truth for tables, plots, comparison and resume.

A run directory holds:
- ``config.yaml``   the fully resolved config, written before any work;
- ``metrics.jsonl`` one JSON object per logged step or epoch (always with ``step`` and ``epoch``);
- ``summary.json``  the schema below, rewritten atomically at the end (and marked ``running`` at start);
- ``checkpoint.pth`` the last checkpoint (written by the engine).

``summary.json`` schema (version 1)::

    schema_version: 1
    status:        running | completed | diverged | failed
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

import json
import math
import os
import time
from collections.abc import Iterable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Protocol

import yaml

from .provenance import config_hash, git_state, hardware, package_versions

SCHEMA_VERSION = 1


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


def write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")
    os.replace(tmp, path)


class RunRecord:
    """The record of one run. In a distributed job every process has one, but only process 0's
    (``writes=True``) touches the files and the mirrors; the others keep the summary in memory."""

    def __init__(self, run_dir: str | Path, config: dict[str, Any],
                 mirrors: Iterable[MetricsMirror] = (), writes: bool = True) -> None:
        self.dir = Path(run_dir)
        self.config = config
        self.writes = writes
        self.mirrors = list(mirrors) if writes else []
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
        self._previous_rows: list[dict[str, Any]] = []
        self._metrics = None
        if not writes:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        write_json_atomic(self.dir / "summary.json", self.summary)
        metrics = self.dir / "metrics.jsonl"
        if metrics.is_file():  # a rerun in this directory: kept only as far as a resumed checkpoint reaches
            self._previous_rows = read_metrics(self.dir)
        self._metrics = metrics.open("w")

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

    def restore_rows(self, until_step: int) -> None:
        """On resume: the earlier rows of this directory up to the checkpoint's step, back in place."""
        if self._metrics is None:
            return
        for row in self._previous_rows:
            if (row.get("step") or 0) <= until_step:
                self._metrics.write(json.dumps(row) + "\n")
        self._metrics.flush()
        self._previous_rows = []

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
