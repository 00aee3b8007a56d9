"""Swin sizes vs the official counts, every normalizer in every slot, whole-map DTN, features, recipe."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import compose_cfg, count_params
from timm.models.swin_transformer import SwinTransformerBlock
from torch import nn

from normexp.models import build_backbone, create_model
from normexp.models.stats import count_gmacs
from normexp.norms import norm_layer_factory, replace_norms
from normexp.norms.dtn import DTN

# microsoft/Swin-Transformer README / MODELHUB.md: exact counts of the official code (= timm), and the
# README's rounding (M)
PAPER = {"swin_tiny": (28_288_354, 28), "swin_small": (49_606_258, 50), "swin_base": (87_768_224, 88)}



@pytest.mark.parametrize("name", sorted(PAPER))
def test_parameter_counts_match_the_paper(name):
    exact, readme = PAPER[name]
    ours = count_params(create_model(name, num_classes=1000, img_size=224))
    print(f"{name} | {ours / 1e6:.1f}M ({ours:,}) | {readme}M ({exact:,})")
    assert ours == exact and round(ours / 1e6) == readme


def test_micro_member_size():
    model = create_model("swin_micro", num_classes=10)
    params, gmacs = count_params(model), count_gmacs(model, (3, 16, 16))
    print(f"swin_micro | {params / 1e6:.3f}M | {gmacs:.4f} GMACs")
    assert params < 1e6 and gmacs < 0.05


def test_norm_context_blocks_heads_and_layouts():
    model = create_model("swin_tiny", num_classes=1000)
    ctx = model.norm_context
    assert ctx("patch_embed.norm")["block"] is None and ctx("patch_embed.norm")["num_heads"] == 3
    merge = ctx("layers.1.downsample.norm")
    assert (merge["block"], merge["num_heads"]) == (None, 6)
    assert (ctx("layers.2.blocks.3.norm1")["block"], ctx("layers.2.blocks.3.norm1")["num_heads"]) == (7, 12)
    assert (ctx("layers.3.blocks.1.norm2")["block"], ctx("norm")["num_heads"]) == (11, 24)
    assert ctx("layers.2.blocks.0.norm2")["layout"] is model.stage_layouts[2]
    assert ctx("norm")["layout"] is model.stage_layouts[3] and ctx("norm")["num_prefix_tokens"] == 0


def test_dtn_takes_whole_stage_map_statistics():
    """norm1 sees the (B, H, W, C) stage map before the windows, norm2 the same tokens with the stage grid,
    patch merging the merged map: each DTN gets the whole stage grid (16x16 > 14 is pooled), not a window."""
    model = create_model("swin_tiny", num_classes=10, img_size=64)
    replace_norms(model, norm_layer_factory("dtn"))
    seen = {}
    for name in ("layers.0.blocks.1.norm1", "layers.0.blocks.1.norm2", "layers.1.downsample.norm",
                 "layers.3.blocks.0.norm2"):
        model.get_submodule(name).register_forward_pre_hook(
            lambda m, args, name=name: seen.__setitem__(name, (tuple(args[0].shape), m.layout.grid)))
    model(torch.randn(2, 3, 64, 64))
    assert seen["layers.0.blocks.1.norm1"][0] == (2, 16, 16, 96)
    assert seen["layers.0.blocks.1.norm2"] == ((2, 256, 96), (16, 16))
    assert seen["layers.1.downsample.norm"][0] == (2, 8, 8, 384)
    assert seen["layers.3.blocks.0.norm2"] == ((2, 4, 768), (2, 2))
    # the token form and the map form of a slot compute the same thing
    dtn = model.layers[0].blocks[1].norm2
    assert isinstance(dtn, DTN) and dtn.pool_size == 14
    x = torch.randn(2, 256, 96)
    torch.testing.assert_close(dtn(x), dtn(x.view(2, 16, 16, 96)).view(2, 256, 96))


def test_the_grid_follows_the_input_size_and_survives_deepcopy():
    model = create_model("swin_micro", num_classes=10, dynamic_img_size=True)
    replace_norms(model, norm_layer_factory("dtn"))
    model(torch.randn(1, 3, 16, 16))
    assert [lay.grid for lay in model.stage_layouts] == [(16, 16), (8, 8), (4, 4), (2, 2)]
    model(torch.randn(1, 3, 24, 20))
    assert [lay.grid for lay in model.stage_layouts] == [(24, 20), (12, 10), (6, 5), (3, 3)]
    ema = copy.deepcopy(model)  # the EMA copy: its own layouts, updated by its own hooks
    ema(torch.randn(1, 3, 16, 16))
    assert ema.stage_layouts[0].grid == (16, 16) and model.stage_layouts[0].grid == (24, 20)
    assert ema.layers[0].blocks[0].norm2.layout is ema.stage_layouts[0]


@pytest.mark.parametrize("name,size,strides,channels", [
    ("swin_micro", 16, [1, 2, 4, 8], [24, 48, 96, 192]),
    ("swin_tiny", 64, [4, 8, 16, 32], [96, 192, 384, 768]),
])
def test_features_are_the_stage_maps(name, size, strides, channels):
    model = create_model(name, num_classes=10, img_size=size)
    assert (model.feature_strides, model.feature_channels) == (strides, channels)
    maps = model.features(torch.randn(2, 3, size, size))
    expected = [(2, c, size // s, size // s) for c, s in zip(channels, strides, strict=True)]
    assert [tuple(m.shape) for m in maps] == expected
    assert all(m.is_contiguous() for m in maps)


def test_recipe_values():
    cfg = compose_cfg("experiment=swin_imagenet")
    t = cfg.trainer
    assert (cfg.data.name, cfg.backbone.name, cfg.backbone.drop_path_rate) == ("imagenet", "swin_tiny", 0.2)
    assert (t.epochs, t.lr, t.lr_base_size, t.weight_decay) == (300, 5e-4, 512, 0.05)
    assert (t.warmup_epochs, t.warmup_lr, t.min_lr) == (20, 5e-7, 5e-6)
    assert (t.clip_grad, t.clip_mode, t.smoothing) == (5.0, "norm", 0.1)
    mix = t.mixup
    assert (mix.mixup_alpha, mix.cutmix_alpha, mix.prob, mix.switch_prob) == (0.8, 1.0, 1.0, 0.5)
    assert not t.ema.enabled
    assert (cfg.data.batch_size, cfg.data.color_jitter, cfg.data.reprob) == (128, 0.4, 0.25)
    assert cfg.data.auto_augment == "rand-m9-mstd0.5-inc1"
    dp = {n: compose_cfg("experiment=swin_imagenet", f"backbone={n}").backbone.drop_path_rate
          for n in ("swin_small", "swin_base")}
    assert dp == {"swin_small": 0.3, "swin_base": 0.5}


# ---------------------------------------------------------------- the detection code's shifted windows
def official_shift_mask(hp: int, wp: int, window: int, shift: int) -> torch.Tensor:
    """BasicLayer.forward of SwinTransformer/Swin-Transformer-Object-Detection (mmdet/models/backbones/
    swin_transformer.py): region ids on the *padded* grid, -100 between tokens of different regions."""
    regions = torch.zeros(1, hp, wp, 1)
    cuts = (slice(0, -window), slice(-window, -shift), slice(-shift, None))
    for i, (rows, cols) in enumerate((r, c) for r in cuts for c in cuts):
        regions[:, rows, cols, :] = i
    ids = regions.view(hp // window, window, wp // window, window).permute(0, 2, 1, 3)
    ids = ids.reshape(-1, window * window)
    diff = ids[:, None, :] - ids[:, :, None]
    return torch.where(diff != 0, -100.0, 0.0)


def padded_then_shifted_block(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """SwinTransformerBlock.forward of the detection code, written out: norm1, pad to a window multiple,
    roll, window attention (relative position bias, the mask above), un-roll, crop, residual, MLP."""
    b, h, w, c = x.shape
    ws, shift = block.window_size[0], block.shift_size[0]
    attn, heads, n = block.attn, block.attn.num_heads, block.window_size[0] ** 2
    hp, wp = -(-h // ws) * ws, -(-w // ws) * ws
    y = F.pad(block.norm1(x), (0, 0, 0, wp - w, 0, hp - h))
    if shift:
        y = torch.roll(y, (-shift, -shift), (1, 2))
    windows = y.view(b, hp // ws, ws, wp // ws, ws, c).permute(0, 1, 3, 2, 4, 5).reshape(-1, n, c)
    q, k, v = attn.qkv(windows).reshape(-1, n, 3, heads, c // heads).permute(2, 0, 3, 1, 4)
    logits = q @ k.transpose(-2, -1) * (c // heads) ** -0.5
    logits = logits + attn.relative_position_bias_table[attn.relative_position_index.view(-1)].view(
        n, n, heads).permute(2, 0, 1)
    if shift:
        mask = official_shift_mask(hp, wp, ws, shift)
        logits = (logits.view(b, -1, heads, n, n) + mask[None, :, None]).view(-1, heads, n, n)
    out = attn.proj((logits.softmax(-1) @ v).transpose(1, 2).reshape(-1, n, c))
    y = out.view(b, hp // ws, wp // ws, ws, ws, c).permute(0, 1, 3, 2, 4, 5).reshape(b, hp, wp, c)
    if shift:
        y = torch.roll(y, (shift, shift), (1, 2))
    x = x + y[:, :h, :w]
    return x + block.mlp(block.norm2(x))


def test_detection_windows_pad_then_shift_as_the_detection_code():
    """On a 10x13 stage map (not a window multiple, as every stage at 1333x800) each block -- plain and
    shifted windows -- is the detection code's padded-then-rolled attention; timm's roll-then-pad is not."""
    torch.manual_seed(0)
    cfg = compose_cfg("task=detection", "backbone=swin_tiny", "data.canvas_size=64")
    model = build_backbone(cfg.backbone, cfg.norm, dense=True).eval()
    x = torch.randn(2, 10, 13, 96)
    with torch.no_grad():
        for block in model.layers[0].blocks:
            assert block.window_size == (7, 7)
            torch.testing.assert_close(block(x), padded_then_shifted_block(block, x))
        shifted = model.layers[0].blocks[1]
        assert shifted.shift_size == (3, 3)
        timm_order = SwinTransformerBlock._attn(shifted, shifted.norm1(x))
        assert not torch.allclose(shifted._attn(shifted.norm1(x)), timm_order, atol=1e-3)
        # the last stage is shifted too (the detection code never shrinks the window or drops the shift)
        assert model.layers[3].blocks[1].shift_size == (3, 3)


def test_classification_windows_are_unchanged_on_window_multiples():
    """At the sizes the classifiers are built for the grids are window multiples: padding is empty and the
    detection code's order gives timm's numbers exactly."""
    torch.manual_seed(0)
    model = create_model("swin_micro", num_classes=10).eval()
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        ours = model(x)
        for stage in model.layers:
            for block in stage.blocks:
                block.__class__ = SwinTransformerBlock
        torch.testing.assert_close(ours, model(x), rtol=0, atol=0)
