"""One entry for every task: validate, decide how the run starts, record, dispatch (no Hydra here).

A refusal is harmless because of the order: the config is validated and prepared by its task, and the model it
trains (``Task.build``) built once on the meta device; process 0 claims the run's directory
(:mod:`normexp.tracking.run_dir`) and decides the start (:func:`decide_start`: afresh, resumed from a verified
checkpoint, already done, or refused) -- reading only; then the record is written and the task runs into it.
In a distributed job every process runs this and follows process 0's decision.
"""

from __future__ import annotations

import glob
import importlib
import logging
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from . import distributed
from .engine.checkpoint import checkpoint_file, load_checkpoint
from .errors import Diverged, Interrupted, UserError, one_line, storage_error
from .preflight import resolve, validate
from .tasks import get_task
from .tasks.pretrained import source_run
from .tracking import LOGGER_CLASSES
from .tracking.lock import RunLock
from .tracking.provenance import IDENTITY_DEFAULTS, NON_IDENTITY_KEYS, config_hash, flatten, seed_everything
from .tracking.records import (
    DONE,
    MetricsMirror,
    RunRecord,
    display_name,
    effective_status,
    load_record,
    metrics_rows,
    read_config,
    read_summary,
    remove_stale_temporaries,
    run_tags,
)
from .tracking.run_dir import run_dir as directory_of
from .tracking.run_dir import run_log

log = logging.getLogger(__name__)


def build_mirrors(cfg: DictConfig, run_dir: Path, config: dict[str, Any]) -> list[MetricsMirror]:
    """The loggers of ``cfg.logger`` (none, one or several: ``logger=[wandb,mlflow]``), each mirroring the
    record; imported only when used."""
    mirrors = []
    for name, settings in (cfg.get("logger") or {}).items():
        module, cls = LOGGER_CLASSES[name]
        mirror = getattr(importlib.import_module(module), cls)
        mirrors.append(mirror(settings, run_dir, config, name=display_name(config), tags=run_tags(config)))
    return mirrors


# ---------------------------------------------------------------- how a run starts
@dataclass
class Start:
    """How the run starts: ``fresh``, ``resume`` (from ``state``, a verified checkpoint) or ``done``."""

    kind: str
    run_dir: Path
    state: dict[str, Any] | None = None
    rows: list[dict[str, Any]] | None = None  # what metrics.jsonl is rewritten with (None: left as it is)
    summary: dict[str, Any] | None = None  # the record in the directory: returned when done, else continued


def differences(old: dict[str, Any], new: dict[str, Any], limit: int = 3) -> str:
    """The identity keys whose values differ, ``key: old -> new``, the first ``limit`` of them."""
    # a default is what its absence built; an empty mapping sets no key, as its absence
    a, b = ({**IDENTITY_DEFAULTS, **{k: v for k, v in flatten(c).items() if v != {}}} for c in (old, new))
    ignored = tuple(NON_IDENTITY_KEYS)
    keys = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)
            and not any(k == i or k.startswith(i + ".") for i in ignored)]
    shown = [f"{k}: {a.get(k, '(none)')} -> {b.get(k, '(none)')}" for k in keys[:limit]]
    return "; ".join(shown) + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


def _existing(run_dir: Path) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """The checked summary and config of the record already in ``run_dir`` (None, None: no record);
    :class:`DamagedRecord` when it does not read back."""
    summary = read_summary(run_dir) if (run_dir / "summary.json").is_file() else None
    config = read_config(run_dir) if (run_dir / "config.yaml").is_file() else None
    return summary, config


def _recorded_id(summary: dict[str, Any] | None, config: dict[str, Any] | None) -> str | None:
    return summary["run_id"] if summary else config_hash(config) if config else None


