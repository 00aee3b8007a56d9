"""Local run records: the single source of truth for tables, plots, comparison and resume.

A run directory holds:
- ``config.yaml``   the fully resolved config, written when the run starts -- after the config is valid and
                    the start is decided (``normexp.run``): a refused start leaves the directory as it was;
- ``metrics.jsonl`` one JSON object per logged step or epoch (always with ``step`` and ``epoch``), appended
                    unbuffered; a resumed run keeps the rows up to its checkpoint and appends;
- ``summary.json``  the schema below, rewritten atomically at the end (and marked ``running`` at start);
- ``checkpoint.pth`` the last checkpoint (written by the engine);
- ``<key>/epoch_<n>.png`` pictures a task logs at epoch ends (MAE's reconstructions), when it logs any;
- ``run.lock``      while a process runs it (``normexp.tracking.lock``).

Every file is replaced atomically (:func:`write_atomic`): a temporary file of its own, fsync'ed, renamed
over the old one. A killed writer leaves the old file whole and a ``.<name>.*.tmp``, which the run's next
start removes; an append cut short (a full disk, a quota, a kill) leaves part of the last row, which readers
drop with a warning and the next start removes.

Every reader goes through :func:`read_summary`, :func:`read_config`, :func:`read_metrics` or
:func:`iter_records`, which check what they read: a record that does not follow the schema is
:class:`DamagedRecord` (one line: which record, what is wrong), skipped with a warning by the readers of many
records and shown as ``damaged`` by tables.

``summary.json`` schema (version 1)::

    schema_version: 1
    status:        running | completed | diverged | failed | interrupted (a stop signal or Ctrl-C; a
                   ``running`` record whose process is gone reads as interrupted: ``effective_status``)
    error:         one line, when diverged or failed
    diverged:      {step, epoch, loss} of the first non-finite (or too large) training loss, when diverged
    run_id:        config hash (resolved config + seed, less logger settings)
    name, task, seed
    metrics:       {"final": {...last evaluation...}, "best": {...best evaluation...}}; a diverged run keeps
                   the last finite ones and adds "last_finite": {step, epoch, train/loss}; a non-finite
                   metric is null (strict JSON) and named in non_finite (``settle_non_finite``)
    non_finite:    ["final.val/top1 = nan", ...], when a metric was not finite
    params:        trainable + frozen parameter count
    gmacs:         multiply-accumulates of one forward pass at the input size, in 1e9 (papers' "FLOPs")
    images_per_s:  training throughput over the run (images / second of training steps)
    attempts:      one per process that ran it: {started_at, finished_at, wall_time_s, status, error}
    started_at:    the first attempt's start; finished_at: the last one's end
    wall_time_s:   the total over attempts
    git {commit, dirty}, versions {package: version}, hardware {device, gpus, cpu_count, threads, platform}
"""

from __future__ import annotations

import contextlib
import json
import logging
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

from ..errors import UserError, one_line
from .lock import live_owner
from .provenance import config_hash, git_state, hardware, package_versions

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
DONE = ("completed", "diverged")  # statuses that are results: such a run is never repeated


class MetricsMirror(Protocol):
    """Anything that mirrors the record (W&B): gets every logged row and the final summary."""

    def log(self, row: dict[str, Any]) -> None: ...

    def finish(self, summary: dict[str, Any]) -> None: ...


def utc_now() -> str:
    """Now, as the records write times: ISO 8601 in UTC, to the second."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def settle_non_finite(summary: dict[str, Any]) -> list[str]:
    """Replace every non-finite number under ``summary["metrics"]`` by null and return what it was (e.g.
    ``final.val/top1 = nan``); a ``completed`` run that holds one is ``diverged``, as a run whose loss
    became non-finite is (a result, with the reason in ``error`` and ``non_finite``). Records written
    before this held such numbers as JSON's non-standard NaN / Infinity; reading them settles them too."""
    found: list[str] = []

    def settle(values: dict[str, Any], path: str) -> None:
        for key, value in values.items():
            if isinstance(value, dict):
                settle(value, f"{path}{key}.")
            elif isinstance(value, float) and not math.isfinite(value):
                values[key] = None
                found.append(f"{path}{key} = {value}")

    metrics = summary.get("metrics")
    if isinstance(metrics, dict):
        settle(metrics, "")
    if found:
        summary["non_finite"] = [*summary.get("non_finite", []), *found]
        if summary.get("status") == "completed":
            summary.update(status="diverged", error=f"non-finite metric(s): {', '.join(found)}")
    return found


