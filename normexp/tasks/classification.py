"""ImageNet-style classification: build data and model, train with the common loop, record (and optionally
evaluate the final model on corruptions: ``task.robustness.enabled=true``)."""

from __future__ import annotations

import logging
from typing import Any

from .. import distributed
from ..data import build_classification_data
from ..engine.trainer import Trainer
from ..errors import UserError
from ..models import build_backbone
from ..models.stats import count_gmacs, count_params
from ..tracking.records import RunRecord
from .robustness import check_robustness_settings, evaluate_robustness

log = logging.getLogger(__name__)


def unreadable_images(data: Any) -> list[str]:
    """The files the loaders of every process skipped as unreadable (``data.on_bad_image=skip``)."""
    files = {f for loader in (data.train, data.val) for f in getattr(loader.dataset, "bad_files", list)()}
    return sorted(set().union(*distributed.all_gather_objects(files)))


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
    trainer = Trainer(cfg.trainer, model, data, record)
    try:
        metrics = trainer.fit()
    finally:  # also in a record that ends diverged or failed
        bad = unreadable_images(data)
        record.update(bad_images=len(bad), **({"bad_image_files": bad[:20]} if bad else {}))
    record.update(metrics=metrics, images_per_s=round(trainer.images_per_s, 2))
    if robustness:  # the final model, into this record
        evaluated = trainer.ema.module if settings.ema else trainer.module
        metrics["robustness"] = evaluate_robustness(
            settings, cfg.data, evaluated, record, trainer.precision, progress=trainer.progress,
            first_step=trainer.update + 1, epoch=cfg.trainer.epochs)
        record.update(metrics=metrics)
    return metrics
