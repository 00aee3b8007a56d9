"""``normexp [group=option ...] [key=value ...]``: compose the config, then run it (a Hydra app).

``normexp <command> ...`` runs one of the tools instead: ``table`` (paper tables), ``compare`` (compare run
records), ``dashboard`` (MLflow's UI over every record), ``sync`` (upload offline W&B runs), ``analyze`` (look
inside a trained run), ``figure`` (the papers' figures from their runs);
``normexp <command> --help`` says more.

Every mistake on the command line -- an unknown option or key, an override Hydra cannot parse, a value the
schema refuses -- is one ``error:`` line and exit code 2. Hydra writes nothing into the run directory before
the run starts (``hydra.output_subdir`` is null and its log file is opened lazily): once ``normexp.run`` has
decided the start, this module puts Hydra's files (``.hydra/``) and the log there, so a refused start leaves
an existing directory as it was and removes the empty one Hydra made for it.
"""

from __future__ import annotations

import difflib
import logging
import os
import re
import shlex
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException, MissingConfigException
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from . import CONFIG_DIR
from .errors import UserError, one_line, storage_error

log = logging.getLogger("normexp")

# ``normexp <command>``: tools that are not training runs (a Hydra override always contains '=').
COMMANDS = {"table": "normexp.tables.cli", "compare": "normexp.compare", "dashboard": "normexp.dashboard",
            "sync": "normexp.sync", "analyze": "normexp.analysis.cli",
            "figure": "normexp.analysis.figures"}
# overrides that place the run directory themselves: then it is used as given, never swapped for another
DIRECTORY_OVERRIDES = ("hydra.run.dir=", "hydra.sweep.dir=", "hydra.sweep.subdir=")


class _State:
    task_started = False  # from here on, an exception is the run's, not the command line's


@hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name="train")
def run_app(cfg: DictConfig) -> float | None:
    from . import distributed
    from .errors import Interrupted
    from .run import run  # heavy imports after Hydra has parsed the command line (fast --help/--cfg)

    _State.task_started = True
    hydra_cfg = HydraConfig.get()
    made = Path(hydra_cfg.runtime.output_dir)
    fresh = made.is_dir() and not any(made.iterdir())  # made by Hydra for this command
    explicit = any(o.startswith(DIRECTORY_OVERRIDES) for o in hydra_cfg.overrides.hydra)
    file_logs = _detach_file_logs(made)
    final = {"dir": made, "started": False}

    def on_start(run_dir: Path) -> None:
        final.update(dir=run_dir, started=True)
        if hydra_cfg.output_subdir is None:
            _save_hydra_files(cfg, hydra_cfg, run_dir / ".hydra")
        _attach_file_logs(file_logs, run_dir)

    try:
        summary = run(cfg, made, find_unfinished_run=fresh and not explicit, on_start=on_start)
    except (UserError, OSError) as e:
        error = e if isinstance(e, UserError) else storage_error(e)
        if error is None:  # not the user's to fix
            raise
        print(f"error: {one_line(error)}", file=sys.stderr)
        if hydra_cfg.mode == RunMode.MULTIRUN:
            error.reported = True  # type: ignore[attr-defined]
            raise error from e  # the sweep records this job as failed and carries on with the others
        sys.exit(2)
    except Interrupted as e:
        if distributed.info().is_main:
            print(f"interrupted: {e} in {final['dir']}; {continue_hint(cfg)}", file=sys.stderr)
        sys.exit(128 + e.signum)
    except KeyboardInterrupt:
        print(f"interrupted (Ctrl-C twice) in {final['dir']}; {continue_hint(cfg)} from its last checkpoint",
              file=sys.stderr)
        sys.exit(130)
    finally:  # the directory Hydra made for a start that was refused or went to an unfinished run's
        if fresh and (not final["started"] or final["dir"] != made):
            _remove_empty(made)
    run_dir = final["dir"]
    if not final["started"]:
        print(f"run record: {run_dir} -- already {summary['status']} with this config; nothing was run or "
              "changed (a new run of it: leave out hydra.run.dir)")
    else:
        log.info("run record: %s", run_dir)
        print(f"run record: {run_dir}")
    if summary["status"] == "diverged":
        print(f"{summary['error']} -- recorded as a result (status 'diverged')")
        return None
    best = (summary.get("metrics") or {}).get("best", {})
    metric = cfg.trainer.get("best_metric") if "trainer" in cfg else None
    if metric and metric in best:
        print(f"best {metric}: {best[metric]:.2f} (epoch {best['epoch']})")
        return float(best[metric])  # returned to Hydra sweepers
    return None


