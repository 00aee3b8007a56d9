"""torchvision's ResNet-50 and VGG19-BN (DyT Table 16): torchvision's parameter counts and weights, every
BatchNorm a channels-first DyT under norm=dyt, the norm context, skipinit's branches, the micro members, and
torchvision's classic recipe (experiment=torchvision_imagenet)."""

from __future__ import annotations

import pytest
import torch
import torchvision
from conftest import compose_cfg, count_params, forward_backward
from torch import nn

from normexp.errors import UserError
from normexp.models import build_backbone, create_model
from normexp.models.stats import count_gmacs
from normexp.models.torchvision_cnn import conv_heads
from normexp.norms.dyt import DyT
from normexp.norms.normfree import residual_branches
from normexp.norms.placement import norm_slots

PAIRS = {"resnet50": "resnet50", "vgg19_bn": "vgg19_bn"}  # ours -> torchvision's


def torchvision_keys(name: str, state: dict) -> dict:
    """Our state-dict keys as torchvision names them (VGG's conv stack: ``convs`` here, ``features``)."""
    return {("features" + k[len("convs"):] if k.startswith("convs.") else k): v for k, v in state.items()}


@pytest.mark.parametrize("name", sorted(PAIRS))
def test_parameter_counts_and_shapes_are_torchvisions(name):
    with torch.device("meta"):  # counting needs no initialisation
        ours, theirs = create_model(name, num_classes=1000), getattr(torchvision.models, PAIRS[name])()
    print(f"{name} | {count_params(ours):,} | torchvision {count_params(theirs):,}")
    expected = {"resnet50": 25_557_032, "vgg19_bn": 143_678_248}[name]  # torchvision's model cards
    assert count_params(ours) == count_params(theirs) == expected
    shapes = {k: v.shape for k, v in torchvision_keys(name, ours.state_dict()).items()}
    assert shapes == {k: v.shape for k, v in theirs.state_dict().items()}
    slots = sum(isinstance(m, nn.BatchNorm2d) for m in ours.modules())
    assert slots == {"resnet50": 53, "vgg19_bn": 16}[name]


def same_as_torchvision(name: str) -> None:
    torch.manual_seed(0)
    ours = create_model(name, num_classes=1000).eval()
    torch.manual_seed(0)
    theirs = getattr(torchvision.models, PAIRS[name])().eval()
    mine = torchvision_keys(name, ours.state_dict())
    assert list(mine) == list(theirs.state_dict())
    assert all(torch.equal(mine[k], v) for k, v in theirs.state_dict().items())  # same order, same init
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), rtol=0, atol=0)


def test_resnet50_is_torchvisions_weight_for_weight():
    """A seed gives torchvision's weights (modules created in its order, its kaiming fan-out / BN init, no
    zero-init of bn3) and its outputs."""
    same_as_torchvision("resnet50")


@pytest.mark.slow  # 2 x 144M parameters initialised on the CPU: 3-15 s and 1.2 GB
def test_vgg19_bn_is_torchvisions_weight_for_weight():
    same_as_torchvision("vgg19_bn")


@pytest.mark.parametrize("name", ["resnet50", "vgg19_bn", "resnet50_micro", "vgg19_bn_micro"])
def test_dyt_replaces_every_batchnorm_channels_first(name):
    overrides = [f"backbone={name}", "norm=dyt"] + ([] if name.endswith("_micro") else ["data=imagenet"])
    cfg = compose_cfg(*overrides)
    with torch.device("meta"):
        built = create_model(name, num_classes=10)
        model = build_backbone(cfg.backbone, cfg.norm)
    slots = norm_slots(built)
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    dyts = {n: m for n, m in model.named_modules() if isinstance(m, DyT)}
    assert sorted(dyts) == sorted(slots)
    assert all(m.data_format == "channels_first" and m.weight.shape == (built.get_submodule(n).num_features,)
               for n, m in dyts.items())
    assert cfg.norm.alpha0 == 0.5  # the paper's default: no backbone suggests another


def test_dyt_is_per_channel_on_the_map():
    torch.manual_seed(0)
    cfg = compose_cfg("backbone=resnet50_micro", "norm=dyt")
    model = build_backbone(cfg.backbone, cfg.norm)
    seen = {}
    # clones: the in-place ReLU after the slot overwrites its output
    model.layer2[0].bn2.register_forward_hook(
        lambda m, args, out: seen.update(io=(args[0].clone(), out.clone())))
    model(torch.randn(2, 3, 16, 16))
    inp, out = seen["io"]
    slot = model.layer2[0].bn2
    assert inp.shape[1] == slot.weight.numel() == 32 and inp.shape[-1] == 8
    expected = slot.weight[:, None, None] * torch.tanh(0.5 * inp) + slot.bias[:, None, None]
    torch.testing.assert_close(out, expected)


