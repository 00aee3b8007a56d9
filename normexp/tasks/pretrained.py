"""Starting from another run (``task.pretrained``): its backbone weights as its task reports them
(``Task.backbone_weights``), loaded so that nothing is dropped without a word: only the model's own additions
(``fresh``) keep their initialisation and only weights it has no place for by design (``dropped``, e.g. an
encoder's final norm under ``fc_norm``, as MAE's fine-tuning) go unused; any other mismatch is one line."""

from __future__ import annotations

import logging
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from timm.layers import resample_abs_pos_embed
from torch import nn
from torch.nn.utils import parametrize

from ..engine.checkpoint import checkpoint_run_config, load_checkpoint
from ..errors import UserError
from ..models import build_backbone
from ..models.base import CLASSIFICATION
from ..models.foreign import is_foreign
from ..tracking.records import effective_status, load_record
from ..tracking.run_dir import resolve_source
from . import Task, backbone_task

log = logging.getLogger(__name__)
HEAD = ("head.", "fc_norm.")  # what a classifier adds to a backbone
PARAMETRIZED = ".parametrizations."  # torch.nn.utils.parametrize's keys: <module>.parametrizations.<name>...


def source_config(source: Any, what: str, need: str = CLASSIFICATION) -> dict[str, Any] | None:
    """The one rule for reading the run a task starts from (``what``: its key): the config of the run that
    wrote ``source``, refused in one line when it holds no ``need`` model; None if it stores none (logged)."""
    trained = checkpoint_run_config(source)
    if trained is None:
        log.info("%s=%s stores no config: the configured model", what, source)
        return None
    backbone_task(trained, source, need)
    return trained


def source_run(cfg: DictConfig, task: Task) -> dict[str, Any] | None:
    """The run ``task`` starts from (its ``starts_from`` key: a run directory, ``run:<run_id>``, or a
    checkpoint file in a run's directory) and how far it got: ``{key, run, status, allow_incomplete}``; None
    when it starts from nothing or from a checkpoint outside any run's directory (no record says how far it
    got)."""
    if task.starts_from is None:
        return None
    source = OmegaConf.select(cfg, task.starts_from)
    if not source or is_foreign(source):  # weights from outside normexp: no run behind them
        return None
    path = resolve_source(source)  # run:<run_id> too
    run_dir = path if path.is_dir() else path.parent
    if not (run_dir / "summary.json").is_file():
        return None
    record = load_record(run_dir)
    status = f"damaged: {record.damage}" if record.damage else effective_status(run_dir, record.summary)
    return {"key": task.starts_from, "run": str(source), "status": status,
            "allow_incomplete": bool(cfg.task.get("allow_incomplete_source", False))}


def check_source_completed(cfg: DictConfig, task: Task) -> None:
    """Refuse, before any work, to start from a run that has not completed (still running, interrupted,
    failed, diverged): a result made from its partial weights would stand for good, since the same command
    finds it done once the source finishes. ``task.allow_incomplete_source=true`` starts from it as it is,
    deliberately (recorded, and part of the run's identity)."""
    source = source_run(cfg, task)
    if source is None or source["status"] == "completed" or source["allow_incomplete"]:
        return
    raise UserError(f"{source['key']}={source['run']} is a run that is {source['status']}, not completed: "
                    "finish it first (run its command again), or set task.allow_incomplete_source=true to "
                    "start from its weights as they are (recorded)")


def starting_weights(source: Any) -> tuple[dict[str, Any], str, str]:
    """(the backbone's weights, which weights they are, the run's task) of the run or checkpoint
    ``source``."""
    state = load_checkpoint(source)
    task = backbone_task(state.get("config"), source)
    weights, which = task.backbone_weights(state, None)
    return weights, which, task.name


