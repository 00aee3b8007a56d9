"""ImageNet-style classification: build data and model, train with the common loop, record."""

from __future__ import annotations

import logging
from typing import Any

from ..data import build_classification_data
from ..engine.trainer import Trainer
from ..models import build_backbone
from ..models.stats import count_gmacs, count_params
from ..tracking.records import RunRecord

log = logging.getLogger(__name__)


def run_classification(cfg: Any, record: RunRecord) -> dict[str, Any]:
    data = build_classification_data(cfg.data, cfg.seed)
    model = build_backbone(cfg.backbone, cfg.norm)
    record.update(params=count_params(model),
                  gmacs=round(count_gmacs(model, (data.in_chans, data.img_size, data.img_size)), 4))
    log.info("%s with norm=%s: %.2fM params, %.3f GMACs", cfg.backbone.name, cfg.norm.name,
             record.summary["params"] / 1e6, record.summary["gmacs"])
    trainer = Trainer(cfg.trainer, model, data, record)
    metrics = trainer.fit()
    record.update(metrics=metrics, images_per_s=round(trainer.images_per_s, 2))
    return metrics
