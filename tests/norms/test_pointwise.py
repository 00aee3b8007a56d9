"""The point-wise family (Derf arXiv 2512.10938 Table 7; DyISRU arXiv 2503.21708): every function equals its
definition at fixed points (values computed in float64 from zlab-princeton/Derf's formulas, independently of
this code), the shift sits inside the function, gradients agree with finite differences (float64), DyISRU is
RMSNorm's element-wise counterpart, and ``norm=derf`` is ``fn=erf``."""

from __future__ import annotations

import math

import pytest
import torch
from torch.func import functional_call

from normexp.norms.derf import Derf
from normexp.norms.pointwise import FN_CHOICES, FUNCTIONS, PointWise

U = [-3.0, -1.0, -0.5, 0.0, 0.3, 1.0, 2.0]
EXPECTED = {  # f(u) at U, six decimals
    "erf": [-0.999978, -0.842701, -0.520500, 0, 0.328627, 0.842701, 0.995322],
    "tanh": [-0.995055, -0.761594, -0.462117, 0, 0.291313, 0.761594, 0.964028],
    "satursin": [-1.0, -0.841471, -0.479426, 0, 0.295520, 0.841471, 1.0],
    "isru": [-0.948683, -0.707107, -0.447214, 0, 0.287348, 0.707107, 0.894427],
    "expsign": [-0.950213, -0.632121, -0.393469, 0, 0.259182, 0.632121, 0.864665],
    "smoothsign": [-0.75, -0.5, -0.333333, 0, 0.230769, 0.5, 0.666667],
    "relsign": [-0.720759, -0.414214, -0.236068, 0, 0.146769, 0.414214, 0.618034],
    "cubsign": [-0.964286, -0.5, -0.111111, 0, 0.026290, 0.5, 0.888889],
    "exproot": [-0.823079, -0.632121, -0.506931, 0, 0.421735, 0.632121, 0.756883],
    "saturlog": [-0.580940, -0.409384, -0.288492, 0, 0.207836, 0.409384, 0.523495],
    "arctan": [-0.795167, -0.5, -0.295167, 0, 0.185547, 0.5, 0.704833],
    "linear_clip": [-1.0, -1.0, -0.5, 0, 0.3, 1.0, 1.0],
    "power23_clip": [-1.0, -1.0, -0.629961, 0, 0.448140, 1.0, 1.0],
    "logsign_clip": [-1.0, -0.693147, -0.405465, 0, 0.262364, 0.693147, 1.0],
    "smoothsign_clip": [-0.75, -0.5, -0.333333, 0, 0.230769, 0.5, 0.666667],
    "logquad_clip": [-1.0, -0.693147, -0.223144, 0, 0.086178, 0.693147, 1.0],
    "arcsinh_clip": [-1.0, -0.881374, -0.481212, 0, 0.295673, 0.881374, 1.0],  # Table 7, ln(u + sqrt(u^2+1))
    # Derf Sec. 3: Fig. 3's unbounded functions and Fig. 4's non-monotone ones
    "arcsinh": [-1.818446, -0.881374, -0.481212, 0, 0.295673, 0.881374, 1.443635],
    "logsign": [-1.386294, -0.693147, -0.405465, 0, 0.262364, 0.693147, 1.098612],
    "logquad": [-2.302585, -0.693147, -0.223144, 0, 0.086178, 0.693147, 1.609438],
    "power23": [-2.080084, -1.0, -0.629961, 0, 0.448140, 1.0, 1.587401],
    "linear": [-3.0, -1.0, -0.5, 0, 0.3, 1.0, 2.0],
    "sin": [-0.141120, -0.841471, -0.479426, 0, 0.295520, 0.841471, 0.909297],
    "dampx": [-0.6, -1.0, -0.8, 0, 0.550459, 1.0, 0.8],
    "dampexp": [-0.406262, -1.000632, -0.824882, 0, 0.604508, 1.000632, 0.736224],
}
C = 4


