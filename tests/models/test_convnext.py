"""ConvNeXt: published sizes, DyT in both LayerNorm layouts as the official conversion, DTN on the stage maps,
the head count, the pooled classifier norm, features()."""

from __future__ import annotations

import pytest
import torch
from conftest import compose_cfg, count_params
from timm.layers import LayerNorm2d
from torch import nn

from normexp.models import build_backbone, create_model
from normexp.models.convnext import convnext_heads
from normexp.models.stats import count_gmacs
from normexp.norms import norm_layer_factory, replace_norms
from normexp.norms.dtn import DTN
from normexp.norms.dyt import DyT
from normexp.norms.placement import norm_slots

# Exact counts of timm's definitions (= the official ones) at 224 px / 1000 classes, and the published
# figures: the ConvNeXt paper's Table 1 in M (arXiv 2201.03545: 29 / 50 / 89 / 198) and timm's model cards in
# 0.1 M (huggingface.co/timm/convnext_{tiny,small,base,large}.fb_in1k: 28.6 / 50.2 / 88.6 / 197.8).
PUBLISHED = {"convnext_tiny": (28_589_128, 29, 28.6), "convnext_small": (50_223_688, 50, 50.2),
             "convnext_base": (88_591_464, 89, 88.6), "convnext_large": (197_767_336, 198, 197.8)}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_counts_match_the_published_ones(name):
    exact, paper, card = PUBLISHED[name]
    with torch.device("meta"):  # counting needs no initialisation
        model = create_model(name, num_classes=1000)
    ours = count_params(model)
    print(f"{name} | {ours / 1e6:.1f}M ({ours:,}) | {card}M (paper {paper}M; {exact:,})")
    assert ours == exact and round(ours / 1e6, 1) == card and round(ours / 1e6) == paper


def test_micro_member_size():
    model = create_model("convnext_micro", num_classes=10)
    params, gmacs = count_params(model), count_gmacs(model, (3, 16, 16))
    print(f"convnext_micro | {params / 1e6:.3f}M | {gmacs:.4f} GMACs")
    assert params < 1.5e6 and gmacs < 0.05


def official_dyt_layouts(model: nn.Module) -> dict[str, str]:
    """Slot -> layout that jiachenzhu/DyT ``convert_ln_to_dyt`` gives: every nn.LayerNorm becomes DyT,
    channels-first exactly for timm's LayerNorm2d."""
    return {name: "channels_first" if isinstance(m, LayerNorm2d) else "channels_last"
            for name, m in model.named_modules() if isinstance(m, nn.LayerNorm)}


def test_dyt_replaces_every_layernorm_in_its_layout():
    built = create_model("convnext_micro", num_classes=10)
    expected = official_dyt_layouts(built)
    assert set(expected.values()) == {"channels_first", "channels_last"}  # both layouts are there
    cfg = compose_cfg("backbone=convnext_micro", "norm=dyt")
    model = build_backbone(cfg.backbone, cfg.norm)
    assert not any(isinstance(m, nn.LayerNorm) for m in model.modules())  # none left, head norm included
    got = {name: m.data_format for name, m in model.named_modules() if isinstance(m, DyT)}
    assert got == expected
    x = torch.randn(2, 3, 16, 16)
    out = model(x)
    assert out.shape == (2, 10) and torch.isfinite(out).all()
    # each DyT computes weight * tanh(alpha * x) + bias on its layout's channel dim
    seen = {}
    model.stem[1].register_forward_hook(lambda m, args, out: seen.update(stem=(args[0], out)))
    model(x)
    inp, out = seen["stem"]
    torch.testing.assert_close(out, model.stem[1].weight[:, None, None] * torch.tanh(0.5 * inp)
                               + model.stem[1].bias[:, None, None])


def test_dtn_runs_on_the_stage_maps_with_swin_head_counts():
    assert [convnext_heads(c) for c in (96, 192, 384, 768)] == [3, 6, 12, 24]  # Swin-T's
    assert [convnext_heads(c) for c in (192, 384, 768, 1536)] == [6, 12, 24, 48]  # Swin-L's
    assert [convnext_heads(c) for c in (32, 48, 20)] == [1, 1, 1]
    model = create_model("convnext_tiny", num_classes=10, img_size=64)
    slots = norm_slots(model)
    assert replace_norms(model, norm_layer_factory("dtn")) == slots  # every slot, the pooled head's too
    block = model.stages[2].blocks[0].norm
    assert isinstance(block, DTN) and block.num_heads == 12 and block.data_format == "channels_last"
    assert model.stem[1].data_format == "channels_first" and model.stem[1].num_heads == 3
    grids = {}
    for i, stage in enumerate(model.stages):
        stage.blocks[0].norm.register_forward_hook(lambda m, args, out, i=i: grids.update({i: args[0].shape}))
    out = model(torch.randn(2, 3, 64, 64))
    out.sum().backward()
    assert torch.isfinite(out).all() and all(torch.isfinite(p.grad).all() for p in model.parameters())
    assert {i: tuple(s[1:3]) for i, s in grids.items()} == {0: (16, 16), 1: (8, 8), 2: (4, 4), 3: (2, 2)}


@pytest.mark.parametrize("norm,head", [("in", "LayerNorm2d"), ("sn", "LayerNorm2d"), ("bn", "BatchNorm"),
                                       ("dyt", "DyT")])
def test_the_pooled_head_norm_keeps_ln_only_for_token_statistics(norm, head):
    cfg = compose_cfg("backbone=convnext_micro", f"norm={norm}")
    model = build_backbone(cfg.backbone, cfg.norm)
    assert type(model.head.norm).__name__ == head
    assert model.norm_context("head.norm")["pooled"]
    assert torch.isfinite(model(torch.randn(2, 3, 16, 16))).all()


def test_features_and_dense_output_norms():
    cfg = compose_cfg("backbone=convnext_micro", "norm=ln")
    model = build_backbone(cfg.backbone, cfg.norm, dense=True)
    assert model.feature_strides == [1, 2, 4, 8] and model.feature_channels == [32, 64, 128, 256]
    maps = model.features(torch.randn(2, 3, 16, 24))
    assert [tuple(m.shape) for m in maps] == [(2, 32, 16, 24), (2, 64, 8, 12), (2, 128, 4, 6), (2, 256, 2, 3)]
    assert len(model.feature_norms) == 4 and "feature_norms.3" in norm_slots(model)
    assert [model.norm_context(f"feature_norms.{i}")["num_heads"] for i in range(4)] == [1, 2, 4, 8]
    assert model.norm_context("stages.1.downsample.0")["num_heads"] == 1  # the 32-wide stage-0 map
    tiny = create_model("convnext_tiny", num_classes=10)
    assert tiny.feature_strides == [4, 8, 16, 32] and tiny.feature_norms is None
