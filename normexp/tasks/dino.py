"""DINO pre-training (``task=dino``; Caron et al. 2021, arXiv 2104.14294; facebookresearch/dino
``main_dino.py``): a student matches, from every view, an EMA teacher's output on the global views.

Views, loss, teacher momentum and temperature, weight-decay schedule, per-parameter clipping and the frozen
last layer follow ``main_dino.py`` (docs/self-supervision.md; their knobs are ``task.*``). The monitor is
DINO's weighted k-NN (``eval_knn.py``) on the teacher backbone's features: ``val/knn_top1`` /
``val/knn_top5``. The teacher and the centre are checkpointed, so a resumed run is the run it would have been;
fine-tuning starts from the teacher's backbone, as DINO's evaluations do.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageFilter, ImageOps
from timm.scheduler.scheduler import Scheduler
from torch import nn
from torchvision.transforms import InterpolationMode, v2
from torchvision.transforms.v2 import functional as TF

from .. import distributed
from ..config import rng
from ..data import ImageSpec, build_classification_data
from ..engine.probes import Probe, get_probes
from ..engine.trainer import Trainer
from ..errors import UserError
from ..models import backbone_arguments, build_model, create_model
from ..models.dino import DINOHead, MultiCropNetwork, interpolate_positions
from ..models.stats import count_params
from ..tracking.records import RunRecord
from . import Task, evaluated, fit_and_record, register_task

log = logging.getLogger(__name__)

BACKBONE = "backbone."


# ---------------------------------------------------------------- views
class GaussianBlur:
    """DINO's blur: with probability ``p``, a Gaussian of radius uniform in ``radius`` (PIL or tensors)."""

    def __init__(self, p: float, radius: tuple[float, float] = (0.1, 2.0)) -> None:
        self.p, self.radius = p, radius

    def __call__(self, image: Any) -> Any:
        if random.random() > self.p:
            return image
        radius = random.uniform(*self.radius)
        if isinstance(image, Image.Image):
            return image.filter(ImageFilter.GaussianBlur(radius=radius))
        size = min(2 * math.ceil(3 * radius) + 1, 2 * min(image.shape[-2:]) - 1)  # reflect padding fits
        return TF.gaussian_blur(image, kernel_size=size, sigma=radius)


class Solarization:
    """DINO's solarization with probability ``p``: values at or above the middle of the range inverted."""

    def __init__(self, p: float) -> None:
        self.p = p

    def __call__(self, image: Any) -> Any:
        if random.random() >= self.p:
            return image
        if isinstance(image, Image.Image):
            return ImageOps.solarize(image)
        return torch.where(image >= 0.5, 1 - image, image)


def dino_views(settings: Any) -> Any:
    """The multi-crop views of ``main_dino.py``'s ``DataAugmentationDINO``."""
    def transform(spec: ImageSpec) -> Any:
        flip_and_jitter = [v2.RandomHorizontalFlip(settings.hflip),
                           v2.RandomApply([v2.ColorJitter(0.4, 0.4, 0.2, 0.1)], p=0.8),
                           v2.RandomGrayscale(p=0.2)]
        normalize = [v2.ToImage(), v2.ToDtype(torch.float32, scale=True), v2.Normalize(spec.mean, spec.std)]

        def view(size: int, scale: Any, *extra: Any) -> v2.Compose:
            crop = v2.RandomResizedCrop(size, scale=tuple(scale), interpolation=InterpolationMode.BICUBIC,
                                        antialias=True)
            return v2.Compose([crop, *flip_and_jitter, *extra, *normalize])

        radius = tuple(settings.blur_radius)
        first = view(spec.img_size, settings.global_scale, GaussianBlur(1.0, radius))
        second = view(spec.img_size, settings.global_scale, GaussianBlur(0.1, radius), Solarization(0.2))
        local = view(settings.local_size, settings.local_scale, GaussianBlur(0.5, radius))
        return lambda image: [first(image), second(image),
                              *(local(image) for _ in range(settings.local_crops))]
    return transform


