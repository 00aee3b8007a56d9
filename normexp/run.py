"""One entry for every task: validate, decide how a run starts, record, dispatch. Nothing here touches Hydra.

The order is what makes a refusal harmless:

1. the config is validated (``normexp.config.validate``), the task prepares it (a checkpoint's model for
   robustness) and the model is built on the meta device -- before anything is written;
2. process 0 claims the run directory (``run.lock``, ``normexp.tracking.lock``) and decides how the run
   starts (:func:`decide_start`): afresh; resumed from a checkpoint, read and verified now; already done
   (nothing to do, nothing touched, no claim needed); or refused -- the directory holds another config's
   run, a damaged record, or a checkpoint that does not read back whole. A refusal leaves every file of
   the directory as it was;
   With ``find_unfinished`` (the run directory is one Hydra has just made for this command), an unfinished
   run of the same identity under the output root is continued in its own directory instead: rerunning the
   command that was interrupted continues it;
3. only then is the record written (:class:`RunRecord`) and the task run into it.

In a distributed job every process runs this; process 0 alone decides and writes the record, its directory
and the loggers, and every process follows its decision.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from . import distributed
from .engine.checkpoint import checkpoint_file, load_checkpoint
from .errors import Diverged, Interrupted, UserError, one_line, storage_error
from .models import check_buildable
from .preflight import resolve, validate
from .tasks import get_task
from .tracking import LOGGER_CLASSES
from .tracking.lock import RunLock, live_owner
from .tracking.provenance import IDENTITY_DEFAULTS, NON_IDENTITY_KEYS, config_hash, flatten, seed_everything
from .tracking.records import (
    DONE,
    MetricsMirror,
    Record,
    RunRecord,
    display_name,
    effective_status,
    iter_records,
    metrics_rows,
    output_root,
    read_config,
    read_summary,
    remove_stale_temporaries,
    run_tags,
)

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
                        "directory of its own (leave out hydra.run.dir), or continue that one with its own "
                        "config")
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


def find_unfinished(root: Path, config: dict[str, Any], exclude: Path) -> Record | None:
    """The latest record of ``config``'s run under ``root`` that has not finished and whose process is gone.

    Says which unfinished run it does not continue: a damaged record of this run, or -- when there is none
    to continue -- the latest unfinished run of the same name, with the keys its config differs in (a yaml
    edited after an interrupt)."""
    run_id = config_hash(config)
    same, others = [], []
    for record in iter_records(root, damaged=True):
        if record.dir.resolve() == exclude.resolve() or record.status in (*DONE, "running"):
            continue
        if record.damage is not None:
            if record.run_id == run_id:
                log.warning("not continuing the unfinished run of this config in %s: %s", record.dir,
                            record.damage)
        elif record.run_id == run_id:
            same.append(record)
        elif record.summary.get("name") == config.get("name"):
            others.append(record)
    found = max(same, key=lambda r: r.summary.get("started_at") or "", default=None)
    other = max(others, key=lambda r: r.summary.get("started_at") or "", default=None)
    if found is None and other is not None:
        try:
            what = f"it differs in {differences(other.config, config)}"
        except (UserError, FileNotFoundError) as e:  # its config is damaged, or gone
            what = one_line(e)
        log.warning("not continuing the unfinished run of the same name in %s (%s): %s; this run starts "
                    "afresh (set those back to continue that one)", other.dir, other.status, what)
    return found


def named_after(run_dir: Path, configured: str, prepared: str) -> Path:
    """A fresh run directory renamed after the model that runs, when Hydra named it after the configured
    one (``task=robustness`` evaluating a checkpoint of another model)."""
    empty = run_dir.is_dir() and not any(run_dir.iterdir())
    if configured == prepared or not run_dir.name.endswith(configured) or not empty:
        return run_dir
    new = run_dir.with_name(run_dir.name[: -len(configured)] + prepared)
    if new.exists():
        return run_dir
    run_dir.rename(new)
    return new


def untaken(run_dir: Path, run_id: str) -> Path:
    """The directory Hydra made for this command, or -- when another run started in the same second under
    the same name holds it -- a sibling named after this run's id (``<time>_<name>-<run_id[:8]>``)."""
    recorded = _recorded_id(*_existing(run_dir))
    if recorded == run_id or (recorded is None and live_owner(run_dir) is None):
        return run_dir
    return run_dir.with_name(f"{run_dir.name}-{run_id[:8]}")


