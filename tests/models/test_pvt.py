"""PVT v1 (written here from arXiv 2102.12122 and whai362/PVT classification/pvt.py): sizes, norm slots and
layouts, features, recipe."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import compose_cfg, count_params, explicit_attention
from torch import nn

from normexp.models import build_backbone, create_model
from normexp.models.stats import count_gmacs
from normexp.norms import norm_layer_factory, replace_norms
from normexp.norms.dtn import DTN

# whai362/PVT README figure (M) and the exact count of its classification/pvt.py (224 px, 1000 classes)
PAPER = {"pvt_tiny": (13.2, 13_229_288), "pvt_small": (24.5, 24_485_864),
         "pvt_medium": (44.2, 44_208_104), "pvt_large": (61.4, 61_369_320)}


@pytest.mark.parametrize("name", list(PAPER))
@pytest.mark.parametrize("heads", [(1, 2, 5, 8), (4, 4, 5, 8)])
def test_parameter_counts_match_the_paper(name, heads):
    """The paper's heads and the DTN code's heads (wqshao126/DTN models/pvt_norm.py) give the same, published
    count."""
    paper, exact = PAPER[name]
    model = create_model(name, num_classes=1000, img_size=224, num_heads=heads)
    ours = count_params(model)
    print(f"{name} heads={list(heads)} | {ours / 1e6:.1f}M ({ours:,}) | {paper}M ({exact:,})")
    assert round(ours / 1e6, 1) == paper and ours == exact


def test_pvt_tiny_parameter_breakdown():
    """The official PVT-Tiny (classification/pvt.py, 1000 classes), part by part."""
    model = create_model("pvt_tiny", num_classes=1000, img_size=224)
    parts = {"pos_embed1": 200_704, "pos_embed2": 100_352, "pos_embed3": 62_720, "pos_embed4": 25_600,
             "cls_token": 512, "patch_embed1": 3_264, "patch_embed2": 33_152, "patch_embed3": 164_800,
             "patch_embed4": 656_896, "block1": 690_688, "block2": 1_184_768, "block3": 3_287_040,
             "block4": 6_304_768, "norm": 1_024, "head": 513_000}
    for name, expected in parts.items():
        got = getattr(model, name)
        assert (got.numel() if isinstance(got, nn.Parameter) else count_params(got)) == expected, name
    blk = model.block1[0]
    assert count_params(blk) == 345_344
    sizes = {"norm1": 128, "attn.q": 4_160, "attn.kv": 8_320, "attn.proj": 4_160, "attn.sr": 262_208,
             "attn.norm": 128, "norm2": 128, "mlp.fc1": 33_280, "mlp.fc2": 32_832}
    assert {k: count_params(blk.get_submodule(k)) for k in sizes} == sizes
    assert blk.norm1.eps == 1e-6 and blk.attn.norm.eps == 1e-5 and model.patch_embed1.norm.eps == 1e-5


@pytest.mark.parametrize("name,counted,paper", [("pvt_tiny", 1.93, 1.9), ("pvt_small", 3.82, 3.8)])
def test_macs_match_the_count(name, counted, paper):
    """arXiv 2102.12122 Table 2 (GFLOPs = MACs) and the MAC count of the official code (attention matmuls
    included) and the paper's."""
    gmacs = count_gmacs(explicit_attention(create_model(name, num_classes=1000)), (3, 224, 224))
    print(f"{name} | {gmacs:.2f} GMACs | {counted} (paper {paper})")
    assert round(gmacs, 2) == counted and round(gmacs, 1) == paper


def test_micro_member_size():
    model = create_model("pvt_micro", num_classes=10)
    gmacs = count_gmacs(explicit_attention(model), (3, 16, 16))
    print(f"pvt_micro | {count_params(model) / 1e6:.2f}M params, {gmacs:.4f} GMACs")
    assert count_params(model) < 2e6 and gmacs < 0.05


def record_dtn_inputs(model: nn.Module) -> list[tuple[str, int, tuple[int, int], int]]:
    """(name, tokens seen, layout grid, prefix) of every DTN called on (B, N, C) tokens."""
    seen = []
    for name, m in model.named_modules():
        if isinstance(m, DTN):
            m.register_forward_pre_hook(lambda mod, args, name=name: seen.append(
                (name, args[0].shape[1], mod.layout.grid, mod.layout.num_prefix_tokens)))
    return seen


