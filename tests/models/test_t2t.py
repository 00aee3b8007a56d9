"""T2T-ViT: published sizes and counts (arXiv 2101.11986; yitu-opensource/T2T-ViT README), both T2T layer
types, norm slots, grids, recipe."""

from __future__ import annotations

import copy
import math

import pytest
import timm.layers
import torch
from conftest import compose_cfg, count_params

from normexp.models import build_backbone, create_model
from normexp.models.stats import count_gmacs
from normexp.models.t2t import PerformerT2TLayer, sinusoid_table
from normexp.norms import norm_layer_factory, replace_norms
from normexp.norms.dtn import DTN
from normexp.norms.placement import norm_slots

# yitu-opensource/T2T-ViT README figure (M) and the exact count of the official code, frozen parameters
# included
# (the fixed sinusoidal table and the Performer random features; the README counts them), and trainable.
PUBLISHED = [
    ("t2t_vit_7", "performer", 4.3, 4_310_222, 4_255_694),
    ("t2t_vit_10", "performer", 5.9, 5_889_230, 5_834_702),
    ("t2t_vit_12", "performer", 6.9, 6_941_902, 6_887_374),
    ("t2t_vit_14", "performer", 21.5, 21_545_550, 21_465_806),
    ("t2t_vit_19", "performer", 39.2, 39_177_422, 39_085_070),
    ("t2t_vit_24", "performer", 64.1, 64_105_934, 64_000_974),
    ("t2t_vit_14", "transformer", 21.5, 21_541_070, 21_465_422),
    ("t2t_vit_19", "transformer", 39.2, 39_172_942, 39_084_686),
    ("t2t_vit_24", "transformer", 64.1, 64_101_454, 64_000_590),
]


def micro_input(size: int = 16) -> torch.Tensor:
    return torch.randn(2, 3, size, size)


@pytest.mark.parametrize("name,tokens_type,paper,exact_all,exact_trainable", PUBLISHED)
def test_parameter_counts_match_the_readme(name, tokens_type, paper, exact_all, exact_trainable):
    with torch.device("meta"):  # counting needs no initialisation
        model = create_model(name, tokens_type=tokens_type, num_classes=1000, img_size=224)
    ours = count_params(model)
    label = name.replace("t2t_vit_", "T2T-ViT_t-" if tokens_type == "transformer" else "T2T-ViT-")
    print(f"{label} | {ours / 1e6:.1f}M ({ours:,}) | {paper}M ({exact_all:,})")
    assert round(ours / 1e6, 1) == paper
    assert ours == exact_all and count_params(model, trainable_only=True) == exact_trainable


def test_t2t_vit_14_parameter_breakdown():
    """T2T-ViT-14 of the official code, part by part ("all" / trainable)."""
    with torch.device("meta"):
        model = create_model("t2t_vit_14", num_classes=1000)
        model_t = create_model("t2t_vit_14", tokens_type="transformer", num_classes=1000)
    t2t = model.tokens_to_token
    assert model.cls_token.numel() == 384 and model.pos_embed.shape == (1, 197, 384)
    assert not model.pos_embed.requires_grad
    assert (count_params(t2t.layers[0]), count_params(t2t.layers[0], True)) == (43_366, 41_318)
    assert (count_params(t2t.layers[1]), count_params(t2t.layers[1], True)) == (126_592, 124_544)
    assert count_params(t2t.project) == 221_568
    assert all(count_params(b) == 1_478_016 for b in model.blocks) and len(model.blocks) == 14
    assert count_params(model.norm) == 768 and count_params(model.head) == 385_000
    layers_t = model_t.tokens_to_token.layers
    assert [count_params(m) for m in layers_t] == [41_126, 124_352]
    assert [count_params(m, True) for m in layers_t] == [41_126, 124_352]


@pytest.mark.parametrize("name,tokens_type,count", [
    ("t2t_vit_7", "performer", 1.15), ("t2t_vit_14", "performer", 4.78), ("t2t_vit_14", "transformer", 6.09),
])
def test_macs_match_the_published_count(name, tokens_type, count):
    """The README's MACs column, counted here (GMACs at 224 px). torch's counter does not see the CPU kernel
    of fused
    attention, so the models are built with timm's explicit-matmul attention here."""
    timm.layers.set_fused_attn(False)
    try:
        model = create_model(name, tokens_type=tokens_type, num_classes=1000)
    finally:
        timm.layers.set_fused_attn(True)
    assert abs(count_gmacs(model, (3, 224, 224)) - count) < 0.01