def _finite(value: Any) -> Any:
    """``value`` with every non-finite float in it as null: what strict JSON can hold."""
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return None if isinstance(value, float) and not math.isfinite(value) else value


def _strict_json(value: Any) -> Any:
    """A logged value in strict JSON: tensors and numpy numbers as Python numbers, a non-finite float as null
    (NaN) or "inf" / "-inf" (json would write NaN / Infinity, which strict JSON parsers refuse)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else str(value)
    if hasattr(value, "item"):  # tensors and numpy scalars
        return _strict_json(value.item())
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
    error removes the temporary file; a kill leaves it (``remove_stale_temporaries``). A file-system error
    that names no file (a write into a full disk) names ``path``."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        with open(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666), "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(e, OSError) and e.filename is None and e.errno is not None:
            raise OSError(e.errno, e.strerror, str(path)) from e
        raise
    fsync_dir(path.parent)


def write_json_atomic(path: Path, obj: Any) -> None:
    """``obj`` as strict JSON (a non-finite float as null), atomically."""
    text = json.dumps(_finite(obj), indent=2, sort_keys=False, default=str, allow_nan=False) + "\n"
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
def _iso(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, timezone.utc).isoformat(timespec="seconds")


def _last_write(run_dir: Path) -> float | None:
    times = []
    for name in ("metrics.jsonl", "checkpoint.pth", "summary.json"):
        with contextlib.suppress(OSError):
            times.append((run_dir / name).stat().st_mtime)
    return max(times, default=None)


def past_attempts(run_dir: Path, summary: dict[str, Any]) -> list[dict[str, Any]]:
    """The attempts (processes) a record of an unfinished run holds, each with its start, end, wall time,
    status and error. An attempt whose process was killed recorded no end: it is closed here as
    ``interrupted``, ending at the record's last write."""
    attempts = [dict(a) for a in summary.get("attempts") or []]
    if not attempts:  # a record written before attempts were kept: its last process
        attempts = [{k: summary[k] for k in ("started_at", "finished_at", "wall_time_s", "status", "error")
                     if k in summary}]
    last = attempts[-1]
    if last.get("status", "running") == "running":
        end = _last_write(run_dir)
        started = datetime.fromisoformat(last["started_at"]).timestamp() if last.get("started_at") else end
        last.update(status="interrupted", error="the process ended without recording its end (killed?): its "
                    "end is the record's last write")
        if end is not None and started is not None:
            last.update(finished_at=_iso(end), wall_time_s=round(max(end - started, 0.0), 2))
    return attempts


