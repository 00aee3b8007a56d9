"""Schedules through the common trainer: the detection 1x (warm-up in iterations, step decay at epochs 8 and
11, weight decay on every parameter when the recipe asks for it); per-epoch stepping with each code's lag, a
warm-up prefix, cool-down epochs, and resuming mid-epoch."""

from __future__ import annotations

import math

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


def epoch_lrs(trainer, epochs):
    """The lr each epoch trains at, as fit() sets it (sched_on=epoch)."""
    lrs = []
    for epoch in range(epochs):
        trainer.step_epoch_schedule(epoch)
        lrs.append(trainer.optimizer.param_groups[0]["lr"])
    return lrs


@pytest.mark.parametrize("lag", [0, 1])
def test_per_epoch_schedule_with_the_codes_lag(tmp_path, lag):
    """timm's train.py (the DTN code, T2T-ViT) steps the scheduler with epoch + 1 after each epoch, so epoch e
    trains at the schedule's value for e; DeiT's main.py (DeiT, PVT, LeViT) with epoch, so at e - 1 -- its
    epochs 0 and 1 both run at the warm-up lr. Within an epoch the lr does not move."""
    trainer = trainer_for(tmp_path, "trainer=default", "trainer.epochs=10", "trainer.warmup_epochs=5",
                          "trainer.lr=1e-3", "trainer.warmup_lr=1e-6", "trainer.min_lr=1e-5",
                          "trainer.sched_on=epoch", f"trainer.sched_lag={lag}")
    schedule = [1e-6 + e * (1e-3 - 1e-6) / 5 for e in range(5)]  # timm's warm-up, then the cosine from e=5
    schedule += [1e-5 + 0.5 * (1e-3 - 1e-5) * (1 + math.cos(math.pi * e / 10)) for e in range(5, 10)]
    expected = [schedule[max(e - lag, 0)] for e in range(10)]
    assert epoch_lrs(trainer, 10) == pytest.approx(expected)
    trainer.step_epoch_schedule(3)
    lr = trainer.optimizer.param_groups[0]["lr"]
    trainer.optimizer_step()  # an update inside the epoch leaves it
    assert trainer.optimizer.param_groups[0]["lr"] == lr