def test_published_soft_split_schedule_and_grids():
    model = create_model("t2t_vit_7", num_classes=10)
    splits = model.tokens_to_token.soft_splits
    assert [(s.k, s.s, s.p) for s in splits] == [(7, 4, 2), (3, 2, 1), (3, 2, 1)]
    assert model.tokens_to_token.out_grid(224, 224) == (14, 14) and model.stride == 16
    model(torch.randn(1, 3, 64, 64))
    assert [lay.grid for lay in model.t2t_layouts] == [(16, 16), (8, 8)]
    assert model.token_layout.grid == (4, 4) and model.token_layout.num_prefix_tokens == 1


def test_micro_member_schedule_grids_and_size():
    cfg = compose_cfg("backbone=t2t_vit_micro")
    model = build_backbone(cfg.backbone, cfg.norm)
    assert [(s.k, s.s, s.p) for s in model.tokens_to_token.soft_splits] == [(3, 1, 1), (3, 2, 1), (3, 1, 1)]
    out = model(micro_input())
    assert out.shape == (2, 10)
    assert [lay.grid for lay in model.t2t_layouts] == [(16, 16), (8, 8)] and model.token_layout.grid == (8, 8)
    assert model.pos_embed.shape == (1, 65, 96)
    assert count_params(model) < 0.5e6


def test_performer_layer_follows_its_equations():
    """Performer features (models/token_performer.py): phi(x) = exp(w x - |x|^2/2)/sqrt(m),
    y = phi(q)(phi(k)^T v) / (phi(q) sum_t phi(k_t) + 1e-8), out = v + proj(y);
    frozen orthogonal features with rows of norm sqrt(m)."""
    torch.manual_seed(0)
    layer = PerformerT2TLayer(27, 16, kernel_ratio=0.5).eval()
    m = layer.w.shape[0]
    assert m == 8 and not layer.w.requires_grad
    torch.testing.assert_close(layer.w @ layer.w.t(), m * torch.eye(m))
    x = torch.randn(2, 10, 27)
    k, q, v = layer.kqv(layer.norm1(x)).chunk(3, dim=-1)

    def phi(t):
        return torch.exp(t @ layer.w.t() - (t * t).sum(-1, keepdim=True) / 2) / math.sqrt(m)

    kernel = phi(q) @ phi(k).transpose(1, 2)  # (B, N_q, N_k): phi(q_t) . phi(k_s)
    y = (kernel @ v) / (kernel.sum(-1, keepdim=True) + 1e-8)
    out = v + layer.proj(y)
    out = out + layer.mlp(layer.norm2(out))
    torch.testing.assert_close(layer(x), out, rtol=1e-5, atol=1e-6)


def test_sinusoidal_table_is_fixed_and_follows_the_input_size():
    table = sinusoid_table(5, 8)
    assert torch.equal(table[0, 0, 0::2], torch.zeros(4)) and torch.equal(table[0, 0, 1::2], torch.ones(4))
    torch.testing.assert_close(table[0, 3, 2], torch.tensor(math.sin(3 / 10000 ** (2 / 8))))
    model = create_model("t2t_vit_7", num_classes=10, img_size=64)
    torch.testing.assert_close(model.pos_embed.data, sinusoid_table(17, 256))
    # another input size uses the table a model built for that size holds
    assert torch.equal(model._pos_embed(37, model.pos_embed), sinusoid_table(37, 256))
    assert model(torch.randn(1, 3, 96, 96)).shape == (1, 10)
    assert model.token_layout.grid == (6, 6)