def test_every_slot_gets_the_grid_it_sees():
    """Stage tokens on the stage grid, the class token as stage 4's prefix, sr norms on the reduced grid."""
    model = create_model("pvt_tiny", num_classes=10, img_size=64)
    assert len(replace_norms(model, norm_layer_factory("dtn"))) == 27  # every slot by default
    seen = record_dtn_inputs(model)
    model(torch.randn(1, 3, 64, 64))
    assert len(seen) == 27
    grids = {1: (16, 16), 2: (8, 8), 3: (4, 4), 4: (2, 2)}
    for name, n, grid, prefix in seen:
        stage = int(name[len("block"):].split(".")[0]) if name.startswith("block") else \
            int(name[len("patch_embed"):].split(".")[0]) if name.startswith("patch_embed") else 4
        if name.endswith("attn.norm"):  # the sr conv reduced 16/8/4 by R = 8/4/2: 2x2
            assert grid == (2, 2) and n == 4 and prefix == 0, name
        else:
            assert grid == grids[stage], name
            cls = stage == 4 and not name.startswith("patch_embed")
            assert n == grid[0] * grid[1] + cls and prefix == (stage == 4), name
    assert model.block4[0].norm1.num_prefix_tokens == 1 and model.patch_embed4.norm.num_prefix_tokens == 0
    assert [model.get_submodule(f"block{s}.0.norm1").num_heads for s in range(1, 5)] == [1, 2, 5, 8]


def test_the_grids_follow_the_input_size():
    model = create_model("pvt_micro", num_classes=10)
    replace_norms(model, norm_layer_factory("dtn"))
    model(torch.randn(1, 3, 16, 16))
    assert [lay.grid for lay in model.stage_layouts] == [(16, 16), (8, 8), (4, 4), (2, 2)]
    assert model.sr_layouts[0].grid == (4, 4) and model.sr_layouts[1].grid == (4, 4)
    out = model(torch.randn(1, 3, 24, 32))  # position embeddings are resized
    assert out.shape == (1, 10)
    assert [lay.grid for lay in model.stage_layouts] == [(24, 32), (12, 16), (6, 8), (3, 4)]
    assert model.sr_layouts[0].grid == (6, 8) and model.sr_layouts[1].grid == (6, 8)


def test_an_ema_copy_keeps_its_own_shared_layouts():
    model = create_model("pvt_micro", num_classes=10)
    replace_norms(model, norm_layer_factory("dtn"))
    ema = copy.deepcopy(model)
    assert ema.block1[0].norm1.layout is ema.stage_layouts[0] is not model.stage_layouts[0]
    assert ema.block1[0].attn.norm.layout is ema.sr_layouts[0]
    ema(torch.randn(1, 3, 32, 16))
    assert ema.stage_layouts[0].grid == (32, 16) and model.stage_layouts[0].grid is None


def test_dtn_code_layout():
    """wqshao126/DTN models/pvt_norm.py: heads 4-4-5-8, the normalizer in the blocks of stages 1-3 only,
    everything else LN."""
    cfg = compose_cfg("backbone=pvt_micro", "norm=dtn", "backbone.num_heads=[4,4,5,8]",
                      "backbone.dtn_stages=3")
    model = build_backbone(cfg.backbone, cfg.norm)
    dtn = {n for n, m in model.named_modules() if isinstance(m, DTN)}
    assert dtn == {f"block{s}.0.norm{k}" for s in (1, 2, 3) for k in (1, 2)}
    assert [model.get_submodule(f"block{s}.0.norm1").num_heads for s in (1, 2, 3)] == [4, 4, 5]
    assert type(model.block4[0].norm1) is nn.LayerNorm and model.block4[0].norm1.eps == 1e-6
    assert type(model.block1[0].attn.norm) is nn.LayerNorm and type(model.norm) is nn.LayerNorm
    assert type(model.patch_embed1.norm) is nn.LayerNorm
    model(torch.randn(2, 3, 16, 16)).sum().backward()


def test_first_blocks_counts_blocks_across_stages():
    model = create_model("pvt_tiny", num_classes=10, img_size=64)
    replaced = replace_norms(model, norm_layer_factory("rms"), first_blocks=3)
    assert replaced == ["block1.0.norm1", "block1.0.attn.norm", "block1.0.norm2",
                        "block1.1.norm1", "block1.1.attn.norm", "block1.1.norm2",
                        "block2.0.norm1", "block2.0.attn.norm", "block2.0.norm2"]


@pytest.mark.parametrize("name,img,strides", [("pvt_tiny", 64, [4, 8, 16, 32]),
                                              ("pvt_micro", 16, [1, 2, 4, 8])])
