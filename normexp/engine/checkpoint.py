"""Checkpoints written atomically: a crash mid-save never leaves a half-written file behind."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import yaml

from ..errors import UserError


def save_checkpoint(path: str | Path, state: dict[str, Any]) -> None:
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Load a checkpoint file, or the ``checkpoint.pth`` of a run directory."""
    path = Path(path)
    if path.is_dir():
        path = path / "checkpoint.pth"
    if not path.is_file():
        raise UserError(f"no checkpoint at '{path}': give a run directory or a .pth file")
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # corrupt or foreign file
        raise UserError(f"cannot read checkpoint '{path}': {e}") from e


def load_model_state(model: torch.nn.Module, state_dict: dict[str, Any], source: str) -> None:
    """Load weights strictly, turning a shape/key mismatch into one clear line."""
    try:
        model.load_state_dict(state_dict, strict=True)
    except RuntimeError as e:
        first = str(e).strip().splitlines()
        detail = " ".join(line.strip() for line in first[:3])
        raise UserError(f"checkpoint '{source}' does not match the configured model: {detail[:400]}") from e


def checkpoint_run_config(source: str | Path) -> dict[str, Any] | None:
    """The resolved config of the run that wrote a checkpoint (None for a foreign file without one)."""
    path = Path(source)
    if (path / "config.yaml").is_file():
        return yaml.safe_load((path / "config.yaml").read_text())
    state = load_checkpoint(path)
    return state.get("config") if isinstance(state, dict) else None