# ---------------------------------------------------------------- schedules and loss
def cosine_schedule(base: float, final: float, total: int, warmup: int = 0,
                    start: float = 0.0) -> np.ndarray:
    """DINO's ``utils.cosine_scheduler`` over ``total`` updates (linear warm-up, then cosine)."""
    ramp = np.linspace(start, base, warmup) if warmup > 0 else np.array([])
    rest = np.arange(total - warmup)
    cosine = final + 0.5 * (base - final) * (1 + np.cos(np.pi * rest / max(len(rest), 1)))
    return np.concatenate([ramp, cosine])


class ScheduleArray(Scheduler):
    """A per-update lr schedule given as an array (DINO's ``utils.cosine_scheduler``), in timm's scheduler
    interface, so that the trainer steps and resumes it as any other."""

    def __init__(self, optimizer: torch.optim.Optimizer, values: np.ndarray) -> None:
        self.values = values
        super().__init__(optimizer, "lr", t_in_epochs=False)
        self.update_groups(self._get_lr(0))

    def _get_lr(self, t: int) -> list[float]:
        return [float(self.values[min(t, len(self.values) - 1)])] * len(self.base_values)

    def state_dict(self) -> dict[str, Any]:
        return {k: v for k, v in super().state_dict().items() if k != "values"}  # the config makes them


def teacher_temperatures(warmup_temp: float, temp: float, warmup_epochs: int, epochs: int) -> np.ndarray:
    """Per epoch: linear from ``warmup_temp`` to ``temp`` over ``warmup_epochs`` (inclusive), then
    ``temp``."""
    warmup_epochs = min(warmup_epochs, epochs)
    return np.concatenate([np.linspace(warmup_temp, temp, warmup_epochs),
                           np.full(epochs - warmup_epochs, temp)])


class DINOLoss(nn.Module):
    """DINO's loss and centre; ``crops``: views per image, the first two global.

    The loss takes the centre as it stands; the teacher outputs it saw are summed until
    :meth:`update_center`, once per optimizer update (``DINOLoss.update_center`` of ``main_dino.py`` runs
    once per iteration over the global batch), so that accumulating k micro-batches moves the centre as one
    batch k times larger does."""

    def __init__(self, out_dim: int, crops: int, student_temp: float = 0.1,
                 center_momentum: float = 0.9) -> None:
        super().__init__()
        self.crops, self.student_temp, self.center_momentum = crops, student_temp, center_momentum
        self.register_buffer("center", torch.zeros(1, out_dim))
        self.pending_sum = torch.zeros(1, out_dim, dtype=torch.float64)
        self.pending_count = 0

    def forward(self, student: torch.Tensor, teacher: torch.Tensor, teacher_temp: float) -> torch.Tensor:
        student_views = (student / self.student_temp).chunk(self.crops)
        targets = F.softmax((teacher - self.center) / teacher_temp, dim=-1).detach().chunk(2)
        terms = [torch.sum(-q * F.log_softmax(s, dim=-1), dim=-1).mean()
                 for iq, q in enumerate(targets) for v, s in enumerate(student_views) if v != iq]
        self.accumulate(teacher)
        return sum(terms) / len(terms)

    @torch.no_grad()
    def accumulate(self, teacher: torch.Tensor) -> None:
        """Add one micro-batch's teacher outputs to those the next centre update averages."""
        self.pending_sum = self.pending_sum.to(teacher.device) + teacher.sum(dim=0, keepdim=True).double()
        self.pending_count += len(teacher)

    @torch.no_grad()
    def update_center(self) -> None:
        """One step of the centre's EMA towards the mean teacher output since the last step, over every
        process (all-reduced)."""
        if not self.pending_count:
            return
        count = torch.tensor([float(self.pending_count)], dtype=torch.float64, device=self.center.device)
        total = distributed.all_reduce_sum(self.pending_sum.to(self.center.device))
        batch_center = (total / distributed.all_reduce_sum(count)).to(self.center.dtype)
        self.center = self.center * self.center_momentum + batch_center * (1 - self.center_momentum)
        self.pending_sum = torch.zeros_like(self.pending_sum)
        self.pending_count = 0