def load_starting_weights(model: nn.Module, weights: dict[str, Any], source: Any, fresh: tuple[str, ...] = (),
                          dropped: tuple[str, ...] = ()) -> dict[str, list[str]]:
    """Load ``weights`` into ``model``; returns ``{"fresh": [...], "dropped": [...]}`` for the record. A
    model on the meta device is only checked (the check before any work)."""
    own = model.state_dict()
    kept = [k for k in own if k.startswith(fresh) and (k not in weights or weights[k].shape != own[k].shape)]
    missing = [k for k in own if k not in weights and k not in kept]
    unused = [k for k in weights if k not in own or k in kept]
    unexpected = [k for k in unused if not k.startswith((*dropped, *fresh))]
    wrong = [f"{k} {tuple(weights[k].shape)} vs {tuple(v.shape)}" for k, v in own.items()
             if k in weights and k not in kept and weights[k].shape != v.shape]
    if missing or unexpected or wrong:
        parts = [f"{label} {items[:3]}{' ...' if len(items) > 3 else ''}"
                 for label, items in (("missing", missing), ("unexpected", unexpected),
                                      ("shape mismatch (checkpoint vs model)", wrong)) if items]
        raise UserError(f"pretrained checkpoint '{source}' does not match the backbone "
                        f"{type(model).__name__}: " + "; ".join(parts))
    if not any(v.is_meta for v in own.values()):
        model.load_state_dict({k: v for k, v in weights.items() if k in own and k not in kept}, strict=False)
    return {"fresh": kept, "dropped": unused}


def without_source_norm(weights: dict[str, Any], trained: dict[str, Any], norm: Any,
                        device: torch.device) -> tuple[dict[str, Any], dict[str, Any], nn.Module]:
    """The backbone ``weights`` of the run ``trained`` (its resolved config) for the same backbone with the
    normalizer ``norm`` instead (``task.keep_pretrained_norm=false``): every reparametrized weight folded to
    the weight it computes in evaluation (sigma-Reparam's gamma / sigma(W) W), the source normalizer's own
    weights (DyT's alpha) dropped, the new one's (LN's after sigma-Reparam's identities) at their
    initialisation -- what DyT's release does when its MAE fine-tuning builds LN and loads with
    ``strict=False``. A LayerNorm's weight and bias become the new layer's affine where it has one under the
    same names (DyT, Derf, the point-wise family). Returns (weights, the record's ``converted``, the source
    model with its weights, in evaluation mode); on the meta device only the names."""
    with torch.device(device):
        source = build_backbone(trained["backbone"], trained["norm"])
        target = build_backbone(trained["backbone"], norm)  # the same backbone with the new normalizer
    if device.type != "meta":
        own = source.state_dict()
        source.load_state_dict({k: v for k, v in weights.items() if k in own and v.shape == own[k].shape},
                               strict=False)  # a head for other classes stays the source's fresh one
    source.eval()  # sigma-Reparam's power iteration stands still
    folded = []  # those of the weights given (not a head the source had and they lack)
    for prefix, module in source.named_modules():
        for name in list(getattr(module, "parametrizations", None) or ()):
            parametrize.remove_parametrizations(module, name, leave_parametrized=True)
            if f"{prefix}{PARAMETRIZED}{name}.original".lstrip(".") in weights:
                folded.append(f"{prefix}.{name}".lstrip("."))
    plain = source.state_dict()
    converted = {k: v for k, v in weights.items() if PARAMETRIZED not in k}  # gamma, u, sigma: folded in
    converted.update({key: plain[key] for key in folded})
    new = set(target.state_dict())
    return converted, {"from": trained["norm"]["name"], "to": norm["name"], "folded": folded,
                       "dropped": sorted(set(plain) - new), "fresh": sorted(new - set(plain))}, source


def foreign_source_config(cfg: DictConfig) -> dict[str, Any]:
    """What a foreign source (``timm:<name>``, a weight file) was trained as: this run's backbone with
    LayerNorm in every slot, at the eps the backbone suggests (timm's ViTs: 1e-6), as ``norm=ln``."""
    backbone = OmegaConf.to_container(cfg.backbone, resolve=True)
    eps = (backbone.get("norm_defaults") or {}).get("eps", 1e-6)
    return {"backbone": backbone, "norm": {"name": "ln", "eps": eps}}


def resized_position_embedding(model: nn.Module, weights: dict[str, Any]) -> dict[str, Any]:
    """``weights`` with ``pos_embed`` resampled (bicubic) to the model's grid, as MAE's
    ``interpolate_pos_embed``."""
    own = getattr(model, "pos_embed", None)
    theirs = weights.get("pos_embed")
    if own is None or theirs is None or theirs.shape == own.shape:
        return weights
    prefix = 0 if getattr(model, "no_embed_class", False) else model.num_prefix_tokens
    grid = list(model.patch_embed.grid_size)
    return {**weights, "pos_embed": resample_abs_pos_embed(theirs, grid, num_prefix_tokens=prefix)}