# ---------------------------------------------------------------- Hydra's files, once the run starts
def _detach_file_logs(run_dir: Path) -> list[logging.FileHandler]:
    """Hydra's log file handlers for ``run_dir``, taken off the root logger (and closed) until the start."""
    root = logging.getLogger()
    found = [h for h in root.handlers if isinstance(h, logging.FileHandler)
             and Path(h.baseFilename).parent == run_dir.resolve()]
    for handler in found:
        root.removeHandler(handler)
        handler.close()
    return found


def _attach_file_logs(handlers: list[logging.FileHandler], run_dir: Path) -> None:
    root = logging.getLogger()
    for old in handlers:
        new = logging.FileHandler(run_dir / Path(old.baseFilename).name, mode="a", delay=True)
        new.setFormatter(old.formatter)
        new.setLevel(old.level)
        root.addHandler(new)


def _save_hydra_files(cfg: DictConfig, hydra_cfg: Any, where: Path) -> None:
    """What Hydra writes into ``.hydra/`` (the composed config, Hydra's own, the overrides)."""
    where.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, where / "config.yaml")
    OmegaConf.save(OmegaConf.create({"hydra": hydra_cfg}), where / "hydra.yaml")
    OmegaConf.save(OmegaConf.create(list(hydra_cfg.overrides.task)), where / "overrides.yaml")


def _remove_empty(run_dir: Path) -> None:
    """The directory Hydra made for a start that went elsewhere or was refused, and its empty parents."""
    from .tracking.records import output_root

    root = output_root().resolve()
    path = run_dir.resolve()
    while True:
        try:
            path.rmdir()
        except OSError:  # not empty (another run's), or gone
            return
        path = path.parent
        if path == root or root not in path.parents:  # parents only up to the output root
            return


def continue_hint(cfg: DictConfig) -> str:
    """What continues an interrupted run: for a table's run its table, else the same command."""
    table = cfg.get("table") or {}
    if table.get("id"):
        return f"rerun the table to continue it (normexp table run {table.id} --scale {table.scale})"
    program = "python -m normexp" if Path(sys.argv[0]).name == "__main__.py" else Path(sys.argv[0]).name
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        program = "torchrun <its options> -m normexp"
    # added for ranks > 0
    hydra_args = ("hydra.output_subdir=", "hydra/job_logging=", "hydra.job_logging.", "~hydra.job_logging.")
    args = [a for a in sys.argv[1:] if not a.startswith(hydra_args)]
    return f"the same command continues it: {program} {shlex.join(args)}".rstrip()


# ---------------------------------------------------------------- command-line mistakes in one line
def hydra_error_line(error: BaseException) -> str:
    """Hydra's composition error as one line saying what is wrong and what to do."""
    if isinstance(error, MissingConfigException) and error.options is not None:
        found = re.search(r"Could not find '([^']*)'", str(error))
        group, _, option = (found.group(1) if found else "").rpartition("/")
        close = difflib.get_close_matches(option, list(error.options), n=1)
        hint = f"did you mean {group}={close[0]}? " if close else ""
        return f"{group}={option}: no such option; {hint}the options are {', '.join(error.options)}"
    key = getattr(error.__cause__, "full_key", None)
    text = str(error).strip()
    if key and "Could not override" in text:
        from .config import schema_keys, unknown_key

        if schema_keys(str(key)):  # the schema would refuse it with +, too
            return str(unknown_key(str(key)))
        value = next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith(f"{key}=")), "...")
        return f"unknown config key {key} (a key the config does not have is added with +{key}={value})"
    if "override_grammar" in text:
        bad = _unparsable_override()
        return f"cannot parse the override {bad!r}: {text.splitlines()[0]}" if bad else text.splitlines()[0]
    return " ".join(line.strip() for line in text.splitlines() if line.strip())[:400]