# ---------------------------------------------------------------- k-NN monitor
@torch.no_grad()
def knn_accuracy(train: torch.Tensor, train_labels: torch.Tensor, test: torch.Tensor,
                 test_labels: torch.Tensor, num_classes: int, k: int = 20,
                 temperature: float = 0.07) -> tuple[float, float]:
    """DINO's weighted k-NN (``eval_knn.py``) on L2-normalised features: top-1 and top-5 (%)."""
    train, test = F.normalize(train, dim=1), F.normalize(test, dim=1)
    k = min(k, len(train))
    similarity, index = (test @ train.T).topk(k, dim=1)
    votes = torch.zeros(len(test), num_classes, device=test.device)
    votes.scatter_add_(1, train_labels[index], (similarity / temperature).exp())
    ranked = votes.argsort(dim=1, descending=True)
    hits = ranked == test_labels[:, None]
    top1, top5 = (hits[:, :n].any(dim=1).float().mean().item() for n in (1, min(5, num_classes)))
    return 100 * top1, 100 * top5


# ---------------------------------------------------------------- the model
def build_network(cfg: Any, drop_path: bool = True) -> MultiCropNetwork:
    """Student (``drop_path``) or teacher: the classifier-free backbone at any input size, and DINO's head."""
    name, kwargs = backbone_arguments(cfg.backbone)
    kwargs.update(num_classes=0, global_pool="token", dynamic_img_size=True)
    if not drop_path:
        kwargs["drop_path_rate"] = 0.0
    t = cfg.task

    def construct() -> MultiCropNetwork:
        backbone = create_model(name, **kwargs)
        if t.pos_interpolation == "dino" and hasattr(backbone, "resample_positions"):
            backbone.resample_positions = interpolate_positions  # the local crops' table, as DINO's ViT
        if getattr(backbone, "cls_token", None) is not None:
            nn.init.trunc_normal_(backbone.cls_token, std=0.02)  # DINO's ViT (timm starts it at 1e-6)
        head = DINOHead(backbone.num_features, t.out_dim, t.hidden_dim, t.bottleneck_dim,
                        norm_last_layer=t.norm_last_layer)
        return MultiCropNetwork(backbone, head)

    return build_model(construct, cfg.norm, f"DINO over backbone '{name}'")


def check_dino(cfg: Any) -> None:
    """Before any work: local crops no larger than the images, which the patches tile, and the schedules."""
    t = cfg.task
    if t.local_size > cfg.data.img_size:
        raise UserError(f"task.local_size={t.local_size}: the local crops are smaller than the images "
                        f"(data.img_size={cfg.data.img_size}); use at most {cfg.data.img_size}")
    patch = cfg.backbone.get("patch_size")
    if isinstance(patch, int) and t.local_size % patch:
        raise UserError(f"task.local_size={t.local_size} is not a multiple of the patch size "
                        f"backbone.patch_size={patch}: use {t.local_size // patch * patch or patch} or "
                        f"{(t.local_size // patch + 1) * patch}")
    for key in ("global_scale", "local_scale"):
        low, high = t[key]
        if not 0 < low <= high <= 1:
            raise UserError(f"task.{key}={list(t[key])}: [min, max] areas of the crop, 0 < min <= max <= 1")
    for key, choices in (("lr_schedule", ("dino", "timm")), ("pos_interpolation", ("dino", "timm"))):
        if t[key] not in choices:
            raise UserError(f"task.{key}={t[key]}: must be one of {', '.join(choices)}")
    if t.lr_schedule == "dino" and cfg.trainer.sched_on != "update":
        raise UserError("task.lr_schedule=dino sets the lr every update (main_dino.py): set "
                        "trainer.sched_on=update, or use task.lr_schedule=timm")


