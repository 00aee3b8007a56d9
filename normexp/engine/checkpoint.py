"""Checkpoint files: written atomically (temporary file, fsync, rename), read safely (every zip record checked
against its CRC-32, which torch does not check, then ``torch.load(weights_only=True)``)."""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Any

import torch

from ..errors import UserError
from ..tracking.records import read_config, write_atomic
from ..tracking.run_dir import resolve_source


class _KeepsWriteErrors:
    """A file that keeps its write errors (torch's zip writer hides what the file system said)."""

    def __init__(self, f: Any) -> None:
        self.f, self.error = f, None

    def write(self, data: Any) -> int:
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = e
            raise

    def flush(self) -> None:
        self.f.flush()


def save_checkpoint(path: str | Path, state: dict[str, Any]) -> None:
    """``state`` to ``path``, whole or not at all; a full disk or quota is the OSError it is."""
    path = Path(path)

    def write(f: Any) -> None:
        kept = _KeepsWriteErrors(f)
        try:
            torch.save(state, kept)
        except RuntimeError:
            if kept.error is None:
                raise
            raise OSError(kept.error.errno, kept.error.strerror, str(path)) from None

    write_atomic(path, write)


def damaged_record(path: Path) -> str | None:
    """The first record of the zip file ``path`` whose bytes do not match their CRC-32, or None."""
    if not zipfile.is_zipfile(path):
        return None
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()  # reads every record whole; zipfile compares each with its CRC-32
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:
        return f"its zip structure does not read ({type(e).__name__}: {str(e)[:120]})"
    if bad is not None:
        return f"record {bad} fails its CRC-32 check"
    return None


def checkpoint_file(source: str | Path) -> Path:
    """A checkpoint file, or the ``checkpoint.pth`` of a run directory (or of ``run:<run_id>``)."""
    path = resolve_source(source)
    return path / "checkpoint.pth" if path.is_dir() else path


def load_checkpoint(source: str | Path) -> dict[str, Any]:
    """Load a checkpoint file or a run directory's; a missing, truncated or foreign file is one clear line."""
    path = checkpoint_file(source)
    if not path.is_file():
        raise UserError(f"no checkpoint at '{path}': give a run directory or a .pth file")
    damage = damaged_record(path)
    if damage is not None:
        raise UserError(f"checkpoint '{path}' is damaged: {damage}. It was left as it is: restore it from a "
                        "copy, or move it away to start this run over")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated, corrupt, or holding objects weights_only refuses
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"cannot read checkpoint '{path}' ({type(e).__name__}: {first[:200]}): it is "
                        "truncated (a kill while writing?), corrupt or not a checkpoint of tensors") from e


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
    path = resolve_source(source)
    if (path / "config.yaml").is_file():
        return read_config(path)
    state = load_checkpoint(path)
    return state.get("config") if isinstance(state, dict) else None


def reported_weights(state: dict[str, Any], ema: bool | None = None) -> tuple[dict[str, Any], str]:
    """(weights, ``"ema"`` or ``"raw"``) of a training checkpoint: with ``ema=None`` those its recipe
    reports (``trainer.ema.reported``)."""
    if ema is not None and "model" in state:
        if ema and state.get("ema") is None:
            raise UserError("the checkpoint has no EMA weights (trained with trainer.ema.enabled=false)")
        return (state["ema"], "ema") if ema else (state["model"], "raw")
    if "model" not in state:
        return state, "raw"
    config = state.get("config") or {}
    reported = ((config.get("trainer") or {}).get("ema") or {}).get("reported")
    if reported and state.get("ema") is not None:
        return state["ema"], "ema"
    return state["model"], "raw"
