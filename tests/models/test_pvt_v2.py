"""PVT v2 on timm's class: sizes, norm slots and layouts, features, recipe."""

from __future__ import annotations

import copy

import pytest
import timm
import torch
from conftest import compose_cfg, count_params, explicit_attention
from torch import nn

from normexp.models import create_model
from normexp.models.stats import count_gmacs
from normexp.norms import norm_layer_factory, replace_norms
from normexp.norms.dtn import DTN

# whai362/PVT README (branch v2) figure (M) and the exact count of its classification/pvt_v2.py (224 px, 1000
# classes)
README = {"pvt_v2_b0": (3.7, 3_666_760), "pvt_v2_b1": (14.0, 14_009_000), "pvt_v2_b2": (25.4, 25_362_856),
          "pvt_v2_b2_li": (22.6, 22_553_512), "pvt_v2_b3": (45.2, 45_238_696),
          "pvt_v2_b4": (62.6, 62_556_072), "pvt_v2_b5": (82.0, 81_956_008)}


@pytest.mark.parametrize("name", list(README))
def test_parameter_counts_match_the_readme(name):
    """The README's figures (B0 / B1: 3.7 / 14.0M; the paper's 3.4 / 13.1M predate a README fix)."""
    paper, exact = README[name]
    model = create_model(name, num_classes=1000, img_size=224)
    print(f"{name} | {count_params(model) / 1e6:.1f}M ({count_params(model):,}) | {paper}M ({exact:,})")
    assert round(count_params(model) / 1e6, 1) == paper and count_params(model) == exact


@pytest.mark.parametrize("name,counted,paper", [("pvt_v2_b0", 0.57, 0.6), ("pvt_v2_b2_li", 3.89, 3.9)])
def test_macs_match_the_count(name, counted, paper):
    """arXiv 2106.13797 Table 1 (GFLOPs = MACs) and the MAC count of the official code (attention matmuls
    included) and the paper's."""
    gmacs = count_gmacs(explicit_attention(create_model(name, num_classes=1000)), (3, 224, 224))
    print(f"{name} | {gmacs:.2f} GMACs | {counted} (paper {paper})")
    assert round(gmacs, 2) == counted and round(gmacs, 1) == paper


def test_same_model_as_timm():
    """The subclass only adds context: timm's weights load as they are and give the same output."""
    ours = create_model("pvt_v2_b0", num_classes=10).eval()
    theirs = timm.create_model("pvt_v2_b0", num_classes=10).eval()
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(2, 3, 64, 64)
    torch.testing.assert_close(ours(x), theirs(x))


def test_micro_member_size():
    model = create_model("pvt_v2_micro", num_classes=10)
    gmacs = count_gmacs(explicit_attention(model), (3, 16, 16))
    print(f"pvt_v2_micro | {count_params(model) / 1e6:.2f}M params, {gmacs:.4f} GMACs")
    assert count_params(model) < 2e6 and gmacs < 0.05


def record_dtn_inputs(model: nn.Module) -> dict[str, tuple[tuple[int, ...], tuple[int, int] | None]]:
    """Input shape and layout grid of every DTN, by name."""
    seen = {}
    for name, m in model.named_modules():
        if isinstance(m, DTN):
            m.register_forward_pre_hook(lambda mod, args, name=name: seen.__setitem__(
                name, (tuple(args[0].shape), mod.layout.grid)))
    return seen


@pytest.mark.parametrize("name,sr_grids", [("pvt_v2_b0", [(2, 2), (2, 2), (2, 2), None]),
                                           ("pvt_v2_b2_li", [(7, 7)] * 4)])
def test_every_slot_gets_the_grid_it_sees(name, sr_grids):
    """Tokens on the stage grid; sr-branch norms on the reduced grid (7x7 after the linear variant's pool);
    patch-embedding norms see (B, H, W, C) maps."""
    model = create_model(name, num_classes=10, img_size=64)
    replaced = replace_norms(model, norm_layer_factory("dtn"))
    per_stage = [(3 if sr else 2) * d + 2 for d, sr in zip(model.depths, sr_grids, strict=True)]
    assert len(replaced) == sum(per_stage)  # norm1/norm2 (+ sr norm) per block, patch-embed and stage norms
    seen = record_dtn_inputs(model)
    model(torch.randn(1, 3, 64, 64))
    assert sorted(seen) == sorted(replaced)
    grids = [(16, 16), (8, 8), (4, 4), (2, 2)]
    for slot, (shape, grid) in seen.items():
        if "downsample" in slot or slot.startswith("patch_embed"):
            stage = 0 if slot.startswith("patch_embed") else int(slot.split(".")[1])
            assert shape[1:3] == grids[stage], slot  # a map: the grid is in its shape
            continue
        stage = int(slot.split(".")[1])
        expected = sr_grids[stage] if slot.endswith("attn.norm") else grids[stage]
        assert grid == expected and shape[1] == expected[0] * expected[1], slot
    heads = [model.get_submodule(f"stages.{i}.blocks.0.norm1").num_heads for i in range(4)]
    assert heads == [1, 2, 5, 8] and model.stages[3].norm.num_heads == 8