def test_warmup_prefix_runs_the_cosine_over_the_epochs_after_it(tmp_path):
    """ConvNeXt's utils.cosine_scheduler (DyT's recipe): linear warm-up, then a cosine over the remaining
    epochs from the peak; without the prefix (timm's default) the cosine spans all epochs."""
    overrides = ["trainer=default", "trainer.epochs=10", "trainer.warmup_epochs=2", "trainer.lr=1e-3",
                 "trainer.warmup_lr=0", "trainer.min_lr=1e-6"]
    prefixed = trainer_for(tmp_path, *overrides, "trainer.warmup_prefix=true")
    per_epoch = prefixed.updates_per_epoch
    warm, rest = 2 * per_epoch, 8 * per_epoch
    assert lr_at(prefixed, warm // 2) == pytest.approx(1e-3 / 2)
    assert lr_at(prefixed, warm) == pytest.approx(1e-3)  # the cosine starts at its peak
    assert lr_at(prefixed, warm + rest // 2) == pytest.approx((1e-3 + 1e-6) / 2)
    assert lr_at(prefixed, warm + rest) == pytest.approx(1e-6)
    overlaid = trainer_for(tmp_path, *overrides)
    assert lr_at(overlaid, warm) == pytest.approx(1e-6 + 0.5 * (1e-3 - 1e-6) * (1 + math.cos(math.pi * 0.2)))


def test_cooldown_epochs_hold_min_lr_after_the_cosine(tmp_path):
    """timm's train.py (T2T-ViT's main.py) trains num_epochs = epochs + cooldown_epochs: the cosine over
    the first 300, then 10 at min-lr. Here trainer.epochs counts them all (310)."""
    trainer = trainer_for(tmp_path, "trainer=default", "trainer.epochs=12", "trainer.cooldown_epochs=2",
                          "trainer.warmup_epochs=1", "trainer.lr=1e-3", "trainer.min_lr=1e-5",
                          "trainer.sched_on=epoch")
    lrs = epoch_lrs(trainer, 12)
    assert lrs[5] == pytest.approx(1e-5 + 0.5 * (1e-3 - 1e-5) * (1 + math.cos(math.pi * 5 / 10)))
    assert lrs[9] > 1e-5 and lrs[10:] == pytest.approx([1e-5, 1e-5])


def test_per_epoch_schedule_resumes_mid_epoch_exactly(tmp_path, monkeypatch):
    """A run stopped inside its second epoch (whose lr is the peak, the first's the warm-up lr) resumes at
    that epoch's lr: the numbers of the uninterrupted run."""
    from normexp.engine.trainer import Trainer
    from normexp.run import run

    overrides = ("trainer.sched_on=epoch", "trainer.warmup_epochs=1", "trainer.checkpoint_interval=4",
                 "data.val_fraction=0.5")  # 14 updates per epoch
    uninterrupted = run(quick_cfg(*overrides, epochs=2), tmp_path / "full")
    real_step = Trainer.optimizer_step

    def crash_mid_epoch_2(self):
        real_step(self)
        if self.epoch == 1 and self.batch == 6:  # after the checkpoint at its 4th update
            raise KeyboardInterrupt("preempted")

    monkeypatch.setattr(Trainer, "optimizer_step", crash_mid_epoch_2)
    with pytest.raises(KeyboardInterrupt):
        run(quick_cfg(*overrides, epochs=2), tmp_path / "crashed")
    monkeypatch.setattr(Trainer, "optimizer_step", real_step)
    resumed = run(quick_cfg(*overrides, f"trainer.resume={tmp_path / 'crashed'}", epochs=2),
                  tmp_path / "resumed")
    assert resumed["metrics"] == uninterrupted["metrics"]


def test_step_schedule_decays_every_decay_epochs_as_torchvisions_steplr(tmp_path):
    """torchvision's classic recipe (references/classification train.py): StepLR(step_size=30, gamma=0.1)
    stepped after each epoch, SGD momentum 0.9 without Nesterov, weight decay on every parameter; timm's
    ``step`` scheduler with ``trainer.decay_epochs`` per epoch gives the same lr in every epoch (its
    ``multistep`` would decay one epoch early per epoch: bisect_right(milestones, t + 1))."""
    import torch

    trainer = trainer_for(tmp_path, "trainer=default", "trainer.epochs=90", "trainer.opt=momentum",
                          "trainer.lr=0.1", "trainer.weight_decay=1e-4", "trainer.decay_norm_and_bias=true",
                          "trainer.sched=step", "trainer.decay_epochs=30", "trainer.warmup_epochs=0",
                          "trainer.sched_on=epoch")
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1, momentum=0.9)
    steplr = torch.optim.lr_scheduler.StepLR(optimizer, step_size=30, gamma=0.1)
    torchvision = []
    for _ in range(90):
        torchvision.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        steplr.step()
    assert epoch_lrs(trainer, 90) == pytest.approx(torchvision)
    assert torchvision[29] == pytest.approx(0.1) and torchvision[30] == pytest.approx(0.01)
    groups = trainer.optimizer.param_groups
    assert type(trainer.optimizer) is torch.optim.SGD
    assert {(g["momentum"], g["nesterov"], g["weight_decay"]) for g in groups} == {(0.9, False, 1e-4)}
    assert sum(len(g["params"]) for g in groups) == len(list(trainer.model.parameters()))
    unset = trainer_for(tmp_path, "trainer=default", "trainer.epochs=4", "trainer.sched=step",
                        "trainer.warmup_epochs=0")
    assert unset.scheduler.decay_t == 90 * unset.updates_per_epoch  # no decay_epochs: timm's 90
