"""LeViT sizes vs the official counts, norm=bn == timm's LeViT, every normalizer in every slot, recipe."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import compose_cfg, count_params
from timm.models.levit import LevitDistilled, model_cfgs
from torch import nn

from normexp.models import build_backbone, create_model
from normexp.models.build import norm_settings
from normexp.models.levit import TokenLinearNorm, slot_heads
from normexp.models.stats import count_gmacs
from normexp.norms import TokenLayout, get_norm_class, list_norms, norm_layer_factory, replace_norms

# facebookresearch/LeViT README model zoo and the exact unfused counts of the official code with both heads
# (= timm), README rounding (M)
PAPER = {"levit_128s": (7_777_058, 7.8), "levit_128": (9_213_936, 9.2), "levit_192": (10_947_069, 11),
         "levit_256": (18_893_876, 19), "levit_384": (39_128_836, 39)}



@pytest.mark.parametrize("name", list(PAPER))
def test_parameter_counts_match_the_paper(name):
    exact, readme = PAPER[name]
    model = create_model(name, num_classes=1000, img_size=224)
    ours = count_params(model)
    print(f"{name} | {ours / 1e6:.2f}M ({ours:,}) | {readme}M ({exact:,})")
    assert ours == exact and round(ours / 1e6, 1 if readme < 10 else 0) == readme
    single = create_model(name, num_classes=1000, img_size=224, distilled=False)
    assert count_params(single) == exact - count_params(model.head_dist) and not hasattr(single, "head_dist")


def test_micro_member_size():
    model = create_model("levit_micro", num_classes=10)
    params, gmacs = count_params(model), count_gmacs(model, (3, 16, 16))
    print(f"levit_micro | {params / 1e6:.3f}M | {gmacs:.4f} GMACs")
    assert params < 1e6 and gmacs < 0.05


def _timm_state_for(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """timm's LeViT tensors under the names of ``model`` (our "bn" wraps its BatchNorm1d as ``.bn``)."""
    ours = model.state_dict()
    mapped = {}
    for key, value in state.items():
        if key not in ours:
            head, _, leaf = key.rpartition(".")
            key = f"{head}.bn.{leaf}"
        assert key in ours
        mapped[key] = value
    return mapped


@pytest.mark.parametrize("norm", [None, "bn"])
def test_norm_bn_is_timms_levit(norm):
    """As built (BatchNorm2d on the token map) and with norm=bn (our BatchNorm over batch x tokens), LeViT
    computes what timm's LeViT (BatchNorm1d on (B*N, C)) computes: outputs in train and eval mode, running
    statistics and gradients."""
    torch.manual_seed(0)
    ref = LevitDistilled(**model_cfgs["levit_128s"], img_size=64, num_classes=10).double()
    model = create_model("levit_128s", img_size=64, num_classes=10).double()
    if norm is not None:
        replace_norms(model, norm_layer_factory(norm))
        model.double()
        assert type(model.stages[0].blocks[0].attn.qkv.bn) is get_norm_class("bn")
    with torch.no_grad():  # non-trivial affine and running statistics
        for key, value in ref.state_dict().items():
            if key.endswith(("bn.weight", "bn.bias", "running_mean")):
                value.uniform_(-1, 1)
            elif key.endswith("running_var"):
                value.uniform_(0.5, 2)
    model.load_state_dict(_timm_state_for(model, ref.state_dict()))  # strict: the same tensors
    x = torch.randn(4, 3, 64, 64, dtype=torch.float64)
    for train in (True, False):
        ref.train(train), model.train(train)
        out_ref, out = ref(x), model(x)
        torch.testing.assert_close(out, out_ref)
        if train:
            out_ref.square().sum().backward()
            out.square().sum().backward()
    grads = {k: p.grad for k, p in model.named_parameters()}
    for key, p in _timm_state_for(model, dict(ref.named_parameters())).items():
        torch.testing.assert_close(grads[key], p.grad)
    torch.testing.assert_close(model.state_dict(), _timm_state_for(model, ref.state_dict()))


@pytest.mark.parametrize("norm", list_norms())
def test_the_map_view_is_the_token_norm_with_a_layout(norm):
    """A LinearNorm slot sees the (B, N, C) tokens as their (B, C, H, W) map because placement builds every
    BatchNorm slot channels-first; every normalizer computes there what it computes on (B, N, C) tokens
    with the grid as layout (the brief's form)."""
    torch.manual_seed(0)
    layout = TokenLayout()
    layout.set_grid(3, 4)
    name, hparams, _ = norm_settings(compose_cfg("backbone=levit_micro", f"norm={norm}").norm)
    build = norm_layer_factory(name, **hparams)
    context = dict(num_heads=4, layout=layout, num_prefix_tokens=0)
    lin = TokenLinearNorm(nn.Linear(8, 16, bias=False), layout)
    lin.bn = build(16, data_format="channels_first", **context)
    tokens = build(16, data_format="channels_last", **context)
    with torch.no_grad():
        for p in lin.bn.parameters():
            p.uniform_(0.5, 1.5)
    tokens.load_state_dict(lin.bn.state_dict())
    x = torch.randn(2, 12, 8)
    torch.testing.assert_close(lin(x), tokens(lin.linear(x)))
    torch.testing.assert_close(lin.bn.state_dict(), tokens.state_dict())  # running statistics too


