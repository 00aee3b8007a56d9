"""Load a trained run and analyse it: the numbers behind ``normexp analyze`` and ``make figure-*``.
:func:`load_run` rebuilds the backbone from the run's record (the weights its task reports);
:func:`analyse` runs seeded validation images through it once, as its task feeds it, with every requested
analysis hooked."""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from torch import nn

from ..engine.activation_probe import ActivationRecorder
from ..engine.alpha_probe import ALPHA_KEY, STD_KEY
from ..engine.checkpoint import load_checkpoint, load_model_state
from ..errors import UserError
from ..models import build_backbone
from ..norms.placement import norm_slot_names
from ..tracking.records import logged_rows, read_config, read_summary
from .attention import AttentionRecorder, AttentionResult
from .io import IOSampler, SlotSample, io_numbers, scalar_alpha
from .slots import hooked_slots
from .tokens import TokenMaps, TokenRecorder, default_token_slot

ANALYSES = ("io", "alpha", "tokens", "attention", "activations")
BATCH = 32
MAX_IO_SLOTS = 36  # panels of the io figure of one run (evenly spaced in depth beyond that)


@dataclass
class LoadedRun:
    dir: Path
    config: dict[str, Any]
    summary: dict[str, Any]
    model: nn.Module
    ema: bool
    epoch: int | None

    @property
    def norm(self) -> str:
        return str(self.config["norm"]["name"])

    @property
    def backbone(self) -> str:
        return str(self.config["backbone"]["name"])

    @property
    def top1(self) -> float | None:
        final = (self.summary.get("metrics") or {}).get("final") or {}
        value = final.get("ema/val/top1") if self.ema else None
        return value if value is not None else final.get("val/top1")


def load_run(run_dir: str | Path, ema: bool | None = None) -> LoadedRun:
    """The trained model of ``run_dir``; a missing checkpoint or a failed run raises a one-line UserError."""
    from ..tasks import get_task

    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise UserError(f"'{run_dir}' is not a run directory (no config.yaml)")
    config = read_config(run_dir)  # a damaged record: one line saying what is wrong
    summary = read_summary(run_dir) if (run_dir / "summary.json").is_file() else {}
    status = summary.get("status", "unknown")
    if status == "diverged":
        raise UserError(f"run '{run_dir}' diverged ({summary.get('error', 'non-finite loss')}): its weights "
                        "are not a trained model, nothing to analyse")
    if status == "failed":
        raise UserError(f"run '{run_dir}' failed ({summary.get('error', 'no error recorded')}): nothing to "
                        "analyse")
    task = get_task(config["task"]["name"])
    if task.backbone_weights is None:
        raise UserError(f"run '{run_dir}' is a {task.name} run: its checkpoint holds no backbone to analyse "
                        "(analyse the run it starts from)")
    if not (run_dir / "checkpoint.pth").is_file():
        raise UserError(f"run '{run_dir}' has no checkpoint.pth (trained with trainer.checkpoint=false, or "
                        "still in its first epoch): nothing to analyse")
    state = load_checkpoint(run_dir)
    weights, which = task.backbone_weights(state, ema)
    # the model they fill: an MAE's encoder, a DINO teacher's backbone; else the configured classifier
    model = task.backbone_model(OmegaConf.create(config)) if task.backbone_model is not None \
        else build_backbone(config["backbone"], config["norm"])
    load_model_state(model, weights, str(run_dir))
    use_ema = which == "ema"
    return LoadedRun(run_dir, config, summary, model.eval(), use_ema, state.get("epoch"))


def status_note(run: LoadedRun) -> list[str]:
    """What to know about a run that has not completed (its last checkpoint is what is analysed)."""
    status = run.summary.get("status", "unknown")
    if status == "completed":
        return []
    return [f"the run's status is '{status}': its last checkpoint (epoch {run.epoch}) is analysed"]