def claim(run_dir: Path, config: dict[str, Any], resume: str | None,
          find: bool) -> tuple[Start, RunLock | None]:
    """Process 0: the directory this run goes to, claimed, and how it starts there (a run already done
    needs no claim: nothing is written)."""
    run_id = config_hash(config)
    if find and resume == "auto":
        unfinished = find_unfinished(output_root(), config, run_dir)
        if unfinished is not None:
            log.info("continuing the unfinished run of this config in %s (%s)", unfinished.dir,
                     unfinished.status)
            run_dir = unfinished.dir
    if find:
        run_dir = untaken(run_dir, run_id)
    done = done_already(run_dir, run_id)
    if done is not None:
        return done, None
    lock = RunLock.acquire(run_dir)
    try:
        return decide_start(run_dir, config, resume), lock
    except BaseException:
        lock.release()
        raise


# ---------------------------------------------------------------- the run
def run(cfg: DictConfig, run_dir: str | Path, find_unfinished_run: bool = False,
        on_start: Callable[[Path], None] | None = None) -> dict[str, Any]:
    """Run ``cfg.task`` in ``run_dir``; once started, the record is written whether the task completes,
    diverges or fails. Returns the summary (an existing one when the run was already done).

    Divergence is a result: the record ends ``diverged`` with the step and the last finite metrics, and
    this returns normally (exit code 0, so a sweep carries on). A stop signal or Ctrl-C ends it
    ``interrupted`` after the trainer's checkpoint (:class:`Interrupted` propagates).
    ``find_unfinished_run``: ``run_dir`` is new, made for this command -- continue the unfinished run of the
    same config instead, if there is one. ``on_start(run_dir)``: called on process 0 once the start is
    decided, before anything is written (the entry point puts Hydra's files and log there).
    """
    run_dir = Path(run_dir)
    validate(cfg)
    task = get_task(cfg.task.name)
    prepared = task.prepare(cfg)
    check_buildable(prepared.backbone, prepared.norm, dense=task.dense)
    # left when the run ends (Interrupted, UserError: on every process), unless the entry point joined it
    with distributed.process_group(prepared.trainer.device, ends=(UserError, Interrupted)) as world:
        config = resolve(prepared)
        start = lock = refusal = None
        if world.is_main:
            try:
                run_dir = named_after(run_dir, cfg.name, prepared.name)
                start, lock = claim(run_dir, config, prepared.trainer.resume, find_unfinished_run)
            except (UserError, OSError) as e:
                refusal = as_user_error(e)
        kind, where, why = distributed.broadcast_object(
            (start.kind, str(start.run_dir), None) if start else (None, None, str(refusal)))
        if why is not None:
            raise refusal if refusal is not None else UserError(why)
        cfg, run_dir = prepared, Path(where)
        try:
            if kind == "done":
                return start.summary if start else _done_summary(run_dir)
            if world.is_main:
                if on_start is not None:
                    on_start(run_dir)
                for path in remove_stale_temporaries(run_dir):
                    log.info("removed %s (left by a process killed while writing it)", path.name)
            # every process its own augmentation; DDP shares process 0's
            seed_everything(cfg.seed + world.rank)
            mirrors = build_mirrors(cfg, run_dir, config) if world.is_main else []
            try:
                record = RunRecord(run_dir, config, mirrors, writes=world.is_main, rows=start and start.rows,
                                   resume_state=start and start.state, previous=start and start.summary)
            except OSError as e:
                raise as_user_error(e) from e
            return _run_task(task, cfg, record)
        finally:
            if lock is not None:
                lock.release()


def _done_summary(run_dir: Path) -> dict[str, Any]:
    return read_summary(run_dir)


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

