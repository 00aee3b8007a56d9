"""Where a run's record lives: ``<output root>/<task>/<name>-<run_id[:8]>``, named by the run's identity.

Every process of a torchrun job, a requeued SLURM job, the same command typed again and a table's planner
compute the same directory from the config alone: nothing is searched for, stamped or broadcast. A run that
starts from another names it ``run:<run_id>`` (what a table's ``table:<id>`` links become), found under the
output root when it starts: its identity holds no path, so a moved or differently mounted root is the same
run.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ..errors import UserError
from .provenance import config_hash
from .records import load_record, output_root

LOG_FILE = "normexp.log"
RUN_LINK = "run:"  # task.pretrained=run:<run_id>: the run of that id under the output root
TABLE_LINK = "table:"  # task.pretrained=table:<id>: a table spec's link to another table's runs


def run_dir(config: dict[str, Any], root: Path | None = None) -> Path:
    """The directory of the run of ``config`` (resolved; ``name`` and ``task.name`` set) under ``root``
    (default: :func:`normexp.tracking.records.output_root`)."""
    name = str(config.get("name") or "run").replace("/", "_")
    return (root or output_root()) / config["task"]["name"] / f"{name}-{config_hash(config)[:8]}"


def find_run(run_id: str, root: Path | None = None) -> Path:
    """The directory of the run ``run_id`` under ``root`` (default: the output root): the
    ``<task>/<name>-<run_id[:8]>`` whose record is that run's."""
    root = root or output_root()
    if not re.fullmatch(r"[0-9a-f]{8,64}", run_id):
        raise UserError(f"{RUN_LINK}{run_id}: a run id is the hex run_id of a record's summary.json")
    for directory in sorted(root.glob(f"*/*-{run_id[:8]}")):
        if (directory / "summary.json").is_file() and load_record(directory).run_id == run_id:
            return directory
    raise UserError(f"{RUN_LINK}{run_id}: no run with that id under the output root {root}: run it first, or "
                    "set NORMEXP_OUTPUT_DIR to the root that holds it")


def resolve_source(source: str | Path) -> Path:
    """What a run starts from (``task.pretrained``, ``task.checkpoint``): the run directory of
    ``run:<run_id>`` (:func:`find_run`), else the directory or file ``source`` names."""
    text = str(source)
    if text.startswith(TABLE_LINK):
        raise UserError(f"'{text}': a {TABLE_LINK}<id> link works only inside a table spec's blocks (normexp "
                        f"table run); give a run directory, a checkpoint file or {RUN_LINK}<run_id>")
    return find_run(text[len(RUN_LINK):]) if text.startswith(RUN_LINK) else Path(text)


@contextmanager
def run_log(directory: Path) -> Iterator[None]:
    """The root logger also writes to ``directory/normexp.log`` (appended: a continued run keeps its log)
    while the block runs, in the console's format."""
    root = logging.getLogger()
    console = next((h for h in root.handlers if isinstance(h, logging.StreamHandler)
                    and not isinstance(h, logging.FileHandler)), None)
    handler = logging.FileHandler(directory / LOG_FILE, mode="a", delay=True)
    handler.setFormatter(console.formatter if console and console.formatter else
                         logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] %(message)s"))
    root.addHandler(handler)
    try:
        yield
    finally:
        root.removeHandler(handler)
        handler.close()