class RunRecord:
    """The record of one run. In a distributed job every process has one, but only process 0's
    (``writes=True``) touches the files and the mirrors; the others keep the summary in memory.

    Created once the run has been accepted (``normexp.run``): it writes ``config.yaml`` and a ``running``
    summary, replaces the rows of ``metrics.jsonl`` by ``rows`` when given (those up to the checkpoint a
    resumed run continues from, none for a run started over; None: the file stays as it is) and appends to
    it. ``resume_state`` is that checkpoint, already read and verified, for the trainer. ``previous``: the
    summary of the unfinished run this one continues in its directory -- its attempts carry over, so
    ``started_at`` is the first attempt's and ``wall_time_s`` the total over attempts.
    """

    def __init__(self, run_dir: str | Path, config: dict[str, Any],
                 mirrors: Iterable[MetricsMirror] = (), writes: bool = True,
                 rows: list[dict[str, Any]] | None = None, resume_state: dict[str, Any] | None = None,
                 previous: dict[str, Any] | None = None) -> None:
        self.dir = Path(run_dir)
        self.config = config
        self.writes = writes
        self.mirrors = list(mirrors) if writes else []
        self.resume_state = resume_state
        self.started = time.time()
        attempts = [*(past_attempts(self.dir, previous) if previous else []), {"started_at": utc_now(),
                                                                                "status": "running"}]
        self.summary: dict[str, Any] = {
            "schema_version": SCHEMA_VERSION,
            "status": "running",
            "run_id": config_hash(config),
            "name": config.get("name"),
            "task": (config.get("task") or {}).get("name"),
            "seed": config.get("seed"),
            "metrics": {},
            "started_at": attempts[0].get("started_at") or attempts[-1]["started_at"],
            "attempts": attempts,
            "git": git_state(),
            "versions": package_versions(),
            "hardware": hardware(),
        }
        self._metrics: int | None = None
        self._reached = rows[-1] if rows else {}  # the last logged row: where a non-finite metric diverged
        if not writes:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        text = yaml.safe_dump(config, sort_keys=False)
        write_atomic(self.dir / "config.yaml", lambda f: f.write(text.encode()))
        write_json_atomic(self.dir / "summary.json", self.summary)
        metrics = self.dir / "metrics.jsonl"
        if rows is not None and (rows or metrics.exists()):
            lines = "".join(json.dumps(row) + "\n" for row in rows)
            write_atomic(metrics, lambda f: f.write(lines.encode()))
        self._metrics = os.open(metrics, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)

    @property
    def checkpoint_path(self) -> Path:
        return self.dir / "checkpoint.pth"

    def log(self, row: dict[str, Any]) -> None:
        if self._metrics is None:
            return
        row = {k: _strict_json(v) for k, v in row.items()}
        self._reached = row
        data = memoryview((json.dumps(row) + "\n").encode())
        try:
            while data:  # unbuffered: a failed write leaves at most part of this row, and no buffer
                data = data[os.write(self._metrics, data):]
        except OSError as e:  # os.write names no file
            raise OSError(e.errno, e.strerror, str(self.dir / "metrics.jsonl")) from None
        for mirror in self.mirrors:
            mirror.log(row)

    def log_image(self, key: str, image: Any, step: int, epoch: int) -> Path | None:
        """A picture for the record: ``image`` (a PIL image) written as ``<key>/epoch_<epoch>.png`` in the run
        directory, and shown by every mirror that shows pictures (W&B) under ``key`` at ``step``."""
        if self._metrics is None:
            return None
        path = self.dir / key / f"epoch_{epoch:04d}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, lambda f: image.save(f, format="PNG"))
        for mirror in self.mirrors:
            if hasattr(mirror, "log_image"):
                mirror.log_image(key, path, step)
        return path

    def update(self, **fields: Any) -> None:
        """Add fields to the summary (params, gmacs, metrics...), written at ``finish``."""
        self.summary.update({k: _strict_json(v) if not isinstance(v, dict) else v for k, v in fields.items()})

    def finish(self, status: str, error: str | None = None) -> dict[str, Any]:
        attempt = self.summary["attempts"][-1]
        attempt.update(status=status, finished_at=utc_now(), wall_time_s=round(time.time() - self.started, 2),
                       **({"error": error} if error else {}))
        total = sum(a.get("wall_time_s") or 0.0 for a in self.summary["attempts"])
        self.summary.update(status=status, finished_at=attempt["finished_at"], wall_time_s=round(total, 2))
        if error:
            self.summary["error"] = error
        if settle_non_finite(self.summary) and self.summary["status"] != status:
            attempt.update(status=self.summary["status"], error=self.summary["error"])
            if "step" in self._reached:  # where: the last row logged
                self.summary["diverged"] = {k: self._reached.get(k) for k in ("step", "epoch")}
        if self._metrics is None:
            return self.summary
        try:
            write_json_atomic(self.dir / "summary.json", self.summary)
        finally:
            with contextlib.suppress(OSError):
                os.close(self._metrics)
            self._metrics = None
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


# ---------------------------------------------------------------- reading records, validated
STATUSES = ("running", "completed", "diverged", "failed", "interrupted")
NUMERIC_SECTIONS = ("final", "best", "last_finite")  # metrics sections of numbers (others hold labels too)
NUMERIC_FIELDS = ("params", "backbone_params", "gmacs", "images_per_s", "wall_time_s", "global_batch",
                  "world_size", "accum_steps", "bad_images")


class DamagedRecord(UserError):
    """A run record that does not read back as the schema says: which record, and what is wrong."""

    def __init__(self, run_dir: str | Path, problem: str) -> None:
        super().__init__(f"run record '{run_dir}' is damaged: {problem} (repair the file, or move the "
                         "directory away)")
        self.run_dir, self.problem = Path(run_dir), problem


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_time(value: Any) -> bool:
    try:
        datetime.fromisoformat(value)
    except (TypeError, ValueError):
        return False
    return True