def test_the_grids_follow_the_input_size():
    model = create_model("pvt_v2_micro", num_classes=10)
    replace_norms(model, norm_layer_factory("dtn"))
    model(torch.randn(1, 3, 16, 16))
    assert [lay.grid for lay in model.stage_layouts] == [(16, 16), (8, 8), (4, 4), (2, 2)]
    assert model.sr_layouts[0].grid == (4, 4) and model.sr_layouts[1].grid == (4, 4)
    model(torch.randn(1, 3, 24, 32))
    assert [lay.grid for lay in model.stage_layouts] == [(24, 32), (12, 16), (6, 8), (3, 4)]
    assert model.sr_layouts[0].grid == (6, 8) and model.sr_layouts[1].grid == (6, 8)


def test_an_ema_copy_keeps_its_own_shared_layouts():
    model = create_model("pvt_v2_micro", num_classes=10)
    replace_norms(model, norm_layer_factory("dtn"))
    ema = copy.deepcopy(model)
    assert ema.stages[0].blocks[0].norm1.layout is ema.stage_layouts[0] is not model.stage_layouts[0]
    assert ema.stages[0].blocks[0].attn.norm.layout is ema.sr_layouts[0]
    ema(torch.randn(1, 3, 32, 16))
    assert ema.stage_layouts[0].grid == (32, 16) and model.stage_layouts[0].grid is None


def test_first_blocks_counts_blocks_across_stages():
    model = create_model("pvt_v2_b0", num_classes=10, img_size=64)
    replaced = replace_norms(model, norm_layer_factory("rms"), first_blocks=3)
    assert replaced == [f"stages.{i}.blocks.{j}.{slot}" for i, j in ((0, 0), (0, 1), (1, 0))
                        for slot in ("norm1", "attn.norm", "norm2")]


@pytest.mark.parametrize("name,img,strides", [("pvt_v2_b0", 64, [4, 8, 16, 32]),
                                              ("pvt_v2_micro", 16, [1, 2, 4, 8])])
def test_features_are_the_stage_maps(name, img, strides):
    model = create_model(name, num_classes=10, img_size=img)
    maps = model.features(torch.randn(2, 3, img, 2 * img))
    assert model.feature_strides == strides and model.feature_channels == [32, 64, 160, 256]
    assert [tuple(m.shape) for m in maps] == [
        (2, c, img // s, 2 * img // s) for c, s in zip(model.feature_channels, strides, strict=True)]


def test_recipe_values():
    """whai362/PVT classification/: the PVT recipe serves PVT v2 too; drop path per size in the backbone
    yamls."""
    cfg = compose_cfg("experiment=pvt_imagenet", "backbone=pvt_v2_b2")
    t, d = cfg.trainer, cfg.data
    assert cfg.backbone.name == "pvt_v2_b2" and d.name == "imagenet" and d.batch_size == 128
    assert (t.epochs, t.lr, t.lr_base_size, t.weight_decay, t.warmup_epochs) == (300, 5e-4, 512, 0.05, 5)
    assert (t.mixup.mixup_alpha, t.mixup.cutmix_alpha, t.ema.enabled, t.clip_grad) == (0.8, 1.0, False, None)
    assert (d.color_jitter, d.reprob) == (0.4, 0.25)
    drop_path = {"pvt_v2_b0": 0.1, "pvt_v2_b1": 0.1, "pvt_v2_b2": 0.1, "pvt_v2_b2_li": 0.1,
                 "pvt_v2_b3": 0.3, "pvt_v2_b4": 0.3, "pvt_v2_b5": 0.3}
    for name, dp in drop_path.items():
        assert compose_cfg("experiment=pvt_imagenet", f"backbone={name}").backbone.drop_path_rate == dp
