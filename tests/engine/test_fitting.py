"""The evaluation-mode training loss (Derf, arXiv 2512.10938v2, App. E, Table 13) against a direct
computation, and the option's place in a run's identity."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import quick_cfg
from omegaconf import OmegaConf

from normexp.data.digits import digits_arrays, standardisation
from normexp.engine.checkpoint import load_checkpoint
from normexp.models import build_backbone
from normexp.run import run
from normexp.tracking.provenance import config_hash


def direct_loss(cfg, weights: dict[str, torch.Tensor]) -> float:
    """Plain cross-entropy of the model in eval mode over every standardised training image, in one batch."""
    model = build_backbone(cfg.backbone, cfg.norm)
    model.load_state_dict(weights)
    arrays = digits_arrays(cfg.data.img_size, cfg.data.val_fraction, cfg.data.split_seed)
    mean, std = standardisation(arrays)
    images = torch.from_numpy((arrays["train_images"] - mean) / std)[:, None].expand(-1, 3, -1, -1)
    labels = torch.from_numpy(arrays["train_labels"]).long()
    with torch.no_grad():
        logits = model.eval()(images.float())
    return float(F.cross_entropy(logits.double(), labels, reduction="sum")) / len(labels)


def test_the_training_loss_in_eval_mode_is_plain_cross_entropy_without_drop_path_or_mixup(tmp_path):
    cfg = quick_cfg("task.eval_train_loss=true", "backbone.drop_path_rate=0.3",
                    "trainer.mixup.mixup_alpha=0.8", "trainer.smoothing=0.2", "trainer.ema.enabled=true",
                    "trainer.ema.decay=0.5", "trainer.ema.reported=true")
    summary = run(cfg, tmp_path / "run")
    final, reported = summary["metrics"]["final"], summary["metrics"]["reported"]
    state = load_checkpoint(tmp_path / "run")
    assert final["train_eval/loss"] == pytest.approx(direct_loss(cfg, state["model"]), rel=1e-5)
    assert final["ema/train_eval/loss"] == pytest.approx(direct_loss(cfg, state["ema"]), rel=1e-5)
    assert reported["train_eval_loss"] == final["ema/train_eval/loss"]  # the reported weights': the EMA's
    assert 0 <= final["train_eval/top1"] <= 100 and np.isfinite(final["train_eval/top5"])


def test_the_option_off_keeps_a_runs_identity():
    cfg = quick_cfg()
    values = OmegaConf.to_container(cfg, resolve=True)
    without = OmegaConf.to_container(cfg, resolve=True)
    del without["task"]["eval_train_loss"], without["data"]["train_fraction"]
    assert config_hash(values) == config_hash(without)
    assert config_hash(OmegaConf.to_container(quick_cfg("task.eval_train_loss=true"), resolve=True)) \
        != config_hash(values)
