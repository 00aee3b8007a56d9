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
from conftest import CONFIG_DIR, interrupted_in_epoch_2, quick_cfg
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
    # the centre moves once per update (update_center), to 0.9 c + 0.1 mean(teacher)
    assert torch.equal(loss_fn.center, torch.full((1, dim), 0.25))
    loss_fn.update_center()
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


def test_accumulating_k_micro_batches_is_one_batch_k_times_larger(tmp_path, monkeypatch):
    """DINO moves the centre once per update, from the teacher outputs of the whole global batch
    (main_dino.py, ``DINOLoss.update_center``): with ``trainer.accum_steps=4`` the first update's loss,
    gradient and centre are those of one batch four times larger."""
    seen: dict[int, dict] = {}
    real_loss, real_prepare, real_after = (DINOTrainer.compute_loss, DINOTrainer.prepare_step,
                                           DINOTrainer.after_update)

    def compute_loss(self, views, targets):
        loss = real_loss(self, views, targets)
        if self.update == 0:
            seen.setdefault(self.accum_steps, {"losses": []})["losses"].append(loss.item())
        return loss

    def prepare_step(self):
        real_prepare(self)
        if self.update == 0:
            seen[self.accum_steps]["grads"] = {n: p.grad.clone() for n, p in self.module.named_parameters()
                                               if p.grad is not None}

    def after_update(self):
        real_after(self)
        if self.update == 1:
            seen[self.accum_steps]["center"] = self.loss.center.clone()

    monkeypatch.setattr(DINOTrainer, "compute_loss", compute_loss)
    monkeypatch.setattr(DINOTrainer, "prepare_step", prepare_step)
    monkeypatch.setattr(DINOTrainer, "after_update", after_update)
    for batch, accum in ((8, 1), (2, 4)):
        run(dino_cfg(f"data.batch_size={batch}", f"trainer.accum_steps={accum}", "trainer.warmup_epochs=0",
                     epochs=1), tmp_path / f"accum{accum}")
    one, four = seen[1], seen[4]
    assert len(one["losses"]) == 1 and len(four["losses"]) == 4
    assert np.mean(four["losses"]) == pytest.approx(one["losses"][0], abs=1e-6)
    assert one["center"].abs().max() > 1e-3  # the centre moved
    torch.testing.assert_close(four["center"], one["center"], rtol=0, atol=1e-6)
    assert one["grads"].keys() == four["grads"].keys()
    for name, grad in one["grads"].items():
        torch.testing.assert_close(four["grads"][name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_the_lr_is_dinos_cosine_scheduler_per_update_and_timms_is_an_option(tmp_path, monkeypatch):
    """main_dino.py's lr: ``np.linspace(0, lr, W)`` over the W warm-up updates (the peak at update W - 1),
    then a cosine to min_lr over the rest (``utils.cosine_scheduler``); timm's warm-up (t / W) on
    request."""
    applied: dict[str, list[float]] = {}
    real_prepare = DINOTrainer.prepare_step

    def prepare_step(self):
        real_prepare(self)
        applied.setdefault(self.settings.lr_schedule, []).append(self.optimizer.param_groups[0]["lr"])

    monkeypatch.setattr(DINOTrainer, "prepare_step", prepare_step)
    for schedule in ("dino", "timm"):
        run(dino_cfg(f"task.lr_schedule={schedule}", "trainer.lr=1e-3", "trainer.min_lr=1e-5",
                     "trainer.warmup_lr=0", epochs=2), tmp_path / schedule)
    lrs = applied["dino"]
    total, warmup = len(lrs), len(lrs) // 2  # one warm-up epoch of two
    expected = [1e-3 * i / (warmup - 1) for i in range(warmup)]
    expected += [1e-5 + 0.5 * (1e-3 - 1e-5) * (1 + math.cos(math.pi * i / (total - warmup)))
                 for i in range(total - warmup)]
    assert total == 10 and lrs == pytest.approx(expected, rel=1e-9, abs=1e-12)
    assert applied["timm"][1] == pytest.approx(1e-3 / warmup)  # timm's t / W: not DINO's 1 / (W - 1)


def bicubic_by_scale(grid: np.ndarray, size: tuple[int, int], scale: tuple[float, float]) -> np.ndarray:
    """Bicubic resampling (Keys' kernel, a = -0.75, edges repeated) of a (H, W, C) grid whose output pixel i
    reads the input at ``(i + 0.5) / scale - 0.5``: what ``F.interpolate`` does when given a scale factor."""
    def kernel(t: float) -> np.ndarray:
        a = -0.75
        d = np.abs(np.array([1 + t, t, 1 - t, 2 - t]))
        return np.where(d <= 1, (a + 2) * d**3 - (a + 3) * d**2 + 1,
                        np.where(d < 2, a * d**3 - 5 * a * d**2 + 8 * a * d - 4 * a, 0.0))

    def along(values: np.ndarray, out: int, factor: float) -> np.ndarray:  # axis 0
        rows = []
        for i in range(out):
            source = (i + 0.5) / factor - 0.5
            first = math.floor(source)
            taps = np.clip(np.arange(first - 1, first + 3), 0, len(values) - 1)
            rows.append(np.tensordot(kernel(source - first), values[taps], axes=1))
        return np.stack(rows)

    return along(along(grid, size[0], scale[0]).swapaxes(0, 1), size[1], scale[1]).swapaxes(0, 1)


def test_local_crops_take_dinos_position_interpolation(tmp_path):
    """DINO's ViT meets a local crop's grid with ``interpolate_pos_encoding``: bicubic by the scale factor
    (grid + 0.1) / sqrt(N), its own table at its own size; timm's size-based, antialiased resampling
    (task.pos_interpolation=timm) gives another table."""
    tables = {}
    for mode in ("dino", "timm"):
        cfg = dino_cfg("data.img_size=16", "task.local_size=6", f"task.pos_interpolation={mode}")
        torch.manual_seed(0)
        backbone = build_network(cfg).backbone.eval()
        side, dim = 8, backbone.embed_dim  # 16 px in 2 px patches
        rows, cols = np.meshgrid(np.linspace(0, 1, side), np.linspace(0, 1, side), indexing="ij")
        smooth = np.stack([np.sin(3 * rows + k) * np.cos(2 * cols - k) for k in range(dim)], axis=-1)
        with torch.no_grad():
            backbone.pos_embed[0, 1:] = torch.from_numpy(smooth.reshape(side * side, dim)).float()
            for size in ((16, 16), (6, 6), (6, 4)):
                torch.manual_seed(size[1])
                tokens = backbone.patch_embed(torch.randn(2, 3, *size))
                plain = torch.cat([backbone.cls_token.expand(2, -1, -1), tokens.flatten(1, 2)], dim=1)
                tables[mode, size] = (backbone._pos_embed(tokens) - plain)[0]
    # rows then columns: the w of DINO's code is the image's height (x.shape[2])
    for key, grid in (((6, 6), (3, 3)), ((6, 4), (3, 2))):
        scale = ((grid[0] + 0.1) / side, (grid[1] + 0.1) / side)
        expected = bicubic_by_scale(smooth, grid, scale).reshape(grid[0] * grid[1], -1)
        assert torch.allclose(tables["dino", key][1:], torch.from_numpy(expected).float(), atol=1e-5), key
    assert torch.equal(tables["dino", (16, 16)], tables["timm", (16, 16)])  # the table's own grid: unchanged
    dino, timm = tables["dino", (6, 6)][1:], tables["timm", (6, 6)][1:]
    difference = (timm - dino).norm() / dino.norm()
    assert difference > 0.05, difference


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
    # issue 47 (14, 21): settings out of range were results (diverged, 10 %) or tracebacks mid-run
    (["task.student_temp=0"], "task.student_temp=0: must be > 0"),
    (["task.teacher_temp=0", "task.warmup_teacher_temp=0"], "task.teacher_temp=0: must be > 0"),
    (["task.knn_k=0"], "task.knn_k=0: must be >= 1"),
    (["task.local_crops=-1"], "task.local_crops=-1: must be >= 0"),
    (["task.local_size=0"], "task.local_size=0: must be >= 1"),
    (["task.local_size=16"], "task.local_size=16: the local crops are smaller than the images "
                             "(data.img_size=8); use at most 8"),
    (["task.out_dim=0"], "task.out_dim=0: must be >= 1"),
    (["task.freeze_last_layer=-1"], "task.freeze_last_layer=-1: must be >= 0"),
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


@pytest.mark.slow  # three short DINO runs: about 20 s of CPU
def test_a_resumed_run_is_the_uninterrupted_run_bit_for_bit(tmp_path, monkeypatch):
    """Issue 47 (19): resumed from the first epoch's checkpoint, the run goes on as if never stopped -- the
    weight-decay schedule included, which reached the optimizer's groups of before the resume only."""
    quick = ("trainer.eval_interval=2",)  # the k-NN monitor once, at the end
    uninterrupted = run(dino_cfg(*quick, epochs=2), tmp_path / "whole")
    interrupted_in_epoch_2(dino_cfg(*quick, epochs=2), tmp_path / "stopped", monkeypatch)
    resumed = run(dino_cfg(*quick, f"trainer.resume={tmp_path / 'stopped'}", epochs=2),
                  tmp_path / "resumed")
    assert resumed["metrics"]["final"] == uninterrupted["metrics"]["final"]
    losses = [[r["train/loss"] for r in read_metrics(d) if "train/loss" in r and r["epoch"] == 2]
              for d in (tmp_path / "whole", tmp_path / "resumed")]
    assert losses[0] and losses[0] == losses[1]
    whole, again = (load_checkpoint(tmp_path / d) for d in ("whole", "resumed"))
    for a, b in ((whole["model"], again["model"]), (whole["task"]["teacher"], again["task"]["teacher"])):
        assert all(torch.equal(value, b[key]) for key, value in a.items())
