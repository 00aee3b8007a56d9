"""Comparison normalizers against their definitions: (B, N, C) tokens, (B, H, W, C) and (B, C, H, W) maps."""

from __future__ import annotations

import collections
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from normexp.norms import kernels
from normexp.norms.batch import BatchNorm
from normexp.norms.derf import Derf
from normexp.norms.dyt import DyT
from normexp.norms.group import GroupNorm
from normexp.norms.instance import InstanceNorm
from normexp.norms.kernels import native
from normexp.norms.kernels.pointwise import fast_erf, fast_tanh
from normexp.norms.scale import ScaleNorm

C = 8
SHAPES = {"tokens": (3, 10, C), "map": (3, 4, 5, C)}


def randomize_affine(m: nn.Module, seed: int = 0) -> nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("weight") and p.numel() == C:
                p.copy_(1 + 0.5 * torch.randn(C, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.5 * torch.randn(C, generator=gen))
    return m


def affine(y: torch.Tensor, m: nn.Module) -> torch.Tensor:
    return y * m.weight + m.bias


def as_channels_first(module_cls, m: nn.Module, **kw) -> nn.Module:
    cf = module_cls(C, data_format="channels_first", **kw)
    cf.load_state_dict(m.state_dict())
    return cf.train(m.training)


def cl_to_cf(x: torch.Tensor) -> torch.Tensor:
    return x.movedim(-1, 1).contiguous()


# --------------------------------------------------------------------------- BatchNorm
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_batchnorm_train_eval_and_running_stats(shape):
    m = randomize_affine(BatchNorm(C))
    x = torch.randn(shape) * 2 + 1
    flat = x.reshape(-1, C)
    mean, var = flat.mean(0), flat.var(0, unbiased=False)
    torch.testing.assert_close(m(x), affine((x - mean) / torch.sqrt(var + 1e-5), m))
    torch.testing.assert_close(m.bn.running_mean, 0.1 * mean)  # momentum 0.1 from 0
    torch.testing.assert_close(m.bn.running_var, 0.9 + 0.1 * flat.var(0, unbiased=True))
    m.eval()
    x2 = torch.randn(shape)
    expected = affine((x2 - m.bn.running_mean) / torch.sqrt(m.bn.running_var + 1e-5), m)
    torch.testing.assert_close(m(x2), expected)
    # channels-first maps: same statistics over batch and positions
    if len(shape) == 4:
        cf = as_channels_first(BatchNorm, m)
        torch.testing.assert_close(cf(cl_to_cf(x2)), cl_to_cf(m(x2)))
        cf.train()
        torch.testing.assert_close(cf(cl_to_cf(x)), cl_to_cf(affine((x - mean) / torch.sqrt(var + 1e-5), m)))


def test_batchnorm_converts_to_syncbn():
    model = nn.Sequential(BatchNorm(C))
    x = torch.randn(4, 6, C)
    expected = model(x)
    synced = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    assert isinstance(synced[0].bn, nn.SyncBatchNorm)
    synced[0].bn.running_mean.zero_()
    synced[0].bn.running_var.fill_(1)
    torch.testing.assert_close(synced(x), expected)  # no process group: local batch statistics


# --------------------------------------------------------------------------- InstanceNorm
@pytest.mark.parametrize("unbiased", [True, False])
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_instancenorm(shape, unbiased):
    m = randomize_affine(InstanceNorm(C, unbiased=unbiased))
    x = torch.randn(shape) * 3 + 2
    flat = x.reshape(shape[0], -1, C)
    mean = flat.mean(1, keepdim=True)
    var = flat.var(1, keepdim=True, unbiased=unbiased)
    expected = affine(((flat - mean) / torch.sqrt(var + 1e-5)).view(shape), m)
    torch.testing.assert_close(m(x), expected)
    if not unbiased:
        ref = F.instance_norm(cl_to_cf(x), weight=m.weight, bias=m.bias, eps=1e-5)
        torch.testing.assert_close(cl_to_cf(m(x)), ref, rtol=1e-5, atol=1e-5)
    if len(shape) == 4:
        cf = as_channels_first(InstanceNorm, m, unbiased=unbiased)
        torch.testing.assert_close(cf(cl_to_cf(x)), cl_to_cf(expected))


# --------------------------------------------------------------------------- GroupNorm
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_groupnorm_uses_heads_as_groups(shape):
    m = randomize_affine(GroupNorm(C, num_heads=4))
    assert m.num_groups == 4
    x = torch.randn(shape) * 2 - 1
    ref = F.group_norm(cl_to_cf(x.reshape(shape[0], -1, C)), 4, m.weight, m.bias, 1e-5)
    torch.testing.assert_close(m(x), ref.movedim(1, -1).reshape(shape), rtol=1e-5, atol=1e-5)
    # by hand: group g of sample b over (tokens x channels of the group)
    xg = x.reshape(shape[0], -1, 4, 2)
    mean = xg.mean(dim=(1, 3), keepdim=True)
    var = xg.var(dim=(1, 3), keepdim=True, unbiased=False)
    torch.testing.assert_close(m(x), affine(((xg - mean) / torch.sqrt(var + 1e-5)).view(shape), m))
    if len(shape) == 4:
        cf = as_channels_first(GroupNorm, m, num_heads=4)
        torch.testing.assert_close(cf(cl_to_cf(x)), cl_to_cf(m(x)), rtol=1e-5, atol=1e-5)


def test_groupnorm_groups_override_and_errors():
    assert GroupNorm(C, groups=2, num_heads=4).num_groups == 2
    with pytest.raises(ValueError, match="num_heads"):
        GroupNorm(C)
    with pytest.raises(ValueError, match="divide"):
        GroupNorm(C, num_heads=3)


# --------------------------------------------------------------------------- ScaleNorm
@pytest.mark.parametrize("per_channel", [True, False])
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_scalenorm(shape, per_channel):
    m = ScaleNorm(C, per_channel=per_channel)
    assert torch.all(m.weight == math.sqrt(C)) and m.weight.numel() == (C if per_channel else 1)
    with torch.no_grad():
        m.weight.mul_(torch.rand(m.weight.shape) + 0.5)
    x = torch.randn(shape)
    expected = m.weight * x / x.norm(dim=-1, keepdim=True)
    torch.testing.assert_close(m(x), expected)
    torch.testing.assert_close(m(torch.zeros(shape)), torch.zeros(shape))  # eps guards 0/0
    if len(shape) == 4:
        cf = ScaleNorm(C, per_channel=per_channel, data_format="channels_first")
        cf.load_state_dict(m.state_dict())
        torch.testing.assert_close(cf(cl_to_cf(x)), cl_to_cf(expected))


# --------------------------------------------------------------------------- DyT variants, Derf
SQUASH = {"tanh": torch.tanh, "hardtanh": lambda t: t.clamp(-1, 1), "sigmoid": torch.sigmoid,
          "identity": lambda t: t}


@pytest.mark.parametrize("learnable", [True, False])
@pytest.mark.parametrize("squash", SQUASH)
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_dyt_variants(shape, squash, learnable):
    m = randomize_affine(DyT(C, alpha0=0.8, squash=squash, learnable_alpha=learnable))
    assert isinstance(m.alpha, nn.Parameter) == learnable
    assert "alpha" in m.state_dict() and m.alpha.shape == (1,)
    assert sum(p.numel() for p in m.parameters()) == 2 * C + int(learnable)
    x = torch.randn(shape, requires_grad=True) * 3
    y = m(x)
    torch.testing.assert_close(y, affine(SQUASH[squash](0.8 * x), m))
    y.sum().backward()
    assert (m.alpha.grad is not None) == learnable
    if len(shape) == 4:
        cf = DyT(C, alpha0=0.8, squash=squash, learnable_alpha=learnable, data_format="channels_first")
        cf.load_state_dict(m.state_dict())
        torch.testing.assert_close(cf(cl_to_cf(x.detach())), cl_to_cf(y.detach()))


FORMATS = {"tokens": ((3, 10, C), "channels_last"), "map": ((3, 4, 5, C), "channels_last"),
           "map_channels_first": ((3, C, 4, 5), "channels_first")}


def dyt_outputs_and_grads(kernels: str, fmt: str, squash: str, learnable: bool, x: torch.Tensor,
                          g: torch.Tensor) -> list[torch.Tensor]:
    m = randomize_affine(DyT(C, alpha0=0.8, squash=squash, learnable_alpha=learnable, data_format=fmt,
                             kernels=kernels)).to(x.dtype)
    x = x.clone().requires_grad_()
    y = m(x)
    y.backward(g)
    return [y, x.grad, *(p.grad for p in m.parameters())]


@pytest.mark.parametrize("kernels", ["eager", pytest.param("native", marks=pytest.mark.skipif(
    not native.available(), reason="native kernels do not build here"))])
@pytest.mark.parametrize("learnable", [True, False])
@pytest.mark.parametrize("squash", SQUASH)
@pytest.mark.parametrize("layout", FORMATS)
def test_dyt_fused_path_matches_definition_float64(layout, squash, learnable, kernels):
    # the fused Function (its kernels op by op, and as native CPU loops) against autograd through the
    # definition: outputs and gradients of x, alpha, weight, bias
    shape, fmt = FORMATS[layout]
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(shape, generator=gen, dtype=torch.float64) * 3
    g = torch.randn(shape, generator=gen, dtype=torch.float64)
    fused = dyt_outputs_and_grads(kernels, fmt, squash, learnable, x, g)
    plain = dyt_outputs_and_grads("autograd", fmt, squash, learnable, x, g)
    assert len(fused) == len(plain) == 4 + learnable
    for a, b in zip(fused, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("fast, exact, error", [(fast_tanh, torch.tanh, 2e-8), (fast_erf, torch.erf, 4e-8)])
def test_fused_tanh_and_erf_are_exact_to_float32_precision(fast, exact, error):
    z = torch.linspace(-30, 30, 600_001, dtype=torch.float64)
    assert (fast(z) - exact(z)).abs().max() < error
    t32 = fast(z.float())
    assert (t32.double() - exact(z)).abs().max() < 4e-7 and t32.abs().max() <= 1 + 3e-7


def test_dyt_fused_path_saves_only_its_input():
    m = DyT(C, kernels="eager")
    x = torch.randn(3, 10, C, requires_grad=True)
    exclude = {p.data_ptr() for p in m.parameters()}
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        m(x)
    assert [t.data_ptr() for t in saved if t.data_ptr() not in exclude] == [x.data_ptr()]


@pytest.mark.slow
@pytest.mark.parametrize("squash, layout", [("tanh", "map_channels_first"), ("sigmoid", "tokens")])
def test_dyt_compiled_kernels_match_definition(squash, layout):
    shape, fmt = FORMATS[layout]
    x, g = torch.randn(shape) * 3, torch.randn(shape)
    compiled = dyt_outputs_and_grads("compiled", fmt, squash, True, x, g)
    plain = dyt_outputs_and_grads("autograd", fmt, squash, True, x, g)
    for a, b in zip(compiled, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_dyt_defaults_and_bad_squash():
    m = DyT(C)
    assert m.squash == "tanh" and isinstance(m.alpha, nn.Parameter) and m.alpha.item() == 0.5
    with pytest.raises(ValueError, match="squash"):
        DyT(C, squash="relu")
    with pytest.raises(ValueError, match="kernels"):
        DyT(C, kernels="fast")


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_derf(shape):
    m = Derf(C)
    assert m.alpha.item() == 0.5 and m.shift.item() == 0.0
    assert torch.all(m.weight == 1) and torch.all(m.bias == 0)
    randomize_affine(m)
    with torch.no_grad():
        m.alpha.fill_(0.7)
        m.shift.fill_(-0.2)
    x = torch.randn(shape) * 2
    expected = affine(torch.erf(0.7 * x - 0.2), m)
    torch.testing.assert_close(m(x), expected)
    if len(shape) == 4:
        cf = Derf(C, data_format="channels_first")
        cf.load_state_dict(m.state_dict())
        torch.testing.assert_close(cf(cl_to_cf(x)), cl_to_cf(expected))


def test_auto_kernels_compile_only_large_shapes_seen_often(monkeypatch):
    # a compile costs seconds per shape: "auto" fuses only large inputs, and only once a shape is common
    monkeypatch.setattr(kernels, "compiler_available", lambda device_type: True)
    monkeypatch.setattr(kernels, "_calls", collections.Counter())
    monkeypatch.setattr(kernels, "COMPILE_AFTER_CALLS", 3)
    big = torch.empty(kernels.COMPILE_MIN_NUMEL)
    small = torch.empty(kernels.COMPILE_MIN_NUMEL - 1)
    modes = [kernels.resolve_kernels("auto", big, "kind") for _ in range(5)]
    assert modes == ["autograd"] * 3 + ["compiled"] * 2
    # another kind, shape or grad mode counts from zero; small inputs and explicit modes never count
    assert kernels.resolve_kernels("auto", big, "other") == "autograd"
    with torch.no_grad():
        assert kernels.resolve_kernels("auto", big, "kind") == "autograd"
    assert all(kernels.resolve_kernels("auto", small, "kind") == "autograd" for _ in range(5))
    assert kernels.resolve_kernels("eager", small, "kind") == "eager"
