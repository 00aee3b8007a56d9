"""Compose configs on CPU the way the command line does, and run them in-process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, open_dict
from torch import nn

from normexp.tables.plan import memoized

ROOT = Path(__file__).resolve().parent.parent

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs one pytest worker per core: one thread each (and in the processes they start), or
    # the workers' thread pools fight over the cores
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
CONFIG_DIR = str(ROOT / "configs")


def _compose_train(overrides: list[str]) -> DictConfig:
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
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
