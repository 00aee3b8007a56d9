"""Normalization-free baselines (DyT Table 9): ``norm=none`` leaves no normalization in the model;
``norm=skipinit`` starts as the identity on the residual stream (SkipInit, arXiv 2002.10444), its gates the
only branch parameters that learn in the first step, on every family and in a task's model around one;
``norm=fixup`` initialises a ViT as Fixup's Transformer code (arXiv 1901.09321) or T-Fixup's (Huang et al.
2020) does, a ResNet as Fixup's ResNet code;
``norm=sigma_reparam`` keeps every weight's spectral norm at its learnable scalar (arXiv 2303.06296)."""

from __future__ import annotations

import pytest
import torch
from conftest import compose_cfg
from torch import nn

from normexp.errors import UserError
from normexp.models import build_backbone, build_model
from normexp.norms.normfree import NoNorm, residual_branches
from normexp.norms.placement import SLOT_TYPES
from normexp.norms.sigma_reparam import SpectralReparam
from normexp.tasks.classification import start_from
from normexp.tasks.dino import build_network
from normexp.tasks.mae import build_mae
from normexp.tracking.records import RunRecord


def vit(norm: str) -> nn.Module:
    torch.manual_seed(0)
    cfg = compose_cfg("backbone=vit_micro", f"norm={norm}")
    return build_backbone(cfg.backbone, cfg.norm)


def test_none_leaves_no_normalization():
    model = vit("none")
    assert not [m for m in model.modules() if isinstance(m, SLOT_TYPES)]
    assert sum(isinstance(m, NoNorm) for m in model.modules()) == 2 * 6 + 1
    x = torch.randn(2, 64, 96)
    assert torch.equal(model.blocks[0].norm1(x), x)


def test_skipinit_starts_as_the_identity_on_the_residual_stream():
    model = vit("skipinit")
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    for block in model.blocks:
        block.register_forward_hook(lambda _m, args, out: seen.append((args[0], out)))
    model(torch.randn(2, 3, 16, 16)).sum().backward()
    assert len(seen) == 6 and all(torch.equal(x, y) for x, y in seen)
    gates = {n: p for n, p in model.named_parameters() if n.endswith("skip_gate")}
    assert sorted(gates) == sorted(f"blocks.{i}.{b}.skip_gate" for i in range(6) for b in ("attn", "mlp"))
    assert all(p.item() == 0 and p.grad.abs().item() > 0 for p in gates.values())
    assert not model.blocks[0].attn.qkv.weight.grad.any()  # gated off: nothing reaches the branch yet
    assert set(vit("ln").state_dict()) - set(model.state_dict()) == {
        k for k in vit("ln").state_dict() if ".norm" in k or k.startswith("norm.")}  # only the norms went


def test_every_model_names_its_branches_a_task_model_both_its_own_and_its_backbones():
    mae = build_mae(compose_cfg("task=mae", "norm=skipinit"))
    branches = residual_branches(mae)
    assert "encoder.blocks.0.attn" in branches and "decoder_blocks.0.mlp" in branches
    assert all(hasattr(mae.get_submodule(b), "skip_gate") for b in branches)


def test_a_model_without_residual_branches_is_one_line():
    with pytest.raises(UserError, match="norm=skipinit works on residual branches, and Sequential names"):
        build_model(lambda: nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)), {"name": "skipinit"}, "a toy")


@pytest.fixture
def kept_draws(monkeypatch):
    """Xavier's draws keep the weights as built, so that a rule's scaling is seen exactly."""
    monkeypatch.setattr(torch.nn.init, "xavier_uniform_", lambda tensor, gain=1.0: tensor)


def test_fixup_is_zhangs_transformer_code(kept_draws):
    """hongyi-zhang/Fixup transformer_zero.py: L = the residual branches (2 x 6); the fused q, k, v
    projection x L^(-1/6), fc1 x L^(-1/2), the output projection, fc2 and the classifier at zero, no biases;
    a scalar shift on the attention's input and before fc1, the activation and fc2, a multiplier on each
    branch, and a shift and a multiplier where the final norm was. (ViT-B: 0.5888 and 0.2041.)"""
    plain, fixup = vit("none"), vit("fixup")  # same seed, same draws: Fixup only rescales after
    depth = 2 * 6
    for i in range(6):
        before, after = plain.blocks[i], fixup.blocks[i]
        torch.testing.assert_close(after.attn.qkv.weight, before.attn.qkv.weight * depth ** (-1 / 6))
        torch.testing.assert_close(after.mlp.fc1.weight, before.mlp.fc1.weight * depth ** (-1 / 2))
        for layer in (after.attn.qkv, after.attn.proj, after.mlp.fc1, after.mlp.fc2):
            assert layer.bias is None  # built without biases: the scalar shifts stand in
        assert not after.attn.proj.weight.any() and not after.mlp.fc2.weight.any()
    assert not fixup.head.weight.any()
    assert torch.equal(fixup.patch_embed.proj.weight, plain.patch_embed.proj.weight)
    scalars = {n for n, _ in fixup.named_parameters()} - {n for n, _ in plain.named_parameters()}
    per_block = ("attn.fixup_bias", "attn.fixup_scale", "mlp.fc1.fixup_bias", "mlp.act.fixup_bias",
                 "mlp.fc2.fixup_bias", "mlp.fixup_scale")
    assert {f"blocks.{i}.{n}" for i in range(6) for n in per_block} | {"norm.fixup_bias",
                                                                        "norm.fixup_scale"} == scalars


