"""Normalization-free baselines (DyT Table 9): ``norm=none`` leaves no normalization in the model;
``norm=skipinit`` starts as the identity on the residual stream (SkipInit, arXiv 2002.10444), its gates the
only branch parameters that learn in the first step, on every family and in a task's model around one."""

from __future__ import annotations

import pytest
import torch
from conftest import compose_cfg
from torch import nn

from normexp.errors import UserError
from normexp.models import build_backbone, build_model
from normexp.norms.normfree import NoNorm, residual_branches
from normexp.norms.placement import SLOT_TYPES
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
    with pytest.raises(UserError, match="norm=skipinit gates residual branches, and Sequential names none"):
        build_model(lambda: nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)), {"name": "skipinit"}, "a toy")
