"""What the training command says: Hydra's composition errors as one line, the run's outcome, and how to
continue an interrupted run."""

from __future__ import annotations

import difflib
import os
import re
import shlex
import sys
from pathlib import Path
from typing import Any

from hydra.errors import HydraException, MissingConfigException
from omegaconf import DictConfig, OmegaConf

from .errors import Interrupted, UserError, storage_error

# overrides that once placed a run's directory: the run's identity names it now
DIRECTORY_OVERRIDES = ("hydra.run.dir=", "hydra.sweep.subdir=")
# Hydra's own flags that take a value (the value is no override either)
FLAGS_WITH_VALUE = ("-cp", "-cn", "-cd", "--config-path", "--config-name", "--config-dir",
                    "--experimental-rerun", "-i", "--info")


def refuse_directory_overrides(arguments: list[str]) -> None:
    """``hydra.run.dir=`` does not place a run; say where its record goes instead."""
    given = next((a for a in arguments if a.lstrip("+~").startswith(DIRECTORY_OVERRIDES)), None)
    if given is not None:
        raise UserError(f"{given}: a run's directory is named by its config, $NORMEXP_OUTPUT_DIR/<task>/"
                        "<name>-<run id>; set NORMEXP_OUTPUT_DIR to choose the root (a new run of the same "
                        "config: another seed, or trial=<n>)")


def hydra_files(cfg: DictConfig, hydra_cfg: Any) -> dict[str, str]:
    """What Hydra writes into a run's ``.hydra/`` (the composed config, Hydra's own, the overrides)."""
    return {".hydra/config.yaml": OmegaConf.to_yaml(cfg),
            ".hydra/hydra.yaml": OmegaConf.to_yaml(OmegaConf.create({"hydra": hydra_cfg})),
            ".hydra/overrides.yaml": OmegaConf.to_yaml(OmegaConf.create(list(hydra_cfg.overrides.task)))}


def report(cfg: DictConfig, summary: dict[str, Any], run_dir: Path, started: bool) -> float | None:
    """The run's last lines; returns its best metric (for Hydra's sweepers)."""
    if not started:
        print(f"run record: {run_dir} -- already {summary['status']} with this config; nothing was run or "
              "changed (a new run of it: another seed, or trial=<n>)")
        return None
    print(f"run record: {run_dir}")
    if summary["status"] == "diverged":
        print(f"{summary['error']} -- recorded as a result (status 'diverged')")
        return None
    best = (summary.get("metrics") or {}).get("best", {})
    metric = cfg.trainer.get("best_metric") if "trainer" in cfg else None
    if metric and metric in best:
        print(f"best {metric}: {best[metric]:.2f} (epoch {best['epoch']})")
        return float(best[metric])
    return None


def user_error(error: Exception) -> UserError | None:
    """``error`` as a mistake the user fixes (bad input, a full or read-only disk); None for anything else."""
    if isinstance(error, UserError):
        return error
    return storage_error(error) if isinstance(error, OSError) else None


def interrupted(error: Interrupted | KeyboardInterrupt, cfg: DictConfig, run_dir: Path | None) -> int:
    """Say where an interrupted run stands and how to continue it (process 0 has its ``run_dir``); the exit
    code: 128 + the signal, as a shell reports it."""
    if run_dir is not None:
        why = str(error) or "Ctrl-C twice"
        print(f"interrupted: {why} in {run_dir}; {continue_hint(cfg)}", file=sys.stderr)
    return 128 + error.signum if isinstance(error, Interrupted) else 130


def continue_hint(cfg: DictConfig) -> str:
    """What continues an interrupted run: for a table's run its table, else the same command."""
    table = cfg.get("table") or {}
    if table.get("id"):
        return f"rerun the table to continue it (normexp table run {table.id} --scale {table.scale})"
    program = "python -m normexp" if Path(sys.argv[0]).name == "__main__.py" else Path(sys.argv[0]).name
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        program = "torchrun <its options> -m normexp"
    return f"the same command continues it: {program} {shlex.join(sys.argv[1:])}".rstrip()


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