def test_t_fixup_is_huangs_encoder_rule(kept_draws):
    """layer6ai-labs/T-Fixup fixup_initialization for N = 6 blocks: the value rows x sqrt(2) 0.67 N^(-1/4)
    (over fairseq's gain-1/sqrt(2) draw), the output projection and the MLP x 0.67 N^(-1/4), queries and keys
    as drawn, the input embedding x (9N)^(-1/4); nothing at zero, no new parameter (ViT-B: 0.3600, 0.3102)."""
    plain = vit("none")
    torch.manual_seed(0)
    cfg = compose_cfg("backbone=vit_micro", "norm=fixup", "norm.rule=t_fixup")
    fixup = build_backbone(cfg.backbone, cfg.norm)
    f, g = 0.67 * 6 ** (-1 / 4), (9 * 6) ** (-1 / 4)
    for i in range(6):
        before, after = plain.blocks[i], fixup.blocks[i]
        torch.testing.assert_close(after.attn.qkv.weight[:192], before.attn.qkv.weight[:192])
        torch.testing.assert_close(after.attn.qkv.weight[192:], before.attn.qkv.weight[192:] * 2 ** 0.5 * f)
        for name in ("attn.proj", "mlp.fc1", "mlp.fc2"):
            layer = after.get_submodule(name)
            torch.testing.assert_close(layer.weight, before.get_submodule(name).weight * f)
            assert not layer.bias.any()
    for name in ("patch_embed.proj.weight", "patch_embed.proj.bias", "pos_embed", "cls_token"):
        torch.testing.assert_close(fixup.get_parameter(name), plain.get_parameter(name) * g)
    assert fixup.state_dict().keys() == plain.state_dict().keys()


def test_t_fixup_takes_each_stack_on_its_own_and_refuses_convolutional_branches(kept_draws):
    """MAE: the encoder's and the decoder's blocks are two stacks, each with its own N; a ResNet has no
    Transformer block, where T-Fixup is defined: one line."""
    torch.manual_seed(0)
    plain = build_mae(compose_cfg("task=mae", "norm=none"))
    torch.manual_seed(0)
    cfg = compose_cfg("task=mae", "norm=fixup", "norm.rule=t_fixup")
    fixup = build_mae(cfg)
    for stack in ("encoder.blocks", "decoder_blocks"):
        name, factor = f"{stack}.0.mlp.fc1.weight", 0.67 * len(fixup.get_submodule(stack)) ** -0.25
        torch.testing.assert_close(fixup.get_parameter(name), plain.get_parameter(name) * factor)
    cfg = compose_cfg("backbone=resnet50_micro", "norm=fixup", "norm.rule=t_fixup")
    with pytest.raises(UserError, match="norm.rule=t_fixup is T-Fixup's rule for Transformer") as error:
        build_backbone(cfg.backbone, cfg.norm)
    assert "\n" not in str(error.value)


def build(name: str, norm: str, *overrides: str) -> nn.Module:
    torch.manual_seed(0)
    cfg = compose_cfg(f"backbone={name}", f"norm={norm}", *overrides)
    return build_backbone(cfg.backbone, cfg.norm)


