"""Tasks: each takes the resolved config and the run record, and returns its metrics."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .classification import run_classification

TASKS: dict[str, Callable[..., dict[str, Any]]] = {
    "classification": run_classification,
}
