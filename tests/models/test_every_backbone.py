"""Every backbone x every registered normalizer, and the dense-feature interface of every backbone.

The micro members and each family's smallest published size run in the fast suite; the other published
sizes are marked slow (a few minutes in all).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import CONFIG_DIR, compose_cfg

from normexp.models import build_backbone
from normexp.norms import list_norms

BACKBONES = sorted(p.stem for p in (Path(CONFIG_DIR) / "backbone").glob("*.yaml"))
FAST = {"vit_tiny", "swin_tiny", "pvt_tiny", "pvt_v2_b0", "levit_128s", "t2t_vit_7"}
CASES = [name if name in FAST or name.endswith("_micro") else pytest.param(name, marks=pytest.mark.slow)
         for name in BACKBONES]
PLAIN = ("vit_", "t2t_")  # single-scale models: features() comes from a simple pyramid


def small_size(name: str) -> int:
    """Smallest convenient input: micro members train at 16 px; LeViT needs stage grids above 1x1."""
    if name.endswith("_micro"):
        return 16
    if name.startswith("levit"):
        return 80
    return 32 if name.startswith("vit_") else 64


def build(name: str, norm: str, **extra) -> torch.nn.Module:
    overrides = [f"backbone={name}", f"norm={norm}", f"data.img_size={small_size(name)}"]
    overrides += [f"+backbone.{k}={v}" for k, v in extra.items()]
    cfg = compose_cfg(*overrides)
    return build_backbone(cfg.backbone, cfg.norm)


def test_every_family_is_here():
    families = {"vit", "swin", "pvt", "pvt_v2", "levit", "t2t_vit"}
    assert families <= {n.rsplit("_", 1)[0] if not n.startswith("pvt_v2") else "pvt_v2" for n in BACKBONES}
    assert {f"{f}_micro" for f in families} <= set(BACKBONES)


@pytest.mark.parametrize("norm", list_norms())
@pytest.mark.parametrize("name", CASES)
def test_forward_backward(name, norm):
    torch.manual_seed(0)
    model = build(name, norm)
    size = small_size(name)
    out = model(torch.randn(2, 3, size, size))
    out.sum().backward()
    assert out.shape == (2, 10) and torch.isfinite(out).all()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


@pytest.mark.parametrize("name", CASES)
def test_features(name):
    size = small_size(name)
    extra = {}
    if name.startswith(PLAIN):
        stride = build(name, "ln").stride
        scales = [s for s in (4.0, 2.0, 1.0, 0.5) if stride / s >= 1]
        extra["pyramid_scales"] = "[" + ",".join(map(str, scales)) + "]"
    model = build(name, "ln", **extra)
    maps = model.features(torch.randn(2, 3, size, size))
    assert len(maps) == len(model.feature_channels) == len(model.feature_strides) >= 2
    for fmap, channels, stride in zip(maps, model.feature_channels, model.feature_strides, strict=True):
        assert fmap.dim() == 4 and fmap.shape[:2] == (2, channels)
        assert fmap.shape[-1] == -(-size // stride), (name, fmap.shape, stride)
    assert model.feature_strides == sorted(model.feature_strides)
