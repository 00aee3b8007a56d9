"""The detection 1x schedule through the common trainer: warm-up in iterations, step decay at epochs 8
and 11, and weight decay on every parameter when the recipe asks for it."""

from __future__ import annotations

import pytest
from conftest import quick_cfg
from omegaconf import OmegaConf

from normexp.data import build_classification_data
from normexp.engine.trainer import Trainer
from normexp.models import build_backbone
from normexp.tracking.records import RunRecord


def trainer_for(tmp_path, *overrides):
    cfg = quick_cfg("trainer=detection_1x", "trainer.epochs=12", *overrides)
    record = RunRecord(tmp_path / "run", OmegaConf.to_container(cfg, resolve=True))
    model = build_backbone(cfg.backbone, cfg.norm)
    return Trainer(cfg.trainer, model, build_classification_data(cfg.data, 0), record)


def lr_at(trainer, step):
    trainer.scheduler.step_update(step)
    return trainer.optimizer.param_groups[0]["lr"]


def test_warmup_iterations_then_steps_at_epochs_8_and_11(tmp_path):
    trainer = trainer_for(tmp_path, "trainer.warmup_iters=30")
    per_epoch = trainer.updates_per_epoch
    assert lr_at(trainer, 0) == pytest.approx(1e-7)
    assert lr_at(trainer, 15) == pytest.approx(1e-7 + (1e-4 - 1e-7) / 2)
    assert lr_at(trainer, 30) == pytest.approx(1e-4)
    # timm's multistep applies a milestone from the last update before it (bisect_right(milestones, t + 1))
    assert lr_at(trainer, 8 * per_epoch - 2) == pytest.approx(1e-4)
    assert lr_at(trainer, 8 * per_epoch) == pytest.approx(1e-5)
    assert lr_at(trainer, 11 * per_epoch) == pytest.approx(1e-6)


def test_decay_on_every_parameter_only_when_asked(tmp_path):
    def decays(trainer):
        return {g["weight_decay"] for g in trainer.optimizer.param_groups}

    trainer = trainer_for(tmp_path)  # mmdet's 1x: norms, biases, position embedding decay too
    assert decays(trainer) == {1e-4}
    groups = trainer.optimizer.param_groups
    assert sum(len(g["params"]) for g in groups) == len(list(trainer.model.parameters()))
    exempt = trainer_for(tmp_path, "trainer.decay_norm_and_bias=false")
    no_decay = {id(p) for g in exempt.optimizer.param_groups if g["weight_decay"] == 0 for p in g["params"]}
    model = exempt.model
    assert id(model.pos_embed) in no_decay and id(model.norm.weight) in no_decay  # no_weight_decay(), 1-D
    assert id(model.head.weight) not in no_decay


@pytest.mark.parametrize("scale_floor", [True, False])
def test_warmup_and_min_lr_scale_with_the_batch_only_when_asked(tmp_path, scale_floor):
    """DeiT's / the DTN code's main.py scale only the peak lr by batch / 512; Swin's scales all three."""
    trainer = trainer_for(tmp_path, "trainer=default", "trainer.epochs=4", "trainer.warmup_epochs=1",
                          "trainer.lr=5e-4", "trainer.lr_base_size=512", "trainer.warmup_lr=1e-6",
                          "trainer.min_lr=1e-5", f"trainer.lr_scale_warmup_min={scale_floor}")
    factor = trainer.data.train.batch_size / 512
    floor = factor if scale_floor else 1.0
    assert all(v == pytest.approx(5e-4 * factor) for v in trainer.scheduler.base_values)  # the peak scales
    assert lr_at(trainer, 0) == pytest.approx(1e-6 * floor)
    assert lr_at(trainer, 10 ** 6) == pytest.approx(1e-5 * floor)