def test_every_function_of_derfs_search_is_here():
    assert set(EXPECTED) == set(FUNCTIONS) and set(FN_CHOICES) == {*FUNCTIONS, "dyisru"}


@pytest.mark.parametrize("fn", sorted(EXPECTED))
def test_each_function_equals_its_definition(fn):
    layer = PointWise(C, fn, alpha0=1.0).double()
    x = torch.tensor(U, dtype=torch.float64)[:, None].expand(-1, C)
    expected = torch.tensor(EXPECTED[fn], dtype=torch.float64)[:, None].expand(-1, C)
    torch.testing.assert_close(layer(x), expected, atol=6e-7, rtol=0)


@pytest.mark.parametrize("fn", sorted(EXPECTED))
def test_the_shift_is_inside_the_function_and_the_affine_outside(fn):
    layer = PointWise(C, fn, alpha0=0.75, shift0=-0.25).double()  # exact in float32
    with torch.no_grad():
        layer.weight.copy_(torch.arange(1.0, C + 1))
        layer.bias.fill_(0.25)
    x = torch.randn(3, 5, C, dtype=torch.float64) * 2
    expected = FUNCTIONS[fn](0.75 * x - 0.25) * torch.arange(1.0, C + 1, dtype=torch.float64) + 0.25
    torch.testing.assert_close(layer(x), expected)
    maps = PointWise(C, fn, alpha0=0.75, shift0=-0.25, data_format="channels_first").double()
    maps.load_state_dict(layer.state_dict())
    torch.testing.assert_close(maps(x.permute(0, 2, 1)[..., None]), expected.permute(0, 2, 1)[..., None])


@pytest.mark.parametrize("fn", FN_CHOICES)
def test_gradients_agree_with_finite_differences(fn):
    """Away from the kinks of the clipped functions and from exproot's / power23's vertical slope at 0."""
    layer = PointWise(C, fn, alpha0=1.0, shift0=0.1).double()
    x = torch.tensor([[-2.7, -1.23, -0.45, 0.2], [0.8, 1.9, 2.6, -0.7]], dtype=torch.float64,
                     requires_grad=True)
    names = [n for n, _ in layer.named_parameters()]

    def call(x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        return functional_call(layer, dict(zip(names, params, strict=True)), (x,))

    params = [p.detach().clone().requires_grad_(True) for p in layer.parameters()]
    assert torch.autograd.gradcheck(call, (x, *params))


def test_dyisru_is_rmsnorms_elementwise_counterpart():
    """With b = the sum of the other channels' squares, channel i is exactly RMSNorm's output (no eps);
    its outputs are bounded by sqrt(C), its slope at 0 is 1 at the default b = C."""
    x = torch.randn(64, dtype=torch.float64)
    layer = PointWise(64, "dyisru").double()
    assert layer.beta.item() == 64 and not hasattr(layer, "alpha")
    with torch.no_grad():
        layer.beta.fill_(float(x[1:].square().sum()))
    rms = x * math.sqrt(64) / x.square().sum().sqrt()
    torch.testing.assert_close(layer(x)[0], rms[0])
    wide = PointWise(64, "dyisru").double()
    assert wide(torch.tensor([1e6] * 64, dtype=torch.float64)).max() <= math.sqrt(64)
    small = torch.full((64,), 1e-4, dtype=torch.float64)
    torch.testing.assert_close(wide(small), small, rtol=1e-6, atol=0)


def test_derf_is_the_erf_member_and_the_shift_can_be_fixed():
    derf, erf = Derf(C), PointWise(C, "erf")
    assert list(derf.state_dict()) == list(erf.state_dict()) == ["alpha", "shift", "weight", "bias"]
    x = torch.randn(2, 3, C)
    torch.testing.assert_close(derf(x), erf(x))
    fixed = PointWise(C, "tanh", learnable_shift=False)
    assert [n for n, _ in fixed.named_parameters()] == ["alpha", "weight", "bias"]
    torch.testing.assert_close(fixed(x), torch.tanh(0.5 * x))
    with pytest.raises(ValueError, match="point-wise fn must be one of"):
        PointWise(C, "relu")