def test_fixup_on_other_families(kept_draws):
    """LeViT's fused qkv holds each head's q, k and v in turn: T-Fixup scales the v rows only; Fixup's
    scalars sit where a model declares its final norm (Swin's), not on its patch-embedding or merging norms;
    MAE's output layer starts at zero; DINO's weight-normed head is no classifier to zero."""
    plain, fixup = build("levit_micro", "none"), build("levit_micro", "fixup", "norm.rule=t_fixup")
    attn = fixup.stages[0].blocks[0].attn
    rows = torch.arange(attn.qkv.linear.weight.shape[0]).view(attn.num_heads, -1)
    v = rows[:, 2 * attn.key_dim:].flatten()
    qk = rows[:, :2 * attn.key_dim].flatten()
    before = plain.stages[0].blocks[0].attn.qkv.linear.weight
    depth = len(fixup.stages[0].blocks) + len(fixup.stages[1].blocks) + len(fixup.stages[2].blocks)
    torch.testing.assert_close(attn.qkv.linear.weight[qk], before[qk])
    torch.testing.assert_close(attn.qkv.linear.weight[v], before[v] * 2 ** 0.5 * 0.67 * depth ** -0.25)
    swin = build("swin_micro", "fixup")
    assert {n.rpartition(".")[0] for n, _ in swin.named_parameters() if n.endswith("fixup_scale")
            and "blocks" not in n} == {"norm"}
    mae = build_mae(compose_cfg("task=mae", "norm=fixup"))
    assert not mae.decoder_pred.weight.any() and hasattr(mae.decoder_norm, "fixup_scale")
    dino = build_network(compose_cfg("task=dino", "norm=fixup"))
    assert all(layer.weight.any() for layer in dino.head.mlp if isinstance(layer, nn.Linear))


def test_the_xavier_draws_are_fairseqs():
    """Zhang's fused [3d, d] projection drawn whole (bound sqrt(6 / 4d)) and T-Fixup's q, k, v each at gain
    1/sqrt(2) (the same bound): before their factors."""
    fixup = vit("fixup")
    bound = (6 / (4 * 96)) ** 0.5
    assert fixup.blocks[0].attn.qkv.weight.abs().max() <= bound * 12 ** (-1 / 6)
    assert fixup.blocks[0].attn.qkv.weight.abs().max() > 0.9 * bound * 12 ** (-1 / 6)
    torch.manual_seed(0)
    cfg = compose_cfg("backbone=vit_micro", "norm=fixup", "norm.rule=t_fixup")
    qkv = build_backbone(cfg.backbone, cfg.norm).blocks[0].attn.qkv.weight
    assert bound * 0.9 < qkv[:192].abs().max() <= bound
    # a depthwise convolution (PVT v2's MLP) keeps its weight: Xavier's fans ignore groups; then the factor
    plain = build("pvt_v2_micro", "none").stages[0].blocks[0].mlp.dwconv.weight
    for rule in ("fixup", "t_fixup"):
        model = build("pvt_v2_micro", "fixup", f"norm.rule={rule}")
        stack = sum(".attn" in n for n in residual_branches(model))
        factor = len(residual_branches(model)) ** -0.25 if rule == "fixup" else 0.67 * stack ** -0.25
        torch.testing.assert_close(model.stages[0].blocks[0].mlp.dwconv.weight, plain * factor)


def test_fixup_on_a_resnet_is_the_papers_own_case_bottlenecks_of_three_layers():
    def resnet(norm: str) -> nn.Module:
        torch.manual_seed(0)
        cfg = compose_cfg("backbone=resnet50_micro", f"norm={norm}")
        return build_backbone(cfg.backbone, cfg.norm)

    plain, fixup = resnet("none"), resnet("fixup")
    branches = residual_branches(fixup)  # one bn3 per bottleneck
    assert len(branches) == 4
    scale = len(branches) ** (-1 / (2 * 3 - 2))  # m = 3: L^(-1/4)
    for name in (b.rpartition(".")[0] for b in branches):
        before, after = plain.get_submodule(name), fixup.get_submodule(name)
        torch.testing.assert_close(after.conv1.weight, before.conv1.weight * scale)
        torch.testing.assert_close(after.conv2.weight, before.conv2.weight * scale)
        assert not after.conv3.weight.any() and hasattr(after.bn3, "fixup_scale")
    # fixup_resnet_imagenet.py's scalars: before each conv (1a, 2a, 3a), before each ReLU (1b, 2b), a
    # multiplier and a bias at the end; a bias before the classifier
    block = {n.rpartition(".")[2]: n for n in (b.rpartition(".")[0] for b in branches)}
    scalars = {n.removeprefix(block[next(iter(block))] + ".") for n, _ in fixup.named_parameters()
               if n.startswith(block[next(iter(block))] + ".") and "fixup" in n}
    assert scalars == {f"{m}.fixup_bias" for m in ("conv1", "conv2", "conv3", "bn1", "bn2", "bn3")} | \
        {"bn3.fixup_scale"}
    assert not fixup.fc.weight.any() and hasattr(fixup.fc, "fixup_bias")