class DINOTrainer(Trainer):
    """The common loop with DINO's teacher, loss, schedules and monitor."""

    def __init__(self, cfg: Any, student: MultiCropNetwork, teacher: MultiCropNetwork, data: Any,
                 record: RunRecord, settings: Any, probes: Sequence[Probe] = ()) -> None:
        self.settings = settings
        super().__init__(cfg, student, data, record, probes)
        self.teacher = teacher.to(self.device)
        self.teacher.load_state_dict(self.module.state_dict())
        self.teacher.requires_grad_(False)
        self.loss = DINOLoss(settings.out_dim, 2 + settings.local_crops, settings.student_temp,
                             settings.center_momentum).to(self.device)
        total = cfg.epochs * self.updates_per_epoch
        self.weight_decays = cosine_schedule(cfg.weight_decay, settings.weight_decay_end, total)
        self.momenta = cosine_schedule(settings.momentum_teacher, 1.0, total)
        self.teacher_temps = teacher_temperatures(settings.warmup_teacher_temp, settings.teacher_temp,
                                                  settings.warmup_teacher_temp_epochs, cfg.epochs)
        # by index: a resume's optimizer.load_state_dict puts new group dicts in place of these
        self.decayed = [i for i, g in enumerate(self.optimizer.param_groups) if g["weight_decay"] > 0]

    def build_scheduler(self) -> Any:
        """``task.lr_schedule=dino``: ``main_dino.py``'s lr, a linear warm-up ``np.linspace(warmup_lr, lr,
        W)`` over W updates then a cosine to ``min_lr`` (``utils.cosine_scheduler``); ``timm``: the
        trainer's."""
        if self.settings.lr_schedule != "dino":
            return super().build_scheduler()
        cfg = self.cfg
        ends = self.scaled_lr if cfg.get("lr_scale_warmup_min", True) else float
        warmup = cfg.warmup_iters or int(cfg.warmup_epochs * self.updates_per_epoch)
        values = cosine_schedule(self.scaled_lr(cfg.lr) * cfg.lr_factor, ends(cfg.min_lr),
                                 cfg.epochs * self.updates_per_epoch, warmup, start=ends(cfg.warmup_lr))
        return ScheduleArray(self.optimizer, values)

    def compute_loss(self, views: list[torch.Tensor], targets: torch.Tensor) -> torch.Tensor:
        with self.precision.autocast():
            with torch.no_grad():
                teacher = self.teacher(views[:2])  # the global views only
            student = self.model(views)
            return self.loss(student.float(), teacher.float(), float(self.teacher_temps[self.epoch]))

    def prepare_step(self) -> None:
        for index in self.decayed:
            self.optimizer.param_groups[index]["weight_decay"] = float(
                self.weight_decays[min(self.update, len(self.weight_decays) - 1)])
        super().prepare_step()
        if self.epoch < self.settings.freeze_last_layer:
            for name, parameter in self.module.named_parameters():
                if "last_layer" in name:
                    parameter.grad = None

    @torch.no_grad()
    def after_update(self) -> None:
        self.loss.update_center()
        momentum = float(self.momenta[min(self.update - 1, len(self.momenta) - 1)])
        for student, teacher in zip(self.module.parameters(), self.teacher.parameters(), strict=True):
            teacher.mul_(momentum).add_(student.detach(), alpha=1 - momentum)
        super().after_update()

    @torch.no_grad()
    def features(self, loader: Any) -> tuple[torch.Tensor, torch.Tensor]:
        self.teacher.eval()
        found, labels = [], []
        for batch in loader:
            if batch is None:
                continue
            found.append(self.teacher.backbone(batch[0].to(self.device)).float())
            labels.append(batch[1].to(self.device))
        self.teacher.train()
        parts = distributed.all_gather_objects((torch.cat(found).cpu(), torch.cat(labels).cpu()))
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])

    def evaluate(self, model: nn.Module, prefix: str) -> dict[str, float]:
        bank, bank_labels = self.features(self.data.train_eval)
        test, test_labels = self.features(self.data.val)
        top1, top5 = knn_accuracy(bank, bank_labels, test, test_labels, self.data.num_classes,
                                  self.settings.knn_k, self.settings.knn_temperature)
        return {f"{prefix}/knn_top1": top1, f"{prefix}/knn_top5": top5}

    def task_state(self) -> dict[str, Any]:
        return {"teacher": self.teacher.state_dict(), "center": self.loss.center.cpu()}

    def load_task_state(self, state: dict[str, Any] | None) -> None:
        if state is not None:
            self.teacher.load_state_dict(state["teacher"])
            self.loss.center.copy_(state["center"])