def test_features_are_the_stage_maps(name, img, strides):
    model = create_model(name, num_classes=10, img_size=img)
    maps = model.features(torch.randn(2, 3, img, img + strides[-1]))
    assert model.feature_strides == strides and model.feature_channels == list(model.embed_dims)
    width = img + strides[-1]
    assert [tuple(m.shape) for m in maps] == [
        (2, c, img // s, width // s) for c, s in zip(model.feature_channels, strides, strict=True)]


def test_recipe_values():
    """whai362/PVT classification/main.py: DeiT's main.py with PVT's batch 128 x 8, colour jitter 0.4, no
    EMA."""
    cfg = compose_cfg("experiment=pvt_imagenet")
    t, d = cfg.trainer, cfg.data
    assert cfg.backbone.name == "pvt_small" and cfg.backbone.drop_path_rate == 0.1 and d.name == "imagenet"
    assert (t.epochs, t.lr, t.lr_base_size, t.weight_decay, t.warmup_epochs) == (300, 5e-4, 512, 0.05, 5)
    assert (t.warmup_lr, t.min_lr, t.smoothing, t.clip_grad) == (1e-6, 1e-5, 0.1, None)
    assert (t.mixup.mixup_alpha, t.mixup.cutmix_alpha, t.ema.enabled) == (0.8, 1.0, False)
    assert (d.batch_size, d.color_jitter, d.reprob) == (128, 0.4, 0.25)
    assert d.auto_augment == "rand-m9-mstd0.5-inc1"
    drop_path = {"pvt_tiny": 0.1, "pvt_small": 0.1, "pvt_medium": 0.3, "pvt_large": 0.3}
    for name, dp in drop_path.items():
        backbone = compose_cfg("experiment=pvt_imagenet", f"backbone={name}").backbone
        assert backbone.drop_path_rate == dp and backbone.img_size == 224


@pytest.mark.parametrize("decay_pos_embed", [True, False])
def test_weight_decay_spares_the_class_token_and_decays_the_position_embeddings(decay_pos_embed):
    """whai362/PVT classification/pvt.py (and wqshao126/DTN models/pvt_norm.py): no_weight_decay() is
    {'cls_token'}, so the (1, N, C) position embeddings are decayed; decay_pos_embed=False exempts them."""
    from timm.optim import create_optimizer_v2

    model = create_model("pvt_micro", num_classes=10, decay_pos_embed=decay_pos_embed)
    opt = create_optimizer_v2(model, opt="adamw", lr=1e-3, weight_decay=0.05, filter_bias_and_bn=True)
    decayed = {id(p) for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    positions = [getattr(model, f"pos_embed{s}") for s in range(1, 5)]
    assert id(model.cls_token) not in decayed and id(model.block1[0].attn.sr.weight) in decayed
    assert all((id(p) in decayed) == decay_pos_embed for p in positions)
    assert compose_cfg("experiment=pvt_imagenet", "backbone=pvt_tiny").backbone.get("decay_pos_embed") is None


def test_detection_features_leave_out_the_class_token():
    """whai362/PVT detection/pvt.py: the detection backbone has no class token; stage 4 adds
    pos_embed4[:, 1:] to its grid tokens alone. Classification keeps it (forward_features)."""
    torch.manual_seed(0)
    model = create_model("pvt_micro", num_classes=10).eval()
    x = torch.randn(2, 3, 24, 32)  # not the built 16 px: the position embeddings are resized
    with torch.no_grad():
        maps, logits = model.features(x), model(x)
        model.cls_token.add_(1.0)
        model.pos_embed4[:, 0].add_(1.0)
        for before, after in zip(maps, model.features(x), strict=True):
            torch.testing.assert_close(before, after, rtol=0, atol=0)
        assert not torch.allclose(logits, model(x))
        # stage 4 by hand: the stage-3 map embedded, plus the grid part of pos_embed4, through its blocks
        tokens, grid = model.patch_embed4(maps[2])
        pos = F.interpolate(model.pos_embed4[:, 1:].reshape(1, 2, 2, -1).permute(0, 3, 1, 2), size=grid,
                            mode="bilinear", align_corners=False).flatten(2).transpose(1, 2)
        tokens = tokens + pos
        for blk in model.block4:
            tokens = blk(tokens, grid)
        torch.testing.assert_close(maps[3], tokens.transpose(1, 2).reshape(2, -1, *grid))