def test_norm_context_blocks_and_group_counts():
    assert [conv_heads(c) for c in (16, 64, 96, 256, 2048)] == [16, 32, 32, 32, 32]
    resnet = create_model("resnet50", num_classes=10)
    ctx = resnet.norm_context
    assert ctx("bn1")["block"] is None
    blocks = [ctx(s)["block"] for s in ("layer1.0.bn1", "layer2.0.downsample.1", "layer4.2.bn3")]
    assert blocks == [0, 3, 15]
    assert all(not ctx(s)["pooled"] and ctx(s)["layout"] is None for s in norm_slots(resnet))
    assert ctx("layer1.0.bn3.bn") == ctx("layer1.0.bn3")  # the suite's bn layer's own child: its slot's
    vgg = create_model("vgg19_bn_micro", num_classes=10)
    stages = [vgg.norm_context(s)["block"] for s in norm_slots(vgg)]
    assert stages == [0, 1, 2, 2, 3, 3]
    assert [vgg.norm_context(s)["num_heads"] for s in norm_slots(vgg)] == [16, 32, 32, 32, 32, 32]


def test_skipinit_gates_each_bottleneck_and_refuses_vgg():
    torch.manual_seed(0)
    cfg = compose_cfg("backbone=resnet50_micro", "norm=skipinit")
    model = build_backbone(cfg.backbone, cfg.norm)
    assert residual_branches(model) == [f"layer{i}.0.bn3" for i in range(1, 5)]
    block = model.layer2[0]
    seen = {}
    block.register_forward_hook(lambda m, args, out: seen.update(io=(args[0], out)))
    model(torch.randn(2, 3, 16, 16))
    x, out = seen["io"]
    assert torch.equal(out, torch.relu(block.downsample(x)))  # the branch is gated off at init
    cfg = compose_cfg("backbone=vgg19_bn_micro", "norm=skipinit")
    with pytest.raises(UserError, match="names none"):
        build_backbone(cfg.backbone, cfg.norm)


@pytest.mark.parametrize("name", ["resnet50_micro", "vgg19_bn_micro"])
@pytest.mark.parametrize("norm", ["bn", "dyt"])
def test_micro_members_train_at_16px(name, norm):
    torch.manual_seed(0)
    cfg = compose_cfg(f"backbone={name}", f"norm={norm}")
    model = build_backbone(cfg.backbone, cfg.norm)
    forward_backward(model, 16)
    maps = model.features(torch.randn(2, 3, 16, 16))
    assert [m.shape[-1] for m in maps] == [16 // s for s in model.feature_strides]
    params, gmacs = count_params(model), count_gmacs(model, (3, 16, 16))
    print(f"{name} {norm} | {params / 1e6:.3f}M | {gmacs:.4f} GMACs")
    assert params < 0.6e6 and gmacs < 0.01


def test_features_at_imagenet_strides():
    model = create_model("resnet50", num_classes=10)
    assert (model.feature_channels, model.feature_strides) == ([256, 512, 1024, 2048], [4, 8, 16, 32])
    with torch.device("meta"):
        vgg = create_model("vgg19_bn", num_classes=10)
    assert (vgg.feature_channels, vgg.feature_strides) == ([128, 256, 512, 512], [4, 8, 16, 32])
    maps = model.features(torch.randn(1, 3, 64, 64))
    assert [tuple(m.shape[1:]) for m in maps] == [(256, 16, 16), (512, 8, 8), (1024, 4, 4), (2048, 2, 2)]


def test_torchvision_recipe_values():
    """pytorch/vision references/classification train.py defaults (DyT Table 16's recipe)."""
    cfg = compose_cfg("experiment=torchvision_imagenet", "backbone=vgg19_bn", "norm=dyt")
    t, d = cfg.trainer, cfg.data
    assert (cfg.backbone.name, cfg.norm.name, d.name, d.img_size) == ("vgg19_bn", "dyt", "imagenet", 224)
    assert (t.opt, t.lr, t.lr_base_size, t.global_batch, d.batch_size, t.epochs) == \
        ("momentum", 0.1, 256, 256, 32, 90)
    assert (t.sched, t.decay_epochs, t.decay_rate, t.sched_on, t.sched_lag, t.warmup_epochs) == \
        ("step", 30, 0.1, "epoch", 0, 0)
    assert (t.weight_decay, t.decay_norm_and_bias) == (1e-4, True)
    assert (t.smoothing, t.mixup.mixup_alpha, t.mixup.cutmix_alpha, t.ema.enabled, t.clip_grad, t.amp) == \
        (0.0, 0.0, 0.0, False, None, None)
    assert (d.auto_augment, d.color_jitter, d.reprob, d.interpolation, d.crop_pct, d.aug_repeats) == \
        (None, None, 0.0, "bilinear", 0.875, 0)
    assert compose_cfg("experiment=torchvision_imagenet").backbone.name == "resnet50"
    assert compose_cfg("experiment=torchvision_imagenet").norm.name == "bn"


def test_torchvision_recipe_transforms():
    """RandomResizedCrop 224 + flip only; evaluation resize 256, centre crop 224; bilinear."""
    from normexp.data.transforms import build_transforms

    d = compose_cfg("experiment=torchvision_imagenet").data
    train = [type(t).__name__ for t in build_transforms(d, is_training=True).transforms]
    assert train == ["RandomResizedCropAndInterpolation", "RandomHorizontalFlip", "MaybeToTensor",
                     "Normalize"]
    crop = build_transforms(d, is_training=True).transforms[0]
    assert (crop.size, crop.scale) == ((224, 224), (0.08, 1.0))
    assert str(crop.interpolation) == "InterpolationMode.BILINEAR"
    evaluation = build_transforms(d, is_training=False).transforms
    assert (evaluation[0].size, evaluation[1].size) == (256, (224, 224))
