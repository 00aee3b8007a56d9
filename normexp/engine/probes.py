"""Per-epoch probes: numbers a run adds to each epoch's row of ``metrics.jsonl``, by name (``task.probes``).

A probe is ``probe(model, val_loader, forward) -> {key: float}``; ``forward`` is the task's way of passing a
batch of images through its model (None: ``model(images)``). It must draw no random number from the training
streams and leave the model's mode as it found it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ..errors import UserError
from .activation_probe import activation_probe
from .alpha_probe import alpha_probe

Forward = Callable[[torch.Tensor], Any]
Probe = Callable[[nn.Module, Any, Forward | None], dict[str, float]]

PROBES: dict[str, Probe] = {"alpha": alpha_probe, "activations": activation_probe}


def register_probe(name: str, probe: Probe) -> Probe:
    """Make ``probe`` known as ``name`` (a plugin's; a second, different one of that name is refused)."""
    if PROBES.get(name, probe) is not probe:
        raise ValueError(f"probe '{name}' is registered twice")
    PROBES[name] = probe
    return probe


def unknown_probes(names: Any) -> str | None:
    """What is wrong with ``task.probes=names`` (a list of known probe names), or None."""
    if names is None:
        return None
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        return f"task.probes={names}: a list of probe names, e.g. [alpha]; known: {', '.join(sorted(PROBES))}"
    unknown = [n for n in names if n not in PROBES]
    if unknown:
        return f"unknown probe(s) {unknown} in task.probes; known: {', '.join(sorted(PROBES))}"
    return None


def get_probes(names: Sequence[str] | None) -> list[Probe]:
    """The probes named (``task.probes``; None: none), an unknown name refused in one line."""
    problem = unknown_probes(list(names) if names is not None and not isinstance(names, str) else names)
    if problem:
        raise UserError(problem)
    return [PROBES[name] for name in names or ()]