def test_fixup_starts_as_the_identity_and_its_classifier_learns_first():
    model = vit("fixup")
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    for block in model.blocks:
        block.register_forward_hook(lambda _m, args, out: seen.append((args[0], out)))
    logits = model(torch.randn(2, 3, 16, 16))
    assert not logits.any() and all(torch.equal(x, y) for x, y in seen)
    torch.nn.functional.cross_entropy(logits, torch.tensor([1, 2])).backward()
    assert model.head.weight.grad.abs().sum() > 0  # the zero classifier passes no gradient to the body yet
    assert not model.blocks[0].attn.proj.weight.grad.any()


def test_sigma_reparam_keeps_each_weight_at_spectral_norm_gamma():
    torch.manual_seed(0)
    weight = nn.Parameter(torch.randn(24, 16))
    reparam = SpectralReparam(weight)
    sigma0 = torch.linalg.matrix_norm(weight.detach(), ord=2)
    torch.testing.assert_close(reparam.gamma.detach(), sigma0.reshape(1))
    with torch.no_grad():
        reparam.gamma.fill_(3.0)
        weight.mul_(torch.linspace(0.5, 2, 16))  # a new matrix: the power iteration has to move
    for _ in range(50):
        effective = reparam(weight)
    assert abs(torch.linalg.matrix_norm(effective.detach(), ord=2).item() - 3.0) < 1e-3
    effective.sum().backward()
    assert weight.grad is not None and reparam.gamma.grad is not None
    u = reparam.u.clone()
    reparam.eval()
    reparam(weight * 2)
    assert torch.equal(reparam.u, u)  # the power iteration advances in training only


def test_sigma_reparam_converts_every_weight_and_leaves_no_norm():
    """apple/ml-sigma-reparam convert_to_sn: every Linear and Conv2d, the classifier included."""
    model = vit("sigma_reparam")
    assert not [m for m in model.modules() if isinstance(m, SLOT_TYPES)]
    converted = {n for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Conv2d))
                 and parametrize_is(m)}
    plain = {n for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Conv2d))} - converted
    assert not plain and {"head", "patch_embed.proj"} <= converted and len(converted) == 2 + 6 * 4
    qkv = model.blocks[0].attn.qkv
    assert abs(qkv.weight.detach().std().item() - 0.02) < 2e-3  # re-initialised as a new SNLinear is
    torch.testing.assert_close(torch.linalg.matrix_norm(qkv.weight.detach(), ord=2),
                               qkv.parametrizations.weight[0].gamma.detach()[0])


def test_a_fine_tunings_fresh_sigma_reparam_head_starts_from_its_own_weight(tmp_path):
    """MAE's fine-tuning re-initialises the head at 2e-5: gamma and u restart from that weight (as a new
    SNLinear would), so that the head starts at what the recipe draws, not at the converted head's scale."""
    cfg = compose_cfg("backbone=vit_micro", "norm=sigma_reparam", "task.head_init_std=2e-5")
    model = build_backbone(cfg.backbone, cfg.norm)
    start_from(model, cfg, RunRecord(tmp_path / "run", {}, writes=False))
    original = model.head.parametrizations.weight.original
    assert original.abs().max() < 1e-4
    torch.testing.assert_close(model.head.weight, original)  # gamma = sigma(W): the weight as drawn


def test_every_familys_classifier_is_found_for_sigma_reparam_and_fixup():
    """Swin's classifier is head.fc, LeViT's two NormLinear heads: sigma-Reparam leaves them plain on request
    (norm.convert_classifier=false) and Fixup zeroes them; PVT registers its spatial reduction after the
    output projection, which Fixup still zeroes."""
    for name, heads in (("swin_micro", ["head.fc"]), ("levit_micro", ["head.linear", "head_dist.linear"])):
        cfg = compose_cfg(f"backbone={name}", "norm=sigma_reparam", "norm.convert_classifier=false")
        model = build_backbone(cfg.backbone, cfg.norm)
        assert not any(parametrize_is(model.get_submodule(h)) for h in heads)
        cfg = compose_cfg(f"backbone={name}", "norm=fixup")
        model = build_backbone(cfg.backbone, cfg.norm)
        assert not any(model.get_submodule(h).weight.any() for h in heads)
    cfg = compose_cfg("backbone=pvt_micro", "norm=fixup")
    attn = build_backbone(cfg.backbone, cfg.norm).block1[0].attn
    assert attn.sr is not None and not attn.proj.weight.any() and attn.sr.weight.any()


def parametrize_is(module: nn.Module) -> bool:
    return torch.nn.utils.parametrize.is_parametrized(module, "weight")


@pytest.mark.parametrize("norm", ["fixup", "sigma_reparam"])
def test_normfree_rules_build_on_the_meta_device(norm):
    cfg = compose_cfg("backbone=vit_micro", f"norm={norm}")
    with torch.device("meta"):
        build_backbone(cfg.backbone, cfg.norm)
