"""Normalization-free baselines (DyT Table 9): ``norm=none`` leaves no normalization in the model;
``norm=skipinit`` starts as the identity on the residual stream (SkipInit, arXiv 2002.10444), its gates the
only branch parameters that learn in the first step, on every family and in a task's model around one;
``norm=fixup`` scales a ViT's branches by Fixup's formula for its depth (arXiv 1901.09321);
``norm=sigma_reparam`` keeps every weight's spectral norm at its learnable scalar (arXiv 2303.06296)."""

from __future__ import annotations

import pytest
import torch
from conftest import compose_cfg
from torch import nn

from normexp.errors import UserError
from normexp.models import build_backbone, build_model, check_buildable
from normexp.norms.fixup import value_rows
from normexp.norms.normfree import NoNorm, residual_branches
from normexp.norms.placement import SLOT_TYPES
from normexp.norms.sigma_reparam import SpectralReparam
from normexp.tasks.mae import build_mae


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


def test_fixup_scales_the_value_paths_by_its_formula_for_the_depth_and_zeroes_the_last_layers():
    plain, fixup = vit("none"), vit("fixup")  # same seed, same draws: Fixup only rescales after
    scale = (2 * 6) ** (-1 / (2 * 2 - 2))  # L = 12 branches of m = 2 weight layers: L^(-1/2)
    for i in range(6):
        before, after = plain.blocks[i], fixup.blocks[i]
        v = value_rows("qkv", after.attn.qkv)
        assert v == slice(192, 288)
        torch.testing.assert_close(after.attn.qkv.weight[v], before.attn.qkv.weight[v] * scale)
        assert torch.equal(after.attn.qkv.weight[:192], before.attn.qkv.weight[:192])  # q, k as built
        torch.testing.assert_close(after.mlp.fc1.weight, before.mlp.fc1.weight * scale)
        for last in (after.attn.proj, after.mlp.fc2):
            assert not last.weight.any() and not last.bias.any()
    assert not fixup.head.weight.any()
    assert torch.equal(fixup.patch_embed.proj.weight, plain.patch_embed.proj.weight)
    scalars = {n for n, _ in fixup.named_parameters()} - {n for n, _ in plain.named_parameters()}
    assert {"blocks.0.attn.fixup_scale", "blocks.0.attn.fixup_bias", "blocks.0.attn.qkv.fixup_bias",
            "blocks.0.mlp.act.fixup_bias", "blocks.5.mlp.fc2.fixup_bias"} <= scalars
    assert len(scalars) == 6 * (2 + 2 + 2 + 3)  # per block: 2 x (scale, bias), qkv, proj, fc1, act, fc2


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
    assert not fixup.fc.weight.any()


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


def test_sigma_reparam_converts_every_weight_but_the_classifier_and_leaves_no_norm():
    model = vit("sigma_reparam")
    assert not [m for m in model.modules() if isinstance(m, SLOT_TYPES)]
    converted = {n for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Conv2d))
                 and parametrize_is(m)}
    plain = {n for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Conv2d))} - converted
    assert plain == {"head"} and "patch_embed.proj" in converted and len(converted) == 1 + 6 * 4
    qkv = model.blocks[0].attn.qkv
    assert abs(qkv.weight.detach().std().item() - 0.02) < 2e-3  # re-initialised as a new SNLinear is
    torch.testing.assert_close(torch.linalg.matrix_norm(qkv.weight.detach(), ord=2),
                               qkv.parametrizations.weight[0].gamma.detach()[0])


def test_the_classifier_stays_plain_in_every_family_and_fixup_zeroes_it_and_each_branch_output():
    """Swin's classifier is head.fc, LeViT's two NormLinear heads; PVT registers its spatial reduction after
    the output projection, which Fixup still zeroes."""
    for name, heads in (("swin_micro", ["head.fc"]), ("levit_micro", ["head.linear", "head_dist.linear"])):
        cfg = compose_cfg(f"backbone={name}", "norm=sigma_reparam")
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
    check_buildable(cfg.backbone, cfg.norm)
