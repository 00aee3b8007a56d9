"""The io sampler returns exactly what a hooked norm slot sees and returns; the tanh fit recovers known
curves; the slots it hooks are the placement's."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import compose_cfg
from omegaconf import OmegaConf
from torch import nn

from normexp.analysis.io import SATURATION, IOSampler, fit_tanh, io_numbers
from normexp.analysis.slots import hooked_slots
from normexp.models import build_backbone
from normexp.models.registry import create_model
from normexp.norms import norm_layer_factory
from normexp.norms.placement import norm_slot_names, norm_slots


class Tiny(nn.Module):
    """Linear -> norm slot -> Linear, with hand-set weights (the slot's affine far from identity)."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.inp = nn.Linear(3, 6)
        self.norm = norm
        self.out = nn.Linear(6, 2)
        with torch.no_grad():
            self.inp.weight.copy_(torch.arange(18, dtype=torch.float32).view(6, 3) / 7 - 1.2)
            self.inp.bias.copy_(torch.linspace(-1, 1, 6))
            self.norm.weight.copy_(torch.tensor([2.0, -1.0, 0.5, 3.0, 1.5, -0.25]))
            self.norm.bias.copy_(torch.tensor([0.1, -0.2, 0.3, 0.0, 1.0, -1.0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(self.inp(x)))


def tokens() -> torch.Tensor:
    return torch.linspace(-2, 3, 2 * 5 * 3).view(2, 5, 3) ** 3 / 5  # (B=2, N=5 tokens, 3 features)


def sample_of(model: nn.Module, x: torch.Tensor, points: int, seed: int = 0):
    sampler = IOSampler(model, ["norm"], points=points, seed=seed, total_images=x.shape[0])
    with torch.no_grad(), hooked_slots(model, ["norm"], sampler):
        model(x)
    return sampler.samples["norm"]


def test_sampler_returns_every_element_exactly_as_a_direct_call():
    model = Tiny(nn.LayerNorm(6)).eval()
    x = tokens()
    sample = sample_of(model, x, points=10_000)  # more points than elements: all of them
    with torch.no_grad():
        direct_in = model.inp(x)
        direct_out = model.norm(direct_in)
        direct_pre = F.layer_norm(direct_in, (6,), eps=model.norm.eps)  # LN without its affine
    pts = sample.points
    assert len(pts["x"]) == direct_in.numel()
    image, token, channel = pts["image"], pts["token"], pts["channel"]
    np.testing.assert_array_equal(pts["x"], direct_in[image, token, channel].numpy())
    np.testing.assert_array_equal(pts["y"], direct_out[image, token, channel].numpy())
    np.testing.assert_allclose(pts["y_pre"], direct_pre[image, token, channel].numpy(), atol=1e-6)
    assert not np.allclose(pts["y"], pts["y_pre"])  # the affine was really taken off, and put back:
    assert torch.equal(model.norm.weight, torch.tensor([2.0, -1.0, 0.5, 3.0, 1.5, -0.25]))


def test_a_seeded_subset_pairs_each_input_with_its_own_output():
    model = Tiny(nn.LayerNorm(6)).eval()
    x = tokens()
    a, b = sample_of(model, x, points=17), sample_of(model, x, points=17)
    other = sample_of(model, x, points=17, seed=1)
    with torch.no_grad():
        direct_in = model.inp(x)
        direct_out = model.norm(direct_in)
    assert len(a.points["x"]) == 17
    where = (a.points["image"], a.points["token"], a.points["channel"])
    np.testing.assert_array_equal(a.points["x"], direct_in[where].numpy())
    np.testing.assert_array_equal(a.points["y"], direct_out[where].numpy())
    np.testing.assert_array_equal(a.points["x"], b.points["x"])  # same seed, same points
    assert not np.array_equal(a.points["x"], other.points["x"])
    # the highlighted tokens: every channel of each, from the first image
    assert set(a.tokens["image"]) == {0} and len(a.tokens["x"]) % 6 == 0


def test_dyt_slot_output_before_affine_is_its_own_tanh_and_the_fit_finds_alpha():
    dyt = norm_layer_factory("dyt", alpha0=0.7, kernels="autograd")(6)
    model = Tiny(dyt).eval()
    sample = sample_of(model, tokens() * 3, points=10_000)
    np.testing.assert_allclose(sample.points["y_pre"], np.tanh(0.7 * sample.points["x"]), atol=1e-6)
    numbers = io_numbers(sample, model.norm)
    assert numbers["layer_alpha"] == pytest.approx(0.7)
    assert numbers["a"] == pytest.approx(1, abs=1e-4) and numbers["b"] == pytest.approx(0.7, rel=1e-4)
    assert numbers["c"] == pytest.approx(0, abs=1e-4) and numbers["r2"] == pytest.approx(1, abs=1e-9)


def test_fit_recovers_a_known_curve_and_counts_the_saturated_points():
    x = np.linspace(-6, 6, 600)  # no point at |x| = 2.5, where |0.8 x| = SATURATION
    y = 1.7 * np.tanh(0.8 * x) - 0.3
    fit = fit_tanh(x, y)
    assert (fit.a, fit.b, fit.c) == pytest.approx((1.7, 0.8, -0.3), rel=1e-5, abs=1e-6)
    assert fit.r2 == pytest.approx(1.0, abs=1e-10) and fit.linear_r2 < 0.95
    assert fit.saturated == np.mean(np.abs(0.8 * x) > SATURATION)
    assert fit.saturated == pytest.approx(2 * 3.5 / 12, abs=2 / 600)  # |x| > 2.5: 2 x 3.5 of 12
    noisy = fit_tanh(x, y + np.random.default_rng(0).normal(0, 0.01, x.shape))
    assert (noisy.a, noisy.b, noisy.c) == pytest.approx((1.7, 0.8, -0.3), rel=0.02, abs=0.01)


def test_fit_of_a_straight_line_is_as_good_as_the_line_and_saturates_nothing():
    x = np.linspace(-3, 3, 200)
    fit = fit_tanh(x, 2 * x + 1)
    assert fit.r2 == pytest.approx(1.0, abs=1e-5) and fit.linear_r2 == pytest.approx(1.0)
    assert fit.saturated == 0.0 and fit.a * fit.b == pytest.approx(2.0, rel=1e-3)


def test_fit_of_a_real_layernorm_layer_is_reported():
    """A ViT's LN slot at initialisation: the fit is reported (not asserted to be high); a tanh fit is never
    worse than the straight line it contains as b -> 0."""
    model = build_backbone({"name": "vit_micro", "img_size": 16, "num_classes": 10}, {"name": "ln"}).eval()
    sampler = IOSampler(model, ["blocks.2.norm1"], points=1500, total_images=4)
    with torch.no_grad(), hooked_slots(model, ["blocks.2.norm1"], sampler):
        model(torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(0)))
    numbers = io_numbers(sampler.samples["blocks.2.norm1"], model.get_submodule("blocks.2.norm1"))
    print(f"vit_micro blocks.2.norm1 at init: R^2 tanh {numbers['r2']:.4f}, line {numbers['linear_r2']:.4f}, "
          f"saturated {numbers['saturated_fraction']:.3f}")
    assert math.isfinite(numbers["r2"]) and numbers["r2"] <= 1.0
    assert numbers["r2"] >= numbers["linear_r2"] - 1e-6
    assert numbers["n"] == 1500 and "layer_alpha" not in numbers


@pytest.mark.parametrize("backbone", ["vit_micro", "vit_micro_star", "swin_micro", "pvt_micro",
                                      "pvt_v2_micro", "levit_micro", "t2t_vit_micro", "convnext_micro"])
@pytest.mark.parametrize("norm", ["dyt", "dtn"])
def test_hooked_slots_are_the_slots_the_placement_swaps(backbone, norm):
    cfg = OmegaConf.to_container(compose_cfg(f"backbone={backbone}").backbone, resolve=True)
    kwargs = {k: v for k, v in cfg.items() if k not in ("name", "norm_defaults", "trainer_defaults", "dense")}
    as_built = norm_slots(create_model(backbone, **kwargs))
    model = build_backbone(cfg, {"name": norm})
    assert norm_slot_names(model) == as_built
