"""Every backbone x every registered normalizer, the backbone contract and the dense-feature interface.

The micro members run in the fast suite with every normalizer, each family's smallest published size with
the papers' own (LN, DTN, DyT); the rest is marked slow (a few minutes in all), and the largest sizes (whose
code path their family's smaller sizes already run) are left out of the normalizer matrix: their parameter
counts are checked on the meta device.
"""

from __future__ import annotations

import fnmatch
from pathlib import Path

import pytest
import torch
from conftest import CONFIG_DIR, compose_cfg, forward_backward

from normexp.errors import UserError
from normexp.models import build_backbone, create_model, list_models
from normexp.models.base import Backbone, NormContext
from normexp.norms import get_norm_class, list_norms
from normexp.norms.normfree import residual_branches
from normexp.norms.placement import norm_slots

# the image backbones (DiT, the diffusion model of task=dit, has its own tests: test_dit.py)
BACKBONES = sorted(p.stem for p in (Path(CONFIG_DIR) / "backbone").glob("*.yaml")
                   if not p.stem.startswith("dit_"))
FAST = {"vit_tiny", "swin_tiny", "pvt_tiny", "pvt_v2_b0", "levit_128s", "t2t_vit_7"}  # ConvNeXt: micro only
HEAVY = {"vit_large", "convnext_base", "convnext_large", "vgg19_bn"}  # VGG19-BN: 144M parameters, most of
# them in the classifier; its micro member runs the same code (and test_torchvision_cnn.py its counts)
PAPERS_NORMS = {"ln", "dtn", "dyt"}


# normalizers whose default build runs another's code: pointwise is fn=erf, Derf's layer; none is skipinit
# without its gates -- slow tier only
SAME_CODE_AS = {"pointwise": "derf", "none": "skipinit"}


def fast(name: str, norm: str | None = None) -> bool:
    """In the fast suite: the micro members with every normalizer (but those of ``SAME_CODE_AS``), the
    smallest published sizes with the papers' normalizers."""
    if norm in SAME_CODE_AS:
        return False
    return name.endswith("_micro") or name in FAST and (norm is None or norm in PAPERS_NORMS)


CASES = [name if fast(name) else pytest.param(name, marks=pytest.mark.slow) for name in BACKBONES]
MATRIX = [pytest.param(name, norm, marks=[] if fast(name, norm) else [pytest.mark.slow])
          for name in BACKBONES if name not in HEAVY for norm in list_norms()]
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
    overrides += [f"++backbone.{k}={v}" for k, v in extra.items()]
    cfg = compose_cfg(*overrides)
    return build_backbone(cfg.backbone, cfg.norm)


def test_every_family_is_here():
    families = {"vit", "swin", "pvt", "pvt_v2", "levit", "t2t_vit", "convnext", "resnet50", "vgg19_bn"}
    assert families <= {n.rsplit("_", 1)[0] if not n.startswith("pvt_v2") else "pvt_v2" for n in BACKBONES}
    assert {f"{f}_micro" for f in families} <= set(BACKBONES)


@pytest.mark.parametrize("name", [n for n in BACKBONES if n.endswith("_micro")])
def test_every_family_declares_the_backbone_contract(name):
    model = create_model(name, num_classes=10)
    assert isinstance(model, Backbone)
    assert len(model.feature_channels) == len(model.feature_strides)
    assert model.fixed_input_size is None or len(model.fixed_input_size) == 2
    assert isinstance(model.no_weight_decay(), (set, dict))
    for slot in norm_slots(model):
        context = model.norm_context(slot)
        assert set(context) <= set(NormContext.__annotations__), (slot, context)
        assert context["num_heads"] >= 1


@pytest.mark.parametrize("name", list_models())
def test_every_registered_model_builds_with_its_own_defaults(name):
    """Outside Hydra too: ``create_model(name)`` with no arguments builds (on the meta device: no memory, no
    init cost); where a default matters, it is the value the model's configs/backbone yaml sets."""
    with torch.device("meta"):
        model = create_model(name)
    assert sum(p.numel() for p in model.parameters()) > 0


def kept_by_the_family(model: torch.nn.Module, slot: str, norm: str) -> bool:
    """A slot keeps its layer only where the family declares it: ``norm_keep``, or a pooled vector under a
    normalizer that takes statistics over tokens."""
    pooled = getattr(model, "norm_context", lambda _: {})(slot).get("pooled", False)
    return any(fnmatch.fnmatchcase(slot, p) for p in getattr(model, "norm_keep", ())) or \
        (pooled and getattr(get_norm_class(norm), "token_statistics", False))


def without_residual_branches(name: str) -> bool:
    """A plain stack (VGG): ``norm=skipinit``, which gates residual branches, refuses it."""
    with torch.device("meta"):
        return not residual_branches(create_model(name, num_classes=10))


@pytest.mark.parametrize(("name", "norm"), MATRIX)
def test_every_norm_fills_every_slot_and_trains(name, norm):
    torch.manual_seed(0)
    if norm in ("skipinit", "fixup") and without_residual_branches(name):
        with pytest.raises(UserError, match="names none"):
            build(name, norm)
        return
    model = build(name, norm)
    with torch.device("meta"):
        slots = norm_slots(build(name, "ln"))
    kept = [s for s in slots if type(model.get_submodule(s)) is not get_norm_class(norm)]
    assert len(kept) < len(slots) and all(kept_by_the_family(model, s, norm) for s in kept), kept
    forward_backward(model, small_size(name))


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


@pytest.mark.parametrize("norm", list_norms())
def test_every_norm_in_a_pooled_classifier_norm(norm):
    """MAE's fine-tuning recipe pools the tokens and normalises the pooled vector (timm's ``fc_norm``)."""
    torch.manual_seed(0)
    model = build("vit_micro", norm, global_pool="avg")
    if not kept_by_the_family(model, "fc_norm", norm):
        assert type(model.fc_norm) is get_norm_class(norm)
    forward_backward(model, small_size("vit_micro"))