def summary_problem(summary: Any) -> str | None:
    """What makes ``summary`` (a parsed ``summary.json``) unusable by the readers, or None."""
    if not isinstance(summary, dict):
        return f"summary.json holds a {type(summary).__name__}, not a JSON object"
    if not isinstance(summary.get("run_id"), str) or not summary["run_id"]:
        return "summary.json has no run_id"
    if summary.get("status") not in STATUSES:
        return f"summary.json: status {summary.get('status')!r} is none of {', '.join(STATUSES)}"
    metrics = summary.get("metrics", {})
    if not isinstance(metrics, dict) or not all(isinstance(v, dict) for v in metrics.values()):
        return "summary.json: 'metrics' is not a mapping of mappings"
    for section in NUMERIC_SECTIONS:
        for key, value in metrics.get(section, {}).items():
            if value is not None and not _is_number(value):
                return f"summary.json: metrics.{section}.{key} is {value!r}, not a number"
    for key in NUMERIC_FIELDS:
        if summary.get(key) is not None and not _is_number(summary[key]):
            return f"summary.json: {key} is {summary[key]!r}, not a number"
    for key in ("started_at", "finished_at"):
        if summary.get(key) is not None and not _is_time(summary[key]):
            return f"summary.json: {key} is {summary[key]!r}, not an ISO 8601 time"
    diverged = summary.get("diverged")
    if diverged is not None and not (isinstance(diverged, dict) and _is_number(diverged.get("step"))):
        return "summary.json: 'diverged' has no step"
    attempts = summary.get("attempts", [])
    if not isinstance(attempts, list) or not all(isinstance(a, dict) for a in attempts):
        return "summary.json: 'attempts' is not a list of mappings"
    for i, attempt in enumerate(attempts):
        for key in ("started_at", "finished_at"):
            if attempt.get(key) is not None and not _is_time(attempt[key]):
                return f"summary.json: attempts[{i}].{key} is {attempt[key]!r}, not an ISO 8601 time"
    return None


def config_problem(config: Any) -> str | None:
    """What makes ``config`` (a parsed ``config.yaml``) unusable by the readers, or None."""
    if not isinstance(config, dict):
        return f"config.yaml holds a {type(config).__name__}, not a mapping"
    for group in ("task", "backbone", "norm", "data"):
        if not isinstance(config.get(group), dict) or not isinstance(config[group].get("name"), str):
            return f"config.yaml has no {group}.name"
    return None


def _parsed(run_dir: Path, name: str, parse: Callable[[str], Any], check: Callable[[Any], str | None]) -> Any:
    """``<run_dir>/<name>`` parsed and checked; :class:`DamagedRecord` when it does not read back."""
    try:
        value = parse((run_dir / name).read_text())
    except FileNotFoundError:
        raise
    except (OSError, ValueError, yaml.YAMLError) as e:  # unreadable, not UTF-8, not JSON / YAML
        raise DamagedRecord(run_dir, f"{name} does not read back ({type(e).__name__}: "
                                     f"{one_line(e)[:120]})") from None
    problem = check(value)
    if problem is not None:
        raise DamagedRecord(run_dir, problem)
    return value


def read_summary(run_dir: str | Path) -> dict[str, Any]:
    """``summary.json``, checked (:class:`DamagedRecord` if it does not follow the schema); a non-finite
    metric an older writer left is read as null, its run as diverged, with a warning naming the run."""
    summary = _parsed(Path(run_dir), "summary.json", json.loads, summary_problem)
    found = settle_non_finite(summary)
    if found:
        seed = f" (seed {summary['seed']})" if summary.get("seed") is not None else ""
        log.warning("run record %s%s holds non-finite metrics (%s): read as %s", run_dir, seed,
                    ", ".join(found), summary["status"])
    return summary


_SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's: a table reads every record's


def read_config(run_dir: str | Path) -> dict[str, Any]:
    """``config.yaml``, checked (:class:`DamagedRecord` if it is not a run's resolved config)."""
    return _parsed(Path(run_dir), "config.yaml", lambda text: yaml.load(text, _SAFE_LOADER), config_problem)


