"""Where a run's record lives: ``<output root>/<task>/<name>-<run_id[:8]>``, named by the run's identity.

Every process of a torchrun job, a requeued SLURM job, the same command typed again and a table's planner
compute the same directory from the config alone: nothing is searched for, stamped or broadcast.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .provenance import config_hash
from .records import output_root

LOG_FILE = "normexp.log"


def run_dir(config: dict[str, Any], root: Path | None = None) -> Path:
    """The directory of the run of ``config`` (resolved; ``name`` and ``task.name`` set) under ``root``
    (default: :func:`normexp.tracking.records.output_root`)."""
    name = str(config.get("name") or "run").replace("/", "_")
    return (root or output_root()) / config["task"]["name"] / f"{name}-{config_hash(config)[:8]}"


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
