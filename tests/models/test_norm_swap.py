"""The normalizer goes into every norm slot of the backbone through one mechanism."""

from __future__ import annotations

import pytest
import torch
from conftest import compose_cfg
from torch import nn

from normexp.models import build_backbone, create_model
from normexp.norms import norm_layer_factory, replace_norms
from normexp.norms.dyt import DyT
from normexp.norms.placement import norm_slots


def test_dyt_matches_its_formula():
    torch.manual_seed(0)
    layer = DyT(8)
    assert layer.alpha.shape == (1,) and layer.alpha.item() == 0.5
    with torch.no_grad():
        layer.alpha.fill_(1.7)
        layer.weight.normal_()
        layer.bias.normal_()
    x = torch.randn(2, 5, 8) * 3
    expected = layer.weight * torch.tanh(1.7 * x) + layer.bias
    torch.testing.assert_close(layer(x), expected)
    # channels-first maps scale along dim 1
    cf = DyT(8, data_format="channels_first")
    cf.load_state_dict(layer.state_dict())
    xm = torch.randn(2, 8, 3, 3)
    torch.testing.assert_close(cf(xm), layer(xm.movedim(1, -1)).movedim(-1, 1))


def test_dyt_alpha_is_one_scalar_per_layer_and_gets_no_weight_decay():
    from timm.optim import create_optimizer_v2

    cfg = compose_cfg("norm=dyt", "backbone=vit_small", "data.img_size=32")
    model = build_backbone(cfg.backbone, cfg.norm)
    alphas = [p for n, p in model.named_parameters() if n.endswith(".alpha")]
    assert len(alphas) == 25 and all(a.numel() == 1 and a.item() == 0.5 for a in alphas)
    opt = create_optimizer_v2(model, opt="adamw", lr=1e-3, weight_decay=0.05, filter_bias_and_bn=True)
    decayed = {id(p) for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    assert not any(id(a) in decayed for a in alphas)
    assert id(model.pos_embed) not in decayed and id(model.cls_token) not in decayed


@pytest.mark.parametrize("norm", ["dyt", "rms", "ln"])
def test_every_layernorm_is_replaced_final_norm_included(norm):
    cfg = compose_cfg(f"norm={norm}")
    model = build_backbone(cfg.backbone, cfg.norm)
    slots = norm_slots(create_model("vit_micro"))  # the LayerNorms timm builds
    assert "norm" in slots and "blocks.0.norm1" in slots  # the final norm is a slot too
    expected = {"dyt": "DyT", "rms": "RMSNorm", "ln": "LayerNorm"}[norm]
    assert {type(model.get_submodule(s)).__name__ for s in slots} == {expected}
    if norm != "ln":
        assert not any(isinstance(m, nn.LayerNorm) for m in model.modules())
    model(torch.randn(2, 3, 16, 16)).sum().backward()


def test_keep_patterns_leave_slots_as_built():
    model = create_model("vit_micro", num_classes=10)
    replaced = replace_norms(model, norm_layer_factory("dyt"), keep=["norm", "blocks.5.*"])
    assert "norm" not in replaced and "blocks.5.norm1" not in replaced and "blocks.4.norm2" in replaced
    assert isinstance(model.norm, nn.LayerNorm) and isinstance(model.blocks[0].norm1, DyT)


def test_unknown_norm_option_is_a_clear_error():
    from normexp.errors import UserError

    cfg = compose_cfg("norm=dyt", "+norm.alpha_zero=1.0")
    with pytest.raises(UserError, match="has no option \\['alpha_zero'\\]"):
        build_backbone(cfg.backbone, cfg.norm)