def test_frozen_parameters_stay_out_of_the_optimizer():
    from timm.optim import create_optimizer_v2

    model = create_model("t2t_vit_micro", num_classes=10)
    opt = create_optimizer_v2(model, opt="adamw", lr=1e-3, weight_decay=0.05, filter_bias_and_bn=True)
    in_opt = {id(p) for g in opt.param_groups for p in g["params"]}
    frozen = [model.pos_embed, *(layer.w for layer in model.tokens_to_token.layers)]
    assert not any(id(p) in in_opt for p in frozen)
    decayed = {id(p) for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    assert id(model.cls_token) not in decayed


@pytest.mark.parametrize("tokens_type", ["performer", "transformer"])
def test_norm_context_covers_both_parts(tokens_type):
    model = create_model("t2t_vit_micro", num_classes=10, tokens_type=tokens_type)
    slots = norm_slots(model)
    t2t_slots = [f"tokens_to_token.layers.{i}.norm{j}" for i in (0, 1) for j in (1, 2)]
    assert slots == [*t2t_slots, *[f"blocks.{b}.norm{j}" for b in range(4) for j in (1, 2)], "norm"]
    for name in t2t_slots:
        ctx = model.norm_context(name)
        i = int(name.split(".")[2])
        assert ctx["block"] == i and ctx["num_heads"] == 1 and ctx["layout"] is model.t2t_layouts[i]
        assert ctx["num_prefix_tokens"] == 0
    ctx = model.norm_context("blocks.3.norm2")
    assert ctx["block"] == 5 and ctx["num_heads"] == 4 and ctx["layout"] is model.token_layout
    assert ctx["num_prefix_tokens"] == 1
    assert model.norm_context("norm")["block"] is None


def test_dtn_sees_the_grid_of_each_t2t_layer_with_one_head():
    cfg = compose_cfg("backbone=t2t_vit_7", "norm=dtn", "data.img_size=64")
    model = build_backbone(cfg.backbone, cfg.norm)
    layer0, layer1 = model.tokens_to_token.layers
    assert all(isinstance(m, DTN) and m.num_heads == 1 for m in (layer0.norm1, layer0.norm2, layer1.norm2))
    assert layer0.norm1.dim == 147 and layer1.norm1.dim == 576 and layer0.norm2.dim == 64
    assert model.blocks[0].norm1.num_heads == 4 and model.blocks[0].norm1.layout is model.token_layout
    seen = {}
    for name in ("tokens_to_token.layers.0.norm1", "tokens_to_token.layers.1.norm2", "blocks.0.norm1"):
        layer = model.get_submodule(name)
        layer.register_forward_pre_hook(lambda m, a, name=name: seen.__setitem__(name, (a[0].shape[1],
                                                                                        m.layout.grid)))
    model(torch.randn(1, 3, 64, 96)).sum().backward()  # non-square: each grid from the unfold formula
    assert seen == {"tokens_to_token.layers.0.norm1": (16 * 24, (16, 24)),
                    "tokens_to_token.layers.1.norm2": (8 * 12, (8, 12)),
                    "blocks.0.norm1": (1 + 4 * 6, (4, 6))}


def test_ema_copy_tracks_its_own_grids():
    model = create_model("t2t_vit_micro", num_classes=10)
    replace_norms(model, norm_layer_factory("dtn"))
    ema = copy.deepcopy(model)
    model(micro_input(16))
    ema(micro_input(24))
    assert ema.tokens_to_token.layers[0].norm1.layout is ema.t2t_layouts[0]
    assert [lay.grid for lay in ema.t2t_layouts] == [(24, 24), (12, 12)] and ema.token_layout.grid == (12, 12)
    assert [lay.grid for lay in model.t2t_layouts] == [(16, 16), (8, 8)] and model.token_layout.grid == (8, 8)


def test_features_build_a_simple_pyramid_from_the_final_grid():
    model = create_model("t2t_vit_7", num_classes=10, img_size=64, pyramid_scales=(4, 2, 1, 0.5))
    assert model.feature_strides == [4, 8, 16, 32] and model.feature_channels == [64, 128, 256, 256]
    maps = model.features(torch.randn(2, 3, 64, 64))
    assert [tuple(m.shape) for m in maps] == [(2, 64, 16, 16), (2, 128, 8, 8), (2, 256, 4, 4), (2, 256, 2, 2)]
    micro = create_model("t2t_vit_micro", num_classes=10, pyramid_scales=(2, 1, 0.5))  # total stride 2
    assert micro.feature_strides == [1, 2, 4]
    assert [m.shape[-1] for m in micro.features(micro_input())] == [16, 8, 4]
    with pytest.raises(RuntimeError, match="pyramid_scales"):
        create_model("t2t_vit_micro").features(micro_input())


def test_tokens_type_is_validated():
    with pytest.raises(ValueError, match="tokens_type"):
        create_model("t2t_vit_micro", tokens_type="conv")


def test_imagenet_recipe_matches_protocols():
    """yitu-opensource/T2T-ViT main.py / README: absolute lr, 8 x 64, wd 0.05, 10 warm-up epochs, 300 + 10
    cool-down epochs, EMA, colour jitter 0.4."""
    cfg = compose_cfg("experiment=t2t_imagenet")
    t, d = cfg.trainer, cfg.data
    assert cfg.backbone.name == "t2t_vit_14" and cfg.backbone.tokens_type == "performer"
    assert cfg.backbone.drop_path_rate == 0.1 and d.name == "imagenet" and d.img_size == 224
    assert (t.epochs, t.cooldown_epochs, t.lr, t.lr_base_size, t.weight_decay) == (310, 10, 5e-4, None, 0.05)
    assert (t.warmup_epochs, t.warmup_lr, t.min_lr, t.smoothing) == (10, 1e-6, 1e-5, 0.1)
    assert (t.mixup.mixup_alpha, t.mixup.cutmix_alpha, t.clip_grad) == (0.8, 1.0, None)
    assert t.ema.enabled and t.ema.decay == 0.99996 and t.best_metric == "ema/val/top1"
    assert d.batch_size * 8 == 512 and d.color_jitter == 0.4 and d.reprob == 0.25
    assert d.auto_augment == "rand-m9-mstd0.5-inc1" and cfg.seed == 42