def _kept_rows(run_dir: Path, state: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The metrics rows a checkpoint covers (up to its update; checkpoints before ``update`` was stored: its
    epochs'), when ``metrics.jsonl`` holds others or ends in a line cut short -- else None (kept as it is)."""
    if not (run_dir / "metrics.jsonl").is_file():
        return None
    rows, whole = metrics_rows(run_dir)
    if state.get("update") is not None:
        until = int(state["update"])
    else:
        done = state.get("epoch", 0)
        until = max((r.get("step") or 0 for r in rows if (r.get("epoch") or 0) <= done), default=0)
    kept = [row for row in rows if (row.get("step") or 0) <= until]
    return kept if len(kept) != len(rows) or not whole else None


def done_already(run_dir: Path, run_id: str) -> Start | None:
    """``done`` when ``run_dir`` holds this run's result -- read without claiming the directory, so a result
    on storage this process cannot write is still found."""
    summary, _ = _existing(run_dir)
    if summary is not None and summary["run_id"] == run_id and summary["status"] in DONE:
        return Start("done", run_dir, summary=summary)
    return None


def decide_start(run_dir: Path, config: dict[str, Any], resume: str | None) -> Start:
    """How the run of ``config`` starts in ``run_dir`` (whose lock this process holds), or a refusal.
    Everything it needs is read and checked here, before anything is written.

    ``resume``: ``auto`` (the directory's own checkpoint, if any), a run directory or checkpoint file to
    continue from, or None (start afresh)."""
    run_id = config_hash(config)
    summary, old_config = _existing(run_dir)
    recorded = _recorded_id(summary, old_config)
    if recorded is not None and recorded != run_id:
        status = effective_status(run_dir, summary) if summary else "no summary"
        what = differences(old_config, config) if old_config else f"run_id {recorded}"
        raise UserError(f"{run_dir} holds another run ({status}; it differs in {what}): give this run a "
                        "directory of its own, or continue that one with its own config")
    if summary is not None and summary["status"] in DONE:
        return Start("done", run_dir, summary=summary)
    source = None
    if resume == "auto":
        source = run_dir if checkpoint_file(run_dir).is_file() else None
    elif resume:
        source = Path(resume)
    if source is None:  # started over: the rows of an earlier attempt go
        rows = [] if (run_dir / "metrics.jsonl").exists() else None
        return Start("fresh", run_dir, rows=rows, summary=summary)
    state = load_checkpoint(source)  # a corrupt or truncated file: one line, and the file is kept
    if checkpoint_file(source) == checkpoint_file(run_dir) and state.get("run_id") not in (None, run_id):
        raise UserError(f"the checkpoint in {run_dir} is another config's (run_id {state.get('run_id')}, "
                        f"this run's is {run_id}): give this run a directory of its own")
    return Start("resume", run_dir, state, rows=_kept_rows(run_dir, state), summary=summary)


def warn_of_namesakes(run_dir: Path, config: dict[str, Any]) -> None:
    """A fresh run beside unfinished runs of the same name (a yaml edited after an interrupt): say which
    it does not continue, and the keys their configs differ in."""
    for other in sorted(run_dir.parent.glob(f"{glob.escape(str(config.get('name')))}-*")):
        record = load_record(other, with_config=True) if other != run_dir else None
        if record is None or record.damage is not None or record.status in (*DONE, "running"):
            continue
        log.warning("not continuing the unfinished run of the same name in %s (%s): it differs in %s; this "
                    "run starts afresh (set those back to continue that one)", other, record.status,
                    differences(record.config, config))


def claim(run_dir: Path, config: dict[str, Any], resume: str | None) -> tuple[Start, RunLock | None]:
    """Process 0: ``run_dir`` claimed, and how the run starts there (a run already done needs no claim:
    nothing is written)."""
    done = done_already(run_dir, config_hash(config))
    if done is not None:
        return done, None
    lock = RunLock.acquire(run_dir)
    try:
        start = decide_start(run_dir, config, resume)
        if start.kind == "fresh":
            warn_of_namesakes(run_dir, config)
        return start, lock
    except BaseException:
        lock.release()
        raise


# ---------------------------------------------------------------- the run
@dataclass
class Outcome:
    """Where the run's record is, and whether this command started (or continued) it or found it done."""

    run_dir: Path | None = None
    started: bool = False


def run(cfg: DictConfig, directory: str | Path | None = None, outcome: Outcome | None = None,
        beside: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``cfg.task`` into its record (in ``directory``; default: the one its identity names) and return
    the summary -- the existing one when the run was already done.

    Divergence is a result: the record ends ``diverged`` and this returns normally (a sweep carries on). A
    stop signal or Ctrl-C ends it ``interrupted`` after the trainer's checkpoint (:class:`Interrupted`
    propagates). ``beside``: files (relative path -> text) process 0 writes into the run's directory when
    the run starts (the entry point's copy of Hydra's files); ``outcome`` is filled in once the start is
    decided, for the caller to report where the record is, even when the run is interrupted.
    """
    validate(cfg)
    task = get_task(cfg.task.name)
    prepared = task.prepare(cfg)
    with torch.device("meta"):  # what only the model knows, refused before anything is written
        task.build(prepared)
    # left when the run ends (Interrupted, UserError: on every process), unless the entry point joined it
    with distributed.process_group(prepared.trainer.device, ends=(UserError, Interrupted)) as world:
        config = resolve(prepared)
        run_dir = Path(directory) if directory is not None else directory_of(config)
        start = lock = refusal = None
        if not world.is_main:
            logging.getLogger().setLevel(logging.WARNING)  # one process tells the story
        else:
            try:
                start, lock = claim(run_dir, config, prepared.trainer.resume)
            except (UserError, OSError) as e:
                refusal = as_user_error(e)
        kind, why = distributed.broadcast_object((start.kind, None) if start else (None, str(refusal)))
        if why is not None:
            raise refusal if refusal is not None else UserError(why)
        cfg = prepared
        try:
            if outcome is not None and world.is_main:
                outcome.run_dir, outcome.started = run_dir, kind != "done"
            if kind == "done":
                return start.summary if start else read_summary(run_dir)
            with run_log(run_dir) if world.is_main else nullcontext():
                if world.is_main:
                    for name, text in (beside or {}).items():
                        (run_dir / name).parent.mkdir(parents=True, exist_ok=True)
                        (run_dir / name).write_text(text)
                    for path in remove_stale_temporaries(run_dir):
                        log.info("removed %s (left by a process killed while writing it)", path.name)
                # every process its own augmentation; DDP shares process 0's
                seed_everything(cfg.seed + world.rank)
                mirrors = build_mirrors(cfg, run_dir, config) if world.is_main else []
                try:
                    record = RunRecord(run_dir, config, mirrors, writes=world.is_main,
                                       rows=start and start.rows, resume_state=start and start.state,
                                       previous=start and start.summary)
                except OSError as e:
                    raise as_user_error(e) from e
                source = source_run(cfg, task)  # checked completed, or started from deliberately
                if source is not None:
                    record.update(source=source)
                return _run_task(task, cfg, record)
        finally:
            if lock is not None:
                lock.release()


def as_user_error(error: BaseException) -> BaseException:
    """A file-system error the user fixes (:func:`normexp.errors.storage_error`) as a UserError; any other
    error as it is."""
    return (storage_error(error) or error) if isinstance(error, OSError) else error


def _run_task(task: Any, cfg: DictConfig, record: RunRecord) -> dict[str, Any]:
    try:
        task.run(cfg, record)
    except Diverged as d:
        log.warning("%s: %s", cfg.name, d)
        record.log({"step": d.step, "epoch": d.epoch, "train/loss": d.loss, "diverged": True})
        last = {"last_finite": d.last_finite} if d.last_finite else {}
        record.update(metrics={**d.metrics, **last},
                      diverged={"step": d.step, "epoch": d.epoch, "loss": d.loss})
        return record.finish("diverged", error=str(d))
    except Interrupted as e:
        record.finish("interrupted", error=str(e))
        e.hand_over()  # submitit requeues the job here; otherwise the process ends with the signal's code
        raise
    except KeyboardInterrupt:  # a second Ctrl-C, or one outside the training loop
        record.finish("interrupted", error="KeyboardInterrupt: stopped at once; the run continues from its "
                      "last checkpoint")
        raise
    except BaseException as e:
        record.finish("failed", error=f"{type(e).__name__}: {one_line(e)}")
        raise
    return record.finish("completed")

