"""task=dino: the loss and k-NN against hand computations, the schedules against their formulas, the teacher
(no gradient, EMA), the frozen last layer, centering over processes, every normalizer in student and teacher,
a run, fine-tuning from its teacher, exact resume, and bad input in one line."""

from __future__ import annotations

import math
import socket
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from conftest import CONFIG_DIR, quick_cfg
from process_workers import dino_center_of

from normexp.engine.checkpoint import load_checkpoint
from normexp.errors import UserError
from normexp.models import build_backbone
from normexp.norms.registry import get_norm_class
from normexp.run import run
from normexp.tasks.classification import start_from
from normexp.tasks.dino import (
    DINOLoss,
    DINOTrainer,
    build_network,
    cosine_schedule,
    knn_accuracy,
    teacher_temperatures,
)
from normexp.tracking.records import RunRecord, read_metrics

NORMS = sorted(p.stem for p in (Path(CONFIG_DIR) / "norm").glob("*.yaml"))
# the digits at 8 px (global views 4 x 4 patches), two 4 px local views (2 x 2), a small head; a tenth of the
# images to train on (5 updates of 32 an epoch), the rest validate the k-NN monitor
TINY = ["task=dino", "trainer.warmup_epochs=1", "task.local_crops=2", "task.local_size=4", "task.out_dim=64",
        "task.hidden_dim=32", "task.bottleneck_dim=16", "task.warmup_teacher_temp=0.02",
        "task.warmup_teacher_temp_epochs=2", "data.val_fraction=0.9", "data.batch_size=32"]