def sample_images(config: dict[str, Any], count: int, seed: int, transform: Any = None
                  ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """``count`` validation images of the run's data with their labels, seeded by ``seed``."""
    from ..data import build_classification_data

    data_cfg = OmegaConf.create(config["data"])
    dataset = build_classification_data(data_cfg, int(config.get("seed", 0)),
                                        eval_transform=transform).val.dataset
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(dataset), generator=generator).tolist()
    images, labels, indices = [], [], []
    for i in order:
        item = dataset[i]
        if item is None:  # unreadable image
            continue
        images.append(item[0])
        labels.append(int(item[1]))
        indices.append(i)
        if len(images) == count:
            break
    if not images:
        raise UserError("the run's validation set has no readable image")
    return torch.stack(images), torch.tensor(labels), indices


@dataclass
class AlphaLayer:
    slot: str
    alpha: float
    input_std: float

    @property
    def inverse_std(self) -> float:
        return 1 / self.input_std if self.input_std else math.nan


class StdRecorder:
    """Forward-hook callback: the std of each slot's input over every element of every batch (unbiased)."""

    def __init__(self) -> None:
        self.sums: dict[str, list[float]] = {}

    def __call__(self, name: str, _module: nn.Module, x: torch.Tensor, _y: torch.Tensor) -> None:
        x = x.detach().double()
        s = self.sums.setdefault(name, [0.0, 0.0, 0.0])
        s[0] += float(x.sum())
        s[1] += float((x * x).sum())
        s[2] += x.numel()

    def std(self, name: str) -> float:
        total, squares, n = self.sums[name]
        return math.sqrt(max(squares - total * total / n, 0.0) / max(n - 1, 1))


@dataclass
class RunAnalysis:
    """What :func:`analyse` found in one run (each part None when not asked for)."""

    run: LoadedRun
    image_size: tuple[int, int]
    image_indices: list[int]
    images: torch.Tensor
    slots: list[str]
    inputs: str = ""  # how the model saw the images, in words (Task.model_input; empty: as they are)
    io: dict[str, SlotSample] | None = None
    io_numbers: list[dict[str, Any]] | None = None
    alpha: list[AlphaLayer] | None = None
    alpha_history: dict[str, list[tuple[int, float, float]]] | None = None
    tokens: TokenMaps | None = None
    attention: AttentionResult | None = None
    activations: list[dict[str, Any]] | None = None  # per slot, in depth order (:mod:`.activations`)
    notes: dict[str, list[str]] = field(default_factory=dict)


def alpha_history(run_dir: Path) -> dict[str, list[tuple[int, float, float]]]:
    """Per slot, ``(epoch, alpha, input std)`` from the epoch rows of ``metrics.jsonl``."""
    history: dict[str, list[tuple[int, float, float]]] = {}
    for row in logged_rows(run_dir) or []:
        for key, value in row.items():
            if key.startswith(ALPHA_KEY) and row.get("epoch") is not None:
                slot = key[len(ALPHA_KEY):]
                std = row.get(STD_KEY + slot)
                if value is not None and std is not None:
                    history.setdefault(slot, []).append((int(row["epoch"]), float(value), float(std)))
    return history


def select_slots(slots: list[str], patterns: list[str] | None = None, count: int | None = None) -> list[str]:
    """The slots matching any fnmatch pattern (all when none), then ``count`` of them, evenly spaced."""
    import fnmatch

    chosen = [s for s in slots if not patterns or any(fnmatch.fnmatchcase(s, p) for p in patterns)]
    if count and len(chosen) > count:
        last = len(chosen) - 1
        picks = sorted({round(i * last / (count - 1)) for i in range(count)}) if count > 1 else [0]
        chosen = [chosen[i] for i in picks]
    return chosen


