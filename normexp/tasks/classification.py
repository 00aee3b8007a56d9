"""ImageNet-style classification: build data and model, train with the common loop, record (and optionally
evaluate the final model on corruptions: ``task.robustness.enabled=true``).

The classifier's part of the loop follows DeiT's main.py / engine.py (and timm's train.py): Mixup/CutMix with
soft-target cross-entropy, else label smoothing, else plain cross-entropy; top-1 / top-5 accuracy.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from timm.data import Mixup
from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
from torch import nn

from ..data import build_classification_data
from ..engine.evaluate import classification_metrics, count_predictions
from ..engine.trainer import Trainer
from ..errors import UserError
from ..models import build_backbone
from ..models.stats import count_gmacs, count_params
from ..tracking.records import RunRecord
from .robustness import check_robustness_settings, evaluate_robustness

log = logging.getLogger(__name__)


def build_mixup(cfg: Any, num_classes: int) -> Mixup | None:
    """timm's Mixup/CutMix from ``trainer.mixup`` (its targets smoothed by ``trainer.smoothing``); None when
    both alphas are 0."""
    mix = cfg.mixup
    if mix.mixup_alpha <= 0 and mix.cutmix_alpha <= 0:
        return None
    return Mixup(mixup_alpha=mix.mixup_alpha, cutmix_alpha=mix.cutmix_alpha, prob=mix.prob,
                 switch_prob=mix.switch_prob, mode=mix.mode, label_smoothing=cfg.smoothing,
                 num_classes=num_classes)


def training_loss(smoothing: float, mixup: Mixup | None) -> nn.Module:
    """DeiT's choice: soft-target cross-entropy after Mixup (which already smooths the targets), else label
    smoothing, else plain cross-entropy."""
    if mixup is not None:
        return SoftTargetCrossEntropy()
    if smoothing > 0:
        return LabelSmoothingCrossEntropy(smoothing=smoothing)
    return nn.CrossEntropyLoss()


class ClassificationTrainer(Trainer):
    """The common loop with a classifier: Mixup/CutMix and the training loss above; top-1 / top-5."""

    def __init__(self, cfg: Any, model: nn.Module, data: Any, record: RunRecord) -> None:
        super().__init__(cfg, model, data, record)
        self.mixup = build_mixup(cfg, data.num_classes)
        self.train_loss = training_loss(cfg.smoothing, self.mixup)

    def compute_loss(self, images: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.mixup is not None:
            images, targets = self.mixup(images, targets)
        with self.precision.autocast():
            return self.train_loss(self.model(images), targets)

    def evaluate(self, model: nn.Module, prefix: str) -> dict[str, float]:
        """``<prefix>/loss``, ``/top1`` and ``/top5`` (with fewer than 5 classes, top-5 is top-all)."""
        topk = (1, min(5, self.data.num_classes))
        counts = count_predictions(model, self.data.val, self.precision, topk=topk, progress=self.progress,
                                   desc=prefix)
        return classification_metrics(counts, ("top1", "top5"), prefix)


def check_classification(cfg: Any) -> None:
    """Before any work: the settings of the corruption evaluation after training, when it is on."""
    settings = cfg.task.get("robustness")
    if settings is not None and settings.enabled:
        if settings.ema and not cfg.trainer.ema.enabled:
            raise UserError("task.robustness.ema=true needs trainer.ema.enabled=true")
        check_robustness_settings(settings, cfg.data)


def run_classification(cfg: Any, record: RunRecord) -> dict[str, Any]:
    data = build_classification_data(cfg.data, cfg.seed)
    model = build_backbone(cfg.backbone, cfg.norm)
    record.update(params=count_params(model),
                  gmacs=round(count_gmacs(model, (data.in_chans, data.img_size, data.img_size)), 4))
    log.info("%s with norm=%s: %.2fM params, %.3f GMACs", cfg.backbone.name, cfg.norm.name,
             record.summary["params"] / 1e6, record.summary["gmacs"])
    settings = cfg.task.get("robustness")
    robustness = settings is not None and settings.enabled
    trainer = ClassificationTrainer(cfg.trainer, model, data, record)
    metrics = trainer.fit()
    record.update(metrics=metrics, images_per_s=round(trainer.images_per_s, 2))
    if robustness:  # the final model, into this record
        evaluated = trainer.ema.module if settings.ema else trainer.module
        metrics["robustness"] = evaluate_robustness(
            settings, cfg.data, evaluated, record, trainer.precision, progress=trainer.progress,
            first_step=trainer.update + 1, epoch=cfg.trainer.epochs)
        record.update(metrics=metrics)
    return metrics