# Hydra's own flags that take a value (the value is no override either)
FLAGS_WITH_VALUE = ("-cp", "-cn", "-cd", "--config-path", "--config-name", "--config-dir",
                    "--experimental-rerun", "-i", "--info")


def _unparsable_override() -> str | None:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    args = sys.argv[1:]
    for i, arg in enumerate(args):
        if arg.startswith("-") or (i > 0 and args[i - 1] in FLAGS_WITH_VALUE):  # a flag, or a flag's value
            continue
        try:
            parser.parse_override(arg)
        except HydraException:
            return arg
    return None


def join_job() -> bool:
    """Before Hydra names the run directory: every process of a job must name the same one. Returns whether
    this process joined the job's process group here (then :func:`main` leaves it after the last run).

    The directory's time stamp comes from ``NORMEXP_RUN_STAMP`` (train.yaml), set here once and inherited
    by what this process launches -- SLURM jobs of a sweep, and the same jobs when they are requeued, so a
    requeued job finds its checkpoint. Under torchrun, process 0's stamp is broadcast to the others, whose
    Hydra writes no files there and logs warnings only.
    """
    os.environ.setdefault("NORMEXP_RUN_STAMP", datetime.now().strftime("%Y-%m-%d/%H-%M-%S"))
    if "RANK" not in os.environ or int(os.environ.get("WORLD_SIZE", "1")) < 2:
        return False
    from . import distributed

    cpu = any(arg in ("trainer.device=cpu", "++trainer.device=cpu") for arg in sys.argv[1:])
    world = distributed.init_distributed("cpu" if cpu else "auto")
    os.environ["NORMEXP_RUN_STAMP"] = distributed.broadcast_object(os.environ["NORMEXP_RUN_STAMP"])
    if not world.is_main:
        # stdout logging only: train.yaml's settings of the file handler would name a handler it lacks
        sys.argv += ["hydra.output_subdir=null", "hydra/job_logging=stdout",
                     "~hydra.job_logging.handlers.file", "hydra.job_logging.root.level=WARNING"]
    return distributed.joined()


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in COMMANDS:
        import importlib

        command = sys.argv.pop(1)
        sys.argv[0] = f"normexp {command}"
        importlib.import_module(COMMANDS[command]).main()
        return
    joined = join_job()
    own_full_error = "HYDRA_FULL_ERROR" in os.environ
    os.environ.setdefault("HYDRA_FULL_ERROR", "1")  # Hydra's errors reach us whole: one line each, below
    try:
        run_app()
    except UserError as e:  # a job of a sweep (already reported by it)
        if not getattr(e, "reported", False):
            print(f"error: {one_line(e)}", file=sys.stderr)
        sys.exit(2)
    except (HydraException, OmegaConfBaseException) as e:  # (MissingConfigException is an OSError too)
        if own_full_error or _State.task_started:
            raise
        print(f"error: {hydra_error_line(e)}", file=sys.stderr)
        sys.exit(2)
    except OSError as e:  # before the run: Hydra making the run directory (an output root that is a file)
        error = storage_error(e)
        if error is None:
            raise
        print(f"error: {one_line(error)}", file=sys.stderr)
        sys.exit(2)
    if joined:  # the group joined for the job's runs: left once they have all ended
        from . import distributed

        distributed.shutdown()


if __name__ == "__main__":
    main()