def metrics_rows(run_dir: str | Path) -> tuple[list[dict[str, Any]], bool]:
    """The rows of ``metrics.jsonl`` and whether the file ends with a whole line.

    An unterminated last line is what a writer cut short leaves (a full disk, a quota, a kill): it is
    kept when it is a whole row, else dropped with a warning. Any other line that is not a JSON object
    is damage (:class:`DamagedRecord`)."""
    run_dir = Path(run_dir)
    path = run_dir / "metrics.jsonl"
    try:
        *lines, tail = path.read_bytes().split(b"\n")
    except FileNotFoundError:
        raise
    except OSError as e:
        raise DamagedRecord(run_dir, f"metrics.jsonl does not read back ({one_line(e)})") from None
    rows = []
    for number, line in enumerate(lines, start=1):
        try:
            row = json.loads(line) if line.strip() else None
        except ValueError:
            row = ""
        if row is None:
            continue
        if not isinstance(row, dict):
            raise DamagedRecord(run_dir, f"metrics.jsonl line {number} is not a JSON object")
        rows.append(row)
    if tail.strip():
        try:
            row = json.loads(tail)
        except ValueError:
            row = None
        if isinstance(row, dict):
            rows.append(row)
        else:
            log.warning("%s: dropped the unterminated last line of metrics.jsonl (%d bytes: a write cut "
                        "short by a full disk, a quota or a kill)", run_dir, len(tail))
    return rows, not tail


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The rows of ``metrics.jsonl`` (see :func:`metrics_rows`)."""
    return metrics_rows(run_dir)[0]


def logged_rows(run_dir: str | Path) -> list[dict[str, Any]] | None:
    """The rows of ``metrics.jsonl`` for a reader of many records: None when there is no such file, or --
    with a warning naming it -- when it is damaged."""
    try:
        return read_metrics(run_dir)
    except FileNotFoundError:
        return None
    except DamagedRecord as e:
        log.warning("skipping the metrics of %s: %s", e.run_dir, e.problem)
        return None


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
    """A run record found on disk. ``damage``: why it does not read back (then ``status`` is ``damaged``
    and ``run_id`` comes from its config, when that reads)."""

    dir: Path
    summary: dict[str, Any]
    damage: str | None = None
    _config: dict[str, Any] | None = None

    @property
    def run_id(self) -> str | None:
        if self.summary.get("run_id"):
            return self.summary["run_id"]
        try:
            return config_hash(self.config)
        except (UserError, FileNotFoundError):
            return None

    @property
    def status(self) -> str:
        return "damaged" if self.damage else effective_status(self.dir, self.summary)

    @property
    def config(self) -> dict[str, Any]:
        """The run's resolved config (:class:`DamagedRecord` if it does not read back)."""
        if self._config is None:
            self._config = read_config(self.dir)
        return self._config


def load_record(run_dir: str | Path, with_config: bool = False) -> Record:
    """The record in ``run_dir``, its summary checked (and its config, ``with_config``); a damaged one comes
    back with ``damage`` set, never as an exception."""
    record = Record(Path(run_dir), {})
    try:
        record.summary = read_summary(run_dir)
        if with_config:
            record.config  # noqa: B018 -- read and checked now
    except DamagedRecord as e:
        record.damage = e.problem
    except FileNotFoundError as e:
        record.damage = f"{Path(e.filename).name} is missing"
    return record


def warn_damaged(run_dir: Path, problem: str | None) -> None:
    """One line for a reader of many records that leaves a damaged one out."""
    log.warning("skipping the damaged run record %s: %s", run_dir, problem)


# directories under an output root that hold no run records (and can be large)
NOT_RECORDS = {"wandb", "mlflow", "dataset_cache", "corruption_cache", ".hydra", ".submitit", "multirun",
               "__pycache__", "analysis"}


def iter_records(root: Path, with_config: bool = False, damaged: bool = False) -> Iterator[Record]:
    """Every run record under ``root`` (a directory with a ``summary.json``), checked by :func:`load_record`.
    A damaged record is skipped with one warning naming it and what is wrong -- or, ``damaged=True``,
    yielded for the caller to show."""
    for directory, subdirs, files in os.walk(root) if root.is_dir() else ():
        subdirs[:] = sorted(d for d in subdirs if d not in NOT_RECORDS and not d.startswith(".analysis-"))
        if "summary.json" not in files:
            continue
        record = load_record(directory, with_config)
        if record.damage is None or damaged:
            yield record
        else:
            warn_damaged(record.dir, record.damage)


_RANK = {"completed": 3, "diverged": 3, "running": 2, "failed": 1, "interrupted": 1}  # running: a live one


def index_records(root: Path, with_config: bool = False, damaged: bool = False) -> dict[str, Record]:
    """``run_id -> record`` of the records under ``root`` (a result beats a failure, newer beats older; a
    damaged record, ``damaged=True``, is there only when nothing else of its run is)."""
    index: dict[str, Record] = {}
    for record in iter_records(root, with_config, damaged):
        run_id = record.run_id
        if run_id is None:  # damaged beyond telling which run it was
            warn_damaged(record.dir, record.damage)
            continue
        old = index.get(run_id)
        key = (_RANK.get(record.status, 0), record.summary.get("finished_at") or "")
        if old is None or key > (_RANK.get(old.status, 0), old.summary.get("finished_at") or ""):
            index[run_id] = record
    return index
