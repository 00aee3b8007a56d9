"""Weights from outside normexp, for ``task.pretrained``: a timm model's pretrained weights
(``timm:<model name>[.<tag>]``, the file timm's ``pretrained=True`` reads: downloaded from the Hugging Face
on an online machine, read from its cache on an offline one, ``HF_HUB_OFFLINE=1``) or a weight file
(``.safetensors``, ``.pth``, ``.npz``) as timm's ``load_checkpoint`` reads it (timm ``models/_helpers.py``),
with the model family's ``checkpoint_filter_fn`` applied (e.g. timm ``models/vision_transformer.py``: the
position table resampled to the model's grid, big_vision ``.npz`` files through ``load_pretrained``)."""

from __future__ import annotations

import difflib
import hashlib
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import UserError

TIMM_PREFIX = "timm:"
WEIGHT_SUFFIXES = (".safetensors", ".pth", ".pt", ".bin", ".npz")
HF_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")  # what timm's hub loader looks for, in order


def is_foreign(source: Any) -> bool:
    """Whether ``source`` names weights from outside normexp: ``timm:<name>``, or a weight file that is
    neither in a run's directory nor a normexp checkpoint (which holds its run's config)."""
    text = str(source)
    if text.startswith(TIMM_PREFIX):
        return True
    path = Path(text)
    if path.suffix not in WEIGHT_SUFFIXES or not path.is_file() or (path.parent / "summary.json").is_file():
        return False
    if path.suffix in (".safetensors", ".npz"):
        return True
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # not readable as weights: the checkpoint loader says why in one line
        return False
    return not (isinstance(state, dict) and "config" in state)


def weight_file(source: str) -> tuple[Path, dict[str, Any]]:
    """The file ``source`` names (``timm:<name>``: fetched or found in the Hugging Face cache) and where it
    came from, for the run record."""
    if not source.startswith(TIMM_PREFIX):
        path = Path(source)
        if not path.is_file():
            raise UserError(f"task.pretrained: no weight file at '{source}'")
        return path, {"kind": "file"}
    import timm
    from timm.models import get_pretrained_cfg

    name = source[len(TIMM_PREFIX):]
    cfg = get_pretrained_cfg(name) if timm.is_model(name) else None
    if cfg is None:
        close = difflib.get_close_matches(name, timm.list_pretrained(), n=3)
        raise UserError(f"task.pretrained={source}: timm has no pretrained model '{name}'"
                        + (f" (did you mean {', '.join(close)}?)" if close else "")
                        + "; timm.list_pretrained() lists them")
    if cfg.hf_hub_id:
        return _from_hub(source, cfg.hf_hub_id), {"kind": "timm", "hf_hub_id": cfg.hf_hub_id}
    if cfg.url:
        from timm.models._hub import download_cached_file

        try:
            return Path(download_cached_file(cfg.url)), {"kind": "timm", "url": cfg.url}
        except Exception as e:
            raise UserError(f"task.pretrained={source}: cannot fetch {cfg.url} ({type(e).__name__}): on an "
                            "offline machine give the downloaded file's path instead") from e
    raise UserError(f"task.pretrained={source}: timm's config of '{name}' names no weights to load")


def _from_hub(source: str, repo: str) -> Path:
    from huggingface_hub import hf_hub_download

    error: Exception | None = None
    for filename in HF_WEIGHT_FILES:
        try:
            return Path(hf_hub_download(repo, filename))
        except Exception as e:  # not in the repository, or (offline) not in the cache
            error = e
    first = str(error).strip().splitlines()[0] if error and str(error).strip() else type(error).__name__
    raise UserError(f"task.pretrained={source}: cannot read {repo} from the Hugging Face Hub or its cache "
                    f"({first[:160]}); on an offline machine (HF_HUB_OFFLINE=1) fetch it first on an online "
                    f"one (python -c \"import timm; timm.create_model('{source[len(TIMM_PREFIX):]}', "
                    "pretrained=True)\") and copy the cache (HF_HOME)")


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def checkpoint_filter(model: nn.Module) -> Callable[..., dict[str, Any]] | None:
    """timm's ``checkpoint_filter_fn`` of the timm family ``model`` is built on (None for our own
    families): it maps other releases' key layouts onto timm's and resamples position tables."""
    for cls in type(model).__mro__:
        if cls.__module__.startswith("timm.models."):
            found = getattr(sys.modules[cls.__module__], "checkpoint_filter_fn", None)
            if found is not None:
                return found
    return None


def read_foreign(source: str, model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(the state dict, its provenance ``{source, kind, file, sha256, ...}``) of the foreign weights
    ``source``, read for ``model`` (the architecture with its LayerNorms, on the CPU; an ``.npz`` file is
    loaded into it by timm's ``load_pretrained``)."""
    path, where = weight_file(source)
    provenance = {"source": source, **where, "file": str(path), "sha256": sha256(path)}
    try:
        if path.suffix == ".npz":
            if not hasattr(model, "load_pretrained"):
                raise UserError(f"task.pretrained={source}: .npz weights (big_vision) load only into timm "
                                f"models with load_pretrained (ViT); {type(model).__name__} has none")
            model.load_pretrained(str(path))
            return model.state_dict(), provenance
        from timm.models import load_state_dict

        state = load_state_dict(str(path), use_ema=True)
        found = checkpoint_filter(model)
        return (found(state, model) if found is not None else state), provenance
    except UserError:
        raise
    except Exception as e:  # a file of another architecture or format
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"task.pretrained={source}: cannot read it for {type(model).__name__} "
                        f"({type(e).__name__}: {first[:200]})") from e