@pytest.mark.parametrize("norm", list_norms())
def test_every_norm_keeps_the_classifier_bn_and_the_zero_init_residual_ends(norm):
    """The classifier's BN sees one pooled vector: kept for every normalizer; LeViT zero-initialises the last
    norm of each residual branch, whatever fills it (every slot and the forward pass: test_every_backbone)."""
    cfg = compose_cfg("backbone=levit_micro", f"norm={norm}")
    model = build_backbone(cfg.backbone, cfg.norm)
    assert isinstance(model.head.bn, nn.BatchNorm1d) and isinstance(model.head_dist.bn, nn.BatchNorm1d)
    residual_ends = [m.bn for n, m in model.named_modules() if n.endswith(("attn.proj.ln", "mlp.ln2"))]
    assert residual_ends
    for layer in residual_ends:
        weight = getattr(layer, "weight", None)
        assert weight is None or not weight.any()


def test_norm_context_blocks_heads_and_grids():
    model = create_model("levit_128s", num_classes=1000)  # depths 2-3-4, heads 4-6-8, key dim 16
    ctx = model.norm_context
    assert ctx("stem.conv1.bn") == {"block": None, "num_heads": 4, "layout": None, "num_prefix_tokens": 0}
    assert ctx("stages.0.blocks.1.mlp.ln1.bn")["block"] == 1
    ds = ctx("stages.1.downsample.attn_downsample.kv.bn")
    assert (ds["block"], ds["num_heads"], ds["layout"]) == (2, 8, model.stage_layouts[0])  # 128 // 16 heads
    assert ctx("stages.1.downsample.attn_downsample.q.ln.bn")["layout"] is model.stage_layouts[1]
    assert ctx("stages.1.blocks.0.attn.qkv.bn")["num_heads"] == 6  # 6 x (16 + 16 + 32) channels
    assert ctx("stages.1.blocks.0.attn.proj.ln.bn")["num_heads"] == 4  # 256 channels: 6 does not divide
    assert ctx("stages.2.downsample.mlp.ln2.bn")["block"] == 6
    assert ctx("stages.2.blocks.3.mlp.ln2.bn")["block"] == 10
    assert slot_heads(288, 5) == 4 and slot_heads(512, 9) == 8 and slot_heads(384, 12) == 12
    # the subsample attention: keys/values on the previous grid, queries on the subsampled one
    seen = {}
    for name in ("stages.1.downsample.attn_downsample.kv.bn", "stages.1.downsample.attn_downsample.q.ln.bn",
                 "stages.2.blocks.0.attn.qkv.bn", "stem.conv4.bn"):
        model.get_submodule(name).register_forward_pre_hook(
            lambda m, args, name=name: seen.__setitem__(name, tuple(args[0].shape)))
    model.eval()(torch.randn(1, 3, 224, 224))
    assert [lay.grid for lay in model.stage_layouts] == [(14, 14), (7, 7), (4, 4)]
    assert seen == {"stages.1.downsample.attn_downsample.kv.bn": (1, 640, 14, 14),
                    "stages.1.downsample.attn_downsample.q.ln.bn": (1, 128, 7, 7),
                    "stages.2.blocks.0.attn.qkv.bn": (1, 512, 4, 4), "stem.conv4.bn": (1, 128, 14, 14)}


def test_fixed_resolution_is_checked():
    model = create_model("levit_micro", num_classes=10)
    with pytest.raises(ValueError, match="fixed-resolution"):
        model(torch.randn(1, 3, 32, 32))
    with pytest.raises(ValueError, match="divisible by the stem stride"):
        create_model("levit_128s", img_size=200)


def test_distillation_head_is_averaged_and_survives_deepcopy():
    model = create_model("levit_micro", num_classes=10)
    replace_norms(model, norm_layer_factory("dtn"))
    x = torch.randn(3, 3, 16, 16)
    pooled = model.forward_head(model.forward_features(x), pre_logits=True)
    torch.testing.assert_close(model(x), (model.head(pooled) + model.head_dist(pooled)) / 2)
    ema = copy.deepcopy(model)
    ema.eval()(x)
    assert ema.stages[1].blocks[0].attn.qkv.layout is ema.stage_layouts[1]
    assert ema.stage_layouts[1].grid == (4, 4)


@pytest.mark.parametrize("name,size,strides,channels", [
    ("levit_micro", 16, [2, 4, 8], [64, 96, 128]),
    ("levit_128s", 224, [16, 32, 64], [128, 256, 384]),
])
def test_features_are_the_stage_maps(name, size, strides, channels):
    model = create_model(name, num_classes=10, img_size=size).eval()
    assert (model.feature_strides, model.feature_channels) == (strides, channels)
    maps = model.features(torch.randn(2, 3, size, size))
    expected = [(2, c, -(-size // s), -(-size // s)) for c, s in zip(channels, strides, strict=True)]
    assert [tuple(m.shape) for m in maps] == expected


def test_recipe_values():
    cfg = compose_cfg("experiment=levit_imagenet")
    t = cfg.trainer
    assert (cfg.data.name, cfg.backbone.name, cfg.norm.name) == ("imagenet", "levit_256", "bn")
    assert (t.epochs, t.lr, t.lr_base_size, t.weight_decay) == (1000, 5e-4, 512, 0.025)
    assert (t.warmup_epochs, t.warmup_lr, t.min_lr) == (5, 1e-6, 1e-5)
    assert (t.clip_grad, t.clip_mode, t.smoothing) == (0.01, "agc", 0.1)
    assert (t.mixup.mixup_alpha, t.mixup.cutmix_alpha) == (0.8, 1.0)
    assert t.ema.enabled and t.ema.decay == 0.99996
    assert (cfg.data.batch_size, cfg.data.color_jitter, cfg.data.reprob) == (256, 0.4, 0.25)
    assert cfg.data.auto_augment == "rand-m9-mstd0.5-inc1"
    dp = {n: compose_cfg("experiment=levit_imagenet", f"backbone={n}").backbone.drop_path_rate for n in PAPER}
    assert dp == {"levit_128s": 0.0, "levit_128": 0.0, "levit_192": 0.0, "levit_256": 0.0, "levit_384": 0.1}