def run_dino(cfg: Any, record: RunRecord) -> dict[str, Any]:
    data = build_classification_data(cfg.data, cfg.seed, train_transform=dino_views(cfg.task),
                                     eval_train=True)
    student, teacher = build_network(cfg), build_network(cfg, drop_path=False)
    record.update(params=count_params(student), backbone_params=count_params(student.backbone))
    log.info("DINO over %s with norm=%s: %.2fM params (backbone %.2fM), %d + %d views", cfg.backbone.name,
             cfg.norm.name, record.summary["params"] / 1e6, record.summary["backbone_params"] / 1e6, 2,
             cfg.task.local_crops)
    trainer = DINOTrainer(cfg.trainer, student, teacher, data, record, cfg.task,
                          get_probes(cfg.task.get("probes")))
    return fit_and_record(trainer, record, cfg)


def teacher_backbone(state: dict[str, Any], ema: bool | None) -> tuple[dict[str, Any], str]:
    """The teacher's backbone in a DINO checkpoint: what DINO's evaluations start from."""
    teacher = (state.get("task") or {}).get("teacher")
    if teacher is None:
        raise UserError("the DINO checkpoint holds no teacher")
    return {k.removeprefix(BACKBONE): v for k, v in teacher.items() if k.startswith(BACKBONE)}, "teacher"


def metric_names(values: dict[str, Any]) -> list[str]:
    return evaluated(values, ["knn_top1", "knn_top5"])


def dino_settings(values: dict[str, Any]) -> dict[str, Any]:
    t = values["task"]
    return {"views": f"2x{values['data'].get('img_size')}+{t['local_crops']}x{t['local_size']}",
            "out_dim": t["out_dim"], "teacher_temp": f"{t['warmup_teacher_temp']}->{t['teacher_temp']}"}


# a temperature divides the logits, the k-NN needs a neighbour, the head a width (main_dino.py's arguments)
RANGES = {
    **{key: rng(above=0, type=float) for key in ("student_temp", "teacher_temp", "warmup_teacher_temp",
                                                 "knn_temperature")},
    **{key: rng(1, type=int) for key in ("out_dim", "hidden_dim", "bottleneck_dim", "knn_k", "local_size")},
    **{key: rng(0, type=int) for key in ("local_crops", "freeze_last_layer", "warmup_teacher_temp_epochs")},
    **{key: rng(0, 1, type=float) for key in ("momentum_teacher", "center_momentum", "hflip")},
    "weight_decay_end": rng(0, type=float),
}

register_task(Task("dino", run_dino, data=("digits", "imagenet"), metrics=metric_names, check=check_dino,
                   build=build_network,
                   backbone_weights=teacher_backbone, settings=dino_settings,
                   backbone_model=lambda cfg: build_network(cfg, drop_path=False).backbone, ranges=RANGES))