@torch.no_grad()
def analyse(run: LoadedRun, analyses: list[str], images: int = 16, seed: int = 0,
            io_slots: list[str] | None = None, io_points: int = 2000, token_slot: str | None = None,
            device: str = "cpu", io_patterns: list[str] | None = None, io_max: int | None = MAX_IO_SLOTS
            ) -> RunAnalysis:
    """Run ``images`` seeded validation images through ``run``'s model with the hooks of ``analyses`` on;
    io slots: ``io_slots``, else up to ``io_max`` matching ``io_patterns``, evenly spaced in depth."""
    unknown = [a for a in analyses if a not in ANALYSES]
    if unknown:
        raise UserError(f"unknown figure(s) {unknown}; available: {', '.join(ANALYSES)}")
    from ..tasks import get_task

    model = run.model.to(device).eval()
    model_input = get_task(run.config["task"]["name"]).model_input
    model_input = model_input(run.config) if model_input is not None else None
    batch, labels, indices = sample_images(run.config, images, seed,
                                           model_input.transform if model_input is not None else None)
    slots = norm_slot_names(model)
    result = RunAnalysis(run, tuple(batch.shape[-2:]), indices, batch, slots,
                         model_input.described if model_input is not None else "")
    if status_note(run):
        result.notes["run"] = status_note(run)
    callbacks: list[tuple[list[str], Any]] = []

    sampler = None
    if "io" in analyses:
        chosen = io_slots if io_slots is not None else select_slots(slots, io_patterns, io_max)
        missing = [s for s in chosen if s not in slots]
        if missing or not chosen:
            raise UserError(f"no norm slot {missing or io_patterns} in {run.backbone}; its slots: "
                            f"{', '.join(slots)}")
        sampler = IOSampler(model, chosen, points=io_points, seed=seed, total_images=len(batch))
        callbacks.append((chosen, sampler))
    alpha_slots = [s for s in slots if scalar_alpha(model.get_submodule(s)) is not None]
    stds = StdRecorder()
    if "alpha" in analyses:
        if alpha_slots:
            callbacks.append((alpha_slots, stds))
        else:
            result.notes["alpha"] = [f"{run.backbone} with norm={run.norm} has no layer with a scalar alpha "
                                     "(DyT, Derf): the alpha figure does not apply"]
    tokens = None
    if "tokens" in analyses:
        slot = token_slot or default_token_slot(model, slots)
        if slot not in slots:
            raise UserError(f"no norm slot '{slot}' in {run.backbone}; its slots: {', '.join(slots)}")
        tokens = TokenRecorder(model, slot)
        callbacks.append(([slot], tokens))
    attention = AttentionRecorder(model, result.image_size) if "attention" in analyses else None
    activations = ActivationRecorder() if "activations" in analyses else None
    if activations is not None:
        callbacks.append((slots, activations))

    def dispatch(name: str, module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
        for names, callback in callbacks:
            if name in names:
                callback(name, module, x, y)

    hooked = sorted({s for names, _ in callbacks for s in names}, key=slots.index)
    generator = torch.Generator().manual_seed(seed)  # the task's own randomness (noise, steps), if any
    with hooked_slots(model, hooked, dispatch), (attention.hooked() if attention else nullcontext()):
        for start in range(0, len(batch), BATCH):
            x, y = batch[start:start + BATCH].to(device), labels[start:start + BATCH].to(device)
            if model_input is None:
                model(x)
            else:
                model_input.forward(model, x, y, generator)

    if sampler is not None:
        result.io = sampler.samples
        result.io_numbers = [io_numbers(sampler.samples[s], model.get_submodule(s)) for s in sampler.names
                             if s in sampler.samples]
    if "alpha" in analyses and alpha_slots:
        result.alpha = [AlphaLayer(s, scalar_alpha(model.get_submodule(s)), stds.std(s)) for s in alpha_slots]
        result.alpha_history = alpha_history(run.dir)
        if not result.alpha_history and not run.epoch:
            result.notes["alpha"] = ["no epoch of this run has ended yet (alpha is logged at the end of each "
                                     "epoch): the over-training panel fills in as epochs end"]
        elif not result.alpha_history:
            result.notes["alpha"] = ["metrics.jsonl logs no alpha per epoch (a run trained before the "
                                     "per-epoch alpha log): the over-training panel is empty; re-train to "
                                     "fill it"]
    if activations is not None:
        result.activations = activations.rows()
    if tokens is not None:
        result.tokens = tokens.maps
    if attention is not None:
        result.attention = attention.finish()
        if result.attention.notes:
            result.notes["attention"] = list(result.attention.notes)
    return result
