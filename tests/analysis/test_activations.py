"""The per-layer activation statistics of ``normexp analyze`` (:mod:`normexp.engine.activation_probe`) against
direct computations: kurtosis and max |x| of each norm slot's input (arXiv 2511.23225), and the saturated
fraction of point-wise layers, for DyT exactly arXiv 2604.23434's share of ``|alpha x| > 2``."""

from __future__ import annotations

import pytest
import scipy.stats
import torch
from conftest import compose_cfg
from torch import nn

from normexp.analysis.slots import hooked_slots
from normexp.engine.activation_probe import SATURATED_SLOPE, ActivationRecorder
from normexp.models import build_backbone
from normexp.norms.placement import norm_slot_names
from normexp.norms.pointwise import PointWise


def test_every_slot_of_a_dyt_vit_against_its_inputs():
    cfg = compose_cfg("norm=dyt", "data.img_size=8")
    torch.manual_seed(0)
    model = build_backbone(cfg.backbone, cfg.norm).eval()
    slots = norm_slot_names(model)
    for i, slot in enumerate(slots):  # alphas that saturate some inputs and not others
        model.get_submodule(slot).alpha.data.fill_(0.5 + i)
    inputs: dict[str, list[torch.Tensor]] = {}
    recorder = ActivationRecorder()

    def both(name: str, module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
        inputs.setdefault(name, []).append(x.detach().double().flatten())
        recorder(name, module, x, y)

    with torch.no_grad(), hooked_slots(model, slots, both):
        for _ in range(2):  # two batches: the sums run over both
            model(torch.randn(3, 3, 8, 8))
    rows = recorder.rows()
    assert [row["slot"] for row in rows] == slots
    for row in rows:
        x = torch.cat(inputs[row["slot"]])
        alpha = float(model.get_submodule(row["slot"]).alpha.detach())
        assert row["elements"] == x.numel() and row["layer"] == "DyT"
        assert row["kurtosis"] == pytest.approx(scipy.stats.kurtosis(x.numpy(), fisher=False), rel=1e-6)
        assert row["max_abs"] == pytest.approx(float(x.abs().max()))
        assert row["std"] == pytest.approx(float(x.std(unbiased=False)), rel=1e-6)
        assert row["saturated_fraction"] == pytest.approx(float((alpha * x).abs().gt(2).double().mean()))
    assert any(0.05 < row["saturated_fraction"] < 0.95 for row in rows)  # the comparison means something


def test_a_shifted_erf_saturates_where_its_slope_falls_below_tanhs_at_2_of_its_slope_at_its_centre():
    layer = PointWise(4, fn="erf", alpha0=1.5, shift0=0.3, kernels="autograd")
    layer.weight.data = torch.tensor([2.0, -1.0, 0.5, 3.0])  # the per-channel affine cancels in the ratio
    x = torch.linspace(-3, 3, 400).reshape(100, 4)
    recorder = ActivationRecorder()
    recorder("norm", layer, x, layer(x))
    u = 1.5 * x.double() + 0.3  # erf'(u) is proportional to exp(-u^2), its centre u = 0
    expected = (torch.exp(-u ** 2) < SATURATED_SLOPE).double().mean()
    assert recorder.rows()[0]["saturated_fraction"] == pytest.approx(float(expected))
    assert 0.1 < float(expected) < 0.9


@pytest.mark.parametrize("vector_shift", [False, True])
def test_a_flat_zone_counts_as_flat_and_the_slope_past_its_edge_is_the_reference(vector_shift):
    # Derf Table 5's flat zone: g(u) = 0 on [-1, 1], erf(u -+ 1) outside (with a prescale of 2: v = 2u)
    layer = PointWise(4, fn="erf", alpha0=1.0, shift0=0.2, vector_shift=vector_shift, flat=1.0, prescale=2.0,
                      kernels="autograd")
    x = torch.linspace(-3, 3, 4000).reshape(1000, 4)
    recorder = ActivationRecorder()
    recorder("norm", layer, x, layer(x))
    v = 2 * (x.double() + 0.2)
    inside = v.abs() <= 1
    saturated = torch.exp(-(v.abs() - 1) ** 2) < SATURATED_SLOPE
    expected = float((inside | saturated).double().mean())
    assert recorder.rows()[0]["saturated_fraction"] == pytest.approx(expected, abs=1e-3)
    assert min(float(inside.double().mean()), float(saturated.double().mean())) > 0.1


def test_a_layernorm_has_moments_and_no_saturated_fraction():
    recorder = ActivationRecorder()
    x = torch.randn(5, 7)
    recorder("norm", nn.LayerNorm(7), x, x)
    row = recorder.rows()[0]
    assert row["saturated_fraction"] is None and row["layer"] == "LayerNorm"
    assert row["mean"] == pytest.approx(float(x.double().mean()))
