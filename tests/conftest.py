"""Compose configs on CPU the way the command line does, and run them in-process."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from hydra import compose
from omegaconf import DictConfig, open_dict
from torch import nn

from normexp.code_defaults import config_tree
from normexp.tables.plan import memoized
from normexp.tracking.provenance import config_hash

ROOT = Path(__file__).resolve().parent.parent

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs one pytest worker per core: one thread each (and in the processes they start), or
    # the workers' thread pools fight over the cores
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
CONFIG_DIR = str(ROOT / "configs")


def _compose_train(overrides: list[str]) -> DictConfig:
    with config_tree():
        return compose(config_name="train", overrides=overrides)


_compose_once = memoized(_compose_train)  # Hydra's composition is most of a small test's time


def compose_cfg(*overrides: str) -> DictConfig:
    """``configs/train.yaml`` with ``overrides``, composed once per override list in a session."""
    return _compose_once(list(overrides))


def quick_cfg(*overrides: str, epochs: int = 1) -> DictConfig:
    """The demo shrunk to seconds: the digits at their own 8x8 pixels (a quarter of the demo's tokens), few
    epochs, no W&B, no progress bars."""
    cfg = compose_cfg("logger=none", "data.img_size=8", f"trainer.epochs={epochs}", "trainer.warmup_epochs=0",
                      "trainer.progress=false", *overrides)
    with open_dict(cfg):
        cfg.trainer.log_interval = 10
    return cfg


def run_cli(*args: str, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    """``python -m normexp ARGS`` in a subprocess, as a user types it."""
    return subprocess.run([sys.executable, "-m", "normexp", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "WANDB_SILENT": "true", **(env or {})})


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return tmp_path / "run"


def interrupted_in_epoch_2(cfg: DictConfig, directory: Path | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """``run(cfg, directory)`` stopped as a Ctrl-C would stop it when its second epoch begins (after the first
    epoch's checkpoint); the trainer is whole again afterwards."""
    from normexp.engine.trainer import Trainer
    from normexp.run import run

    whole_epoch = Trainer.train_one_epoch

    def stopped_in_epoch_2(self, epoch: int) -> Any:
        if epoch == 1:
            raise KeyboardInterrupt("stopped")
        return whole_epoch(self, epoch)

    monkeypatch.setattr(Trainer, "train_one_epoch", stopped_in_epoch_2)
    with pytest.raises(KeyboardInterrupt):
        run(cfg, directory)
    monkeypatch.setattr(Trainer, "train_one_epoch", whole_epoch)


@pytest.fixture(scope="session")
def completed(tmp_path_factory) -> Path:
    """A completed one-epoch run of ``quick_cfg()`` (config, summary, metrics, checkpoint): copy, then use."""
    from normexp.run import run

    run_dir = tmp_path_factory.mktemp("completed") / "run"
    assert run(quick_cfg(), run_dir)["status"] == "completed"
    return run_dir


# ---------------------------------------------------------------- damaged run records, for every reader
def _edit(name: str, edit: Callable[[dict], Any]) -> Callable[[Path], None]:
    """A damage that changes one value of ``summary.json`` or ``config.yaml``."""
    json_file = name.endswith(".json")

    def damage(run_dir: Path) -> None:
        path = run_dir / name
        value = (json.loads if json_file else yaml.safe_load)(path.read_text())
        edit(value)
        path.write_text(json.dumps(value) if json_file else yaml.safe_dump(value))
    return damage


def _break_second_metrics_line(run_dir: Path) -> None:
    first, *rest = (run_dir / "metrics.jsonl").read_text().splitlines(keepends=True)
    (run_dir / "metrics.jsonl").write_text("".join([first, '{"step": 15, "epoch": 1, "train/lo\n', *rest]))


# name -> (what it does to a record's directory, what the loader says is wrong)
DAMAGES: dict[str, tuple[Callable[[Path], None], str]] = {
    "summary is a list": (lambda d: (d / "summary.json").write_text("[]"), "summary.json holds a list"),
    "summary cut short": (lambda d: (d / "summary.json").write_text((d / "summary.json").read_text()[:100]),
                          "summary.json does not read back (JSONDecodeError"),
    "metrics not a mapping": (_edit("summary.json", lambda s: s.update(metrics=[1, 2])),
                              "summary.json: 'metrics' is not a mapping of mappings"),
    "a metric is a string": (_edit("summary.json",
                                   lambda s: s["metrics"]["final"].update({"val/top1": "high"})),
                             "summary.json: metrics.final.val/top1 is 'high', not a number"),
    "started_at is no time": (_edit("summary.json", lambda s: s.update(started_at="yesterday")),
                              "summary.json: started_at is 'yesterday', not an ISO 8601 time"),
    "config is a list": (lambda d: (d / "config.yaml").write_text("- a\n- b\n"), "config.yaml holds a list"),
    "config has no backbone": (_edit("config.yaml", lambda c: c.pop("backbone")),
                               "config.yaml has no backbone.name"),
    "a broken metrics line": (_break_second_metrics_line, "metrics.jsonl line 2 is not a JSON object"),
}


def plant_record(completed: Path, run_dir: Path, config: dict | None = None, status: str | None = None,
                 damage: str | None = None) -> Path:
    """A copy of the ``completed`` record at ``run_dir``: with ``config`` as its resolved config (and its
    run_id), ``status``, and then one of :data:`DAMAGES`."""
    shutil.copytree(completed, run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    if config is not None:
        (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
        summary["run_id"] = config_hash(config)
    summary["status"] = status or summary["status"]
    (run_dir / "summary.json").write_text(json.dumps(summary))
    if damage is not None:
        DAMAGES[damage][0](run_dir)
    return run_dir


def damaged_root(completed: Path, root: Path) -> dict[str, Path]:
    """Under ``root``: ``good``, the completed record, and one record of another seed per damage."""
    config = yaml.safe_load((completed / "config.yaml").read_text())
    planted = {"good": plant_record(completed, root / "good")}
    for seed, name in enumerate(DAMAGES, start=1):
        planted[name] = plant_record(completed, root / name.replace(" ", "_"), {**config, "seed": seed},
                                     damage=name)
    return planted


def count_params(module: nn.Module, trainable_only: bool = False) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad or not trainable_only)


def explicit_attention(model: nn.Module) -> nn.Module:
    """Attention as explicit matmuls, so that the FLOP counter sees them (it misses the CPU fused kernel)."""
    for m in model.modules():
        if hasattr(m, "fused_attn"):
            m.fused_attn = False
    return model


def forward_backward(model: nn.Module, size: int, num_classes: int = 10) -> None:
    """One batch of two images through the model and back: finite logits of the right shape, finite grads."""
    out = model(torch.randn(2, 3, size, size))
    out.sum().backward()
    assert out.shape == (2, num_classes) and torch.isfinite(out).all()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def coco_jpeg_tree(root: Path, where: Path) -> Path:
    """The generated COCO tree at ``root`` as COCO 2017 ships, at ``where``: JPEG files, their names in the
    annotation files."""
    from PIL import Image

    for split in ("train2017", "val2017"):
        (where / split).mkdir(parents=True)
        data = json.loads((root / "annotations" / f"instances_{split}.json").read_text())
        for image in data["images"]:
            name = image["file_name"].replace(".png", ".jpg")
            rgb = Image.open(root / split / image["file_name"]).convert("RGB")
            rgb.save(where / split / name, quality=95)
            image["file_name"] = name
        (where / "annotations").mkdir(exist_ok=True)
        (where / "annotations" / f"instances_{split}.json").write_text(json.dumps(data))
    return where


def flip_a_byte_inside(path: Path) -> None:
    """Invert the byte in the middle of ``path`` (bit rot, a bad copy): what an integrity check must catch."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