def dino_cfg(*overrides: str, epochs: int = 3):
    return quick_cfg(*TINY, *overrides, epochs=epochs)


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A three-epoch DINO run with DyT: (its summary, its directory)."""
    run_dir = tmp_path_factory.mktemp("dino") / "run"
    return run(dino_cfg("norm=dyt"), run_dir), run_dir


# ---------------------------------------------------------------- the pieces, against their formulas
def test_the_loss_is_the_cross_entropy_of_every_other_view_against_each_global_one():
    torch.manual_seed(0)
    batch, dim, crops = 3, 5, 3  # two global views and one local
    student, teacher = torch.randn(crops * batch, dim), torch.randn(2 * batch, dim)
    loss_fn = DINOLoss(dim, crops, student_temp=0.1, center_momentum=0.9)
    loss_fn.center.fill_(0.25)
    expected, terms = 0.0, 0
    for t in range(2):
        for s in range(crops):
            if s == t:
                continue
            for i in range(batch):
                q = F.softmax((teacher[t * batch + i] - 0.25) / 0.04, dim=0)
                log_p = F.log_softmax(student[s * batch + i] / 0.1, dim=0)
                expected += float(-(q * log_p).sum()) / batch
            terms += 1
    loss = loss_fn(student, teacher, teacher_temp=0.04)
    assert loss.item() == pytest.approx(expected / terms, rel=1e-5)
    # the centre moved to 0.9 c + 0.1 mean(teacher)
    assert torch.allclose(loss_fn.center, 0.9 * 0.25 + 0.1 * teacher.mean(dim=0, keepdim=True))


def test_the_schedules_are_dinos_formulas():
    total = 100
    lr = cosine_schedule(1.0, 0.1, total, warmup=10)
    assert lr[0] == 0 and lr[9] == 1.0 and lr[5] == pytest.approx(5 / 9)  # linspace(0, 1, 10), inclusive
    for i in (10, 55, 99):
        assert lr[i] == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * (i - 10) / 90)))
    momentum = cosine_schedule(0.996, 1.0, total)
    wd = cosine_schedule(0.04, 0.4, total)
    for i in (0, 50, 99):
        assert momentum[i] == pytest.approx(1 + 0.5 * (0.996 - 1) * (1 + math.cos(math.pi * i / 100)))
        assert wd[i] == pytest.approx(0.4 + 0.5 * (0.04 - 0.4) * (1 + math.cos(math.pi * i / 100)))
    temps = teacher_temperatures(0.04, 0.07, 50, 400)
    assert temps[0] == 0.04 and temps[49] == 0.07 and temps[25] == pytest.approx(0.04 + 0.03 * 25 / 49)
    assert (temps[50:] == 0.07).all() and len(temps) == 400


def test_knn_is_dinos_weighted_vote():
    train = torch.tensor([[1.0, 0], [0.9, 0.1], [0, 1], [0.1, 0.9], [0.6, 0.5]])
    labels = torch.tensor([0, 0, 1, 1, 2])
    test = torch.tensor([[1.0, 0.05], [0.05, 1.0], [0.55, 0.5]])
    top1, top5 = knn_accuracy(train, labels, test, torch.tensor([0, 1, 1]), 3, k=3, temperature=0.07)
    # by hand: the third image's nearest three are 2 (sim ~1), then 0 and 1 at about the same weight
    sim = F.normalize(test, dim=1) @ F.normalize(train, dim=1).T
    votes = torch.zeros(3, 3)
    for i in range(3):
        s, j = sim[i].topk(3)
        for w, n in zip(s, j, strict=True):
            votes[i, labels[n]] += math.exp(w / 0.07)
    expected = (votes.argmax(dim=1) == torch.tensor([0, 1, 1])).float().mean().item() * 100
    assert top1 == pytest.approx(expected) and top5 == 100.0


# ---------------------------------------------------------------- the networks
@pytest.mark.parametrize("norm", NORMS)
def test_every_normalizer_fills_every_slot_of_student_and_teacher_and_trains_a_step(norm):
    cfg = dino_cfg(f"norm={norm}")
    student, teacher = build_network(cfg), build_network(cfg, drop_path=False)
    for network in (student, teacher):
        placed = [n for n, m in network.named_modules() if isinstance(m, get_norm_class(norm))]
        assert len(placed) == 2 * len(network.backbone.blocks) + 1, placed
    views = [torch.randn(4, 3, 8, 8), torch.randn(4, 3, 8, 8), torch.randn(4, 3, 4, 4)]
    loss = DINOLoss(64, 3)(student(views), teacher(views[:2]).detach(), 0.04)
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is None or torch.isfinite(p.grad).all()
                                        for p in student.parameters())


def test_the_teacher_takes_no_gradient_follows_the_student_and_the_last_layer_waits(tmp_path, monkeypatch):
    """Through one real update of a run: the teacher is the EMA of the student at the schedule's momentum,
    and in the first epoch (task.freeze_last_layer=1) the last layer has not moved."""
    captured = {}
    real_after = DINOTrainer.after_update

    def after_first_update(self):
        if self.update == 1 and "teacher" not in captured:
            captured["teacher"] = {k: v.clone() for k, v in self.teacher.state_dict().items()}
            captured["student"] = {k: v.clone() for k, v in self.module.state_dict().items()}
            captured["momentum"] = float(self.momenta[0])
            captured["grads"] = [p.grad for p in self.teacher.parameters()]
        real_after(self)
        if "after" not in captured:
            captured["after"] = {k: v.clone() for k, v in self.teacher.state_dict().items()}

    monkeypatch.setattr(DINOTrainer, "after_update", after_first_update)
    run(dino_cfg("task.momentum_teacher=0.9", "trainer.warmup_epochs=0", epochs=2), tmp_path / "run")
    m = captured["momentum"]
    assert m == pytest.approx(0.9)
    for key, before in captured["teacher"].items():
        if before.is_floating_point():
            assert torch.allclose(captured["after"][key], m * before + (1 - m) * captured["student"][key],
                                  atol=1e-6), key
    assert all(g is None for g in captured["grads"])
    # the teacher was the initial student: the first step moved the student, but not its last layer
    last = "head.last_layer.parametrizations.weight.original1"
    assert torch.equal(captured["student"][last], captured["teacher"][last])
    assert not torch.equal(captured["student"]["head.mlp.0.weight"], captured["teacher"]["head.mlp.0.weight"])


# ---------------------------------------------------------------- a run, and fine-tuning from its teacher
def test_a_run_monitors_knn_and_fine_tuning_starts_from_its_teacher(pretrained, tmp_path):
    summary, run_dir = pretrained
    assert summary["status"] == "completed"
    rows = [r for r in read_metrics(run_dir) if "val/knn_top1" in r]
    assert len(rows) == 3 and all(0 <= r["val/knn_top1"] <= 100 for r in rows)
    assert any(k.startswith("alpha/backbone.blocks.0") for k in rows[-1])
    cfg = quick_cfg(f"task.pretrained={run_dir}")
    from normexp.tasks import prepare_config

    cfg = prepare_config(cfg)
    model = build_backbone(cfg.backbone, cfg.norm)
    record = RunRecord(tmp_path / "ft", {}, writes=False)
    start_from(model, cfg, record)
    teacher = load_checkpoint(run_dir)["task"]["teacher"]
    own = model.state_dict()
    backbone = {k.removeprefix("backbone."): v for k, v in teacher.items() if k.startswith("backbone.")}
    assert backbone and all(torch.equal(own[k], v) for k, v in backbone.items())
    assert record.summary["pretrained"]["weights"] == "teacher"
    assert record.summary["pretrained"]["fresh"] == ["head.weight", "head.bias"]


@pytest.mark.parametrize("overrides,message", [
    (["task.local_size=5"], "task.local_size=5 is not a multiple of the patch size backbone.patch_size=2: "
                            "use 4 or 6"),
    (["task.local_scale=[0.5,0.2]"], "task.local_scale=[0.5, 0.2]: [min, max] areas of the crop"),
    (["backbone=convnext_micro"], "cannot build DINO over backbone 'convnext_micro' with norm 'ln': "),
])
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, overrides, message):
    with pytest.raises(UserError) as error:
        run(dino_cfg(*overrides), tmp_path / "run")
    assert str(error.value).startswith(message) and "\n" not in str(error.value)
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------- the centre over processes
@pytest.mark.slow
def test_the_centre_is_the_same_on_one_and_two_processes(tmp_path):
    outputs = np.random.default_rng(0).normal(size=(8, 6)).astype(np.float32)
    centres = []
    for world in (1, 2):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        result = str(tmp_path / f"centre{world}.npy")
        mp.start_processes(dino_center_of, args=(world, port, outputs, result), nprocs=world,
                           start_method="spawn")
        centres.append(np.load(result))
    assert np.allclose(centres[0], centres[1], atol=1e-7)
    assert np.allclose(centres[0], 0.1 * outputs.mean(axis=0, keepdims=True), atol=1e-7)
