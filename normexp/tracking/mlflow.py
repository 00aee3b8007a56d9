"""MLflow: a live mirror of a run record (``logger=mlflow``), and the import of records made without one.

Both write the same MLflow run for a record: params = the flattened resolved config; metrics = every row of
``metrics.jsonl`` at its step (training loss per interval, validation per epoch), then the summary's
``final/...`` and ``best/...``; tags = the labels every mirror uses (backbone, norm, task, data, seed,
table, scale) plus ``normexp.run_id`` (the record's identity) and ``normexp.run_dir``; artifacts = the
record's small files (never checkpoints). A record is imported once: runs are keyed by ``normexp.run_id``.
The record is only read, never changed -- it stays the source of truth.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path
from typing import Any

from .provenance import config_hash, flatten
from .records import (
    DamagedRecord,
    display_name,
    logged_rows,
    output_root,
    read_metrics,
    run_labels,
    warn_damaged,
)

log = logging.getLogger(__name__)

RUN_ID_TAG = "normexp.run_id"
ARTIFACTS = ("config.yaml", "summary.json", "metrics.jsonl", "robustness.txt")
STATUS = {"completed": "FINISHED", "diverged": "FINISHED", "failed": "FAILED", "interrupted": "KILLED",
          "running": "RUNNING"}
MAX_PARAM = 500  # MLflow's limit on a param value is larger; long lists say little when cut anyway


def tracking_uri(setting: str | None = None, root: Path | None = None) -> str:
    """``setting``, else ``$MLFLOW_TRACKING_URI``, else the local dashboard's store: SQLite under the output
    root (``<outputs>/mlflow/mlflow.db``, artifacts beside it)."""
    return setting or os.environ.get("MLFLOW_TRACKING_URI") or \
        f"sqlite:///{((root or output_root()) / 'mlflow' / 'mlflow.db').resolve()}"


def mlflow_params(config: dict[str, Any]) -> dict[str, str]:
    """``{"trainer": {"lr": 1e-3}}`` -> ``{"trainer.lr": "0.001"}`` (MLflow params are strings)."""
    return {name: str(value)[:MAX_PARAM] for name, value in flatten(config).items()}


def numeric_metrics(row: dict[str, Any]) -> dict[str, float]:
    """The finite numbers of a record row, less its step (MLflow metrics are finite floats)."""
    return {k: float(v) for k, v in row.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


def summary_metrics(summary: dict[str, Any]) -> dict[str, float]:
    """``final/<metric>``, ``best/<metric>`` (robustness: ``robustness/<metric>``) and run-level numbers."""
    flat: dict[str, float] = {}
    for kind, metrics in (summary.get("metrics") or {}).items():
        if isinstance(metrics, dict):
            flat.update({f"{kind}/{k}": v for k, v in numeric_metrics(metrics).items()})
    for key in ("params", "gmacs", "images_per_s", "wall_time_s", "global_batch", "world_size", "bad_images"):
        if isinstance(summary.get(key), (int, float)):
            flat[key] = float(summary[key])
    return flat


def _millis(iso: str | None) -> int | None:
    return int(datetime.fromisoformat(iso).timestamp() * 1000) if iso else None


class _Store:
    """One MLflow tracking store and an experiment by name, through MlflowClient (no global state)."""

    def __init__(self, tracking_uri: str) -> None:
        from mlflow import MlflowClient

        self.artifact_root = None
        if tracking_uri.startswith("sqlite:///"):  # a local store: artifacts beside the database, not in ./
            database = Path(tracking_uri.removeprefix("sqlite:///"))
            database.parent.mkdir(parents=True, exist_ok=True)
            self.artifact_root = (database.parent / "artifacts").as_uri()
        self.uri = tracking_uri
        self.client = MlflowClient(tracking_uri=tracking_uri)
        self._experiments: dict[str, str] = {}

    def experiment_id(self, name: str) -> str:
        if name not in self._experiments:
            found = self.client.get_experiment_by_name(name)
            self._experiments[name] = found.experiment_id if found else self.client.create_experiment(
                name, artifact_location=f"{self.artifact_root}/{name}" if self.artifact_root else None)
        return self._experiments[name]

    def start(self, experiment: str, name: str | None, tags: dict[str, str],
              start_time: int | None = None) -> str:
        run = self.client.create_run(self.experiment_id(experiment), run_name=name, tags=tags,
                                     start_time=start_time)
        return run.info.run_id

    def log_params(self, run_id: str, params: dict[str, str]) -> None:
        from mlflow.entities import Param

        items = [Param(k, v) for k, v in params.items()]
        for i in range(0, len(items), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(run_id, params=items[i:i + 100])

    def log_metrics(self, run_id: str, rows: Iterable[tuple[dict[str, float], int, int]]) -> None:
        from mlflow.entities import Metric

        items = [Metric(k, v, stamp, step) for metrics, step, stamp in rows for k, v in metrics.items()]
        for i in range(0, len(items), 1000):  # MLflow takes at most 1000 metrics per batch
            self.client.log_batch(run_id, metrics=items[i:i + 1000])

    def finish(self, run_id: str, record_dir: Path, summary: dict[str, Any], artifacts: bool,
               end_time: int | None = None, rows: list[dict[str, Any]] | None = None) -> None:
        """The summary's metrics at the last logged step (of ``rows``, else of the record's log), the status
        and the artifacts; the run ended."""
        step = last_step(_rows(record_dir) if rows is None else rows)
        now = end_time or int(time.time() * 1000)
        self.log_metrics(run_id, [(summary_metrics(summary), step, now)])
        self.client.set_tag(run_id, "status", summary.get("status", "unknown"))
        if summary.get("error"):
            self.client.set_tag(run_id, "error", str(summary["error"])[:MAX_PARAM])
        if artifacts:
            for name in ARTIFACTS:
                if (record_dir / name).is_file():
                    self.client.log_artifact(run_id, str(record_dir / name))
        self.client.set_terminated(run_id, STATUS.get(summary.get("status", ""), "FINISHED"), end_time=now)

    def imported_run_ids(self) -> set[str]:
        """The ``normexp.run_id`` of every run in the store."""
        ids, token = set(), None
        experiments = [e.experiment_id for e in self.client.search_experiments()]
        while experiments:
            page = self.client.search_runs(experiments, max_results=1000, page_token=token)
            ids |= {r.data.tags[RUN_ID_TAG] for r in page if RUN_ID_TAG in r.data.tags}
            token = page.token
            if not token:
                break
        return ids


def _rows(record_dir: Path) -> list[dict[str, Any]]:
    return logged_rows(record_dir) or []


def last_step(rows: list[dict[str, Any]]) -> int:
    return max((r.get("step") or 0 for r in rows), default=0)


def mlflow_tags(config: dict[str, Any], run_dir: Path, run_id: str) -> dict[str, str]:
    tags = {k: str(v) for k, v in run_labels(config).items()}
    tags.update({RUN_ID_TAG: run_id, "normexp.run_dir": str(run_dir.resolve())})
    return tags


class MlflowMirror:
    """Mirrors a run record into MLflow while it runs (``logger=mlflow``)."""

    def __init__(self, cfg: Any, run_dir: Path, config: dict[str, Any], name: str, tags: list[str]) -> None:
        self.store = _Store(tracking_uri(cfg.get("tracking_uri")))
        self.run_dir, self.artifacts = run_dir, bool(cfg.get("artifacts", True))
        self.run_id = self.store.start(cfg.get("experiment") or "normexp", name,
                                       mlflow_tags(config, run_dir, config_hash(config)))
        self.store.log_params(self.run_id, mlflow_params(config))
        log.info("MLflow run %s in %s", self.run_id, self.store.uri)

    def log(self, row: dict[str, Any]) -> None:
        metrics = numeric_metrics(row)
        if metrics:
            now = int(time.time() * 1000)
            self.store.log_metrics(self.run_id, [(metrics, int(row.get("step") or 0), now)])

    def log_image(self, key: str, path: Path, step: int) -> None:
        if self.artifacts:
            self.store.client.log_artifact(self.run_id, str(path), artifact_path=key)

    def finish(self, summary: dict[str, Any]) -> None:
        self.store.finish(self.run_id, self.run_dir, summary, self.artifacts)


def import_records(records: Iterable[tuple[Path, dict[str, Any], dict[str, Any]]], tracking_uri: str,
                   default_experiment: str = "normexp", artifacts: bool = True) -> tuple[int, int]:
    """Write every (run dir, config, summary) not yet in the store; returns (imported, already there).

    Each run keeps its record's times: started_at and finished_at, and per row the step it was logged at.
    """
    store = _Store(tracking_uri)
    known = store.imported_run_ids()
    imported = skipped = 0
    for run_dir, config, summary in records:
        if summary.get("run_id") in known:
            skipped += 1
            continue
        try:  # read whole before the MLflow run exists: a damaged log leaves no half-imported run
            rows = read_metrics(run_dir) if (run_dir / "metrics.jsonl").is_file() else []
        except DamagedRecord as e:
            warn_damaged(run_dir, e.problem)
            continue
        start, end = _millis(summary.get("started_at")), _millis(summary.get("finished_at"))
        experiment = (config.get("table") or {}).get("id") or default_experiment
        tags = mlflow_tags(config, run_dir, summary["run_id"])
        run_id = store.start(experiment, display_name(config), tags, start)
        store.log_params(run_id, mlflow_params(config))
        stamp = start or int(time.time() * 1000)
        first = (config.get("table") or {}).get("metric")  # a table's metric: the one its comparison shows
        headline = {k: v for k, v in summary_metrics(summary).items() if k == first}
        if headline:  # logged first, MLflow's compare page plots it by default
            store.log_metrics(run_id, [(headline, last_step(rows), end or stamp)])
        store.log_metrics(run_id, [(numeric_metrics(row), int(row.get("step") or 0), stamp)
                                   for row in rows if numeric_metrics(row)])
        store.finish(run_id, run_dir, summary, artifacts, end_time=end, rows=rows)
        known.add(summary["run_id"])
        imported += 1
    return imported, skipped
