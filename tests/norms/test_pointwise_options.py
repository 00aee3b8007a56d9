"""The function-property options of ``norm=pointwise`` (Derf, arXiv 2512.10938, Sec. 3 and 7): each equals
the paper's formula in float64 (written here from the paper's equations, independently of the code) on both
paths; the fused path gradchecks and equals the plain one, on the options' kinks too; the defaults are the
plain layer and keep run identities; bad values are one line."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import compose_cfg
from omegaconf import OmegaConf
from torch.func import functional_call

from normexp.errors import UserError
from normexp.models import build_backbone
from normexp.norms.kernels import native
from normexp.norms.pointwise import FUNCTIONS, PointWise
from normexp.preflight import validate
from normexp.tracking.provenance import config_hash

C = 4
ALPHA = 0.75
# the plain path, the fused Function's kernels op by op, and its native CPU loops where they build here
NATIVE = pytest.param("native", marks=pytest.mark.skipif(not native.available(),
                                                         reason="native kernels do not build here"))
PATHS = ["autograd", "eager", NATIVE]
OPTIONS = ("vector_shift", "output_shift", "clip", "blend", "flat", "negate", "prescale")


def flat_zone(f, u: torch.Tensor, lam: float) -> torch.Tensor:
    """Sec. 3.3: f = 0 on [-lam, lam], its positive and negative parts shifted outward by lam."""
    return torch.where(u > lam, f(u - lam), torch.where(u < -lam, f(u + lam), torch.zeros_like(u)))


# (fn, options, the paper's g(u) at u = alpha x, alpha = ALPHA): Eq. 4 has no learnable shift
FORMULAS = {
    "horizontal_shift": ("erf", {"shift0": 0.5}, lambda u: torch.erf(u + 0.5)),  # Eq. 5, Table 1
    "vertical_shift": ("erf", {"output_shift": -0.5}, lambda u: torch.erf(u) - 0.5),  # Eq. 5, Table 1
    "clip": ("arcsinh", {"clip": 0.8}, lambda u: torch.asinh(u).clamp(-0.8, 0.8)),  # Eq. 6, Table 2
    "clip_linear": ("linear", {"clip": 2.0}, lambda u: u.clamp(-2.0, 2.0)),  # Eq. 6, Table 2
    "blend": ("tanh", {"blend": 0.1}, lambda u: 0.9 * torch.tanh(u) + 0.1 * u),  # Eq. 7, Table 3
    "blend_isru": ("isru", {"blend": 0.5}, lambda u: 0.5 * u / torch.sqrt(u * u + 1) + 0.5 * u),
    "flat": ("erf", {"flat": 0.5}, lambda u: flat_zone(torch.erf, u, 0.5)),  # Sec. 3.3, Table 5
    "negate": ("arctan", {"negate": True}, lambda u: -torch.atan(u) * 2 / math.pi),  # Table 6
    "prescale": ("tanh", {"prescale": 1.205}, lambda u: torch.tanh(1.205 * u)),  # Eq. 11, Table 16
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("study", FORMULAS)
def test_each_option_is_the_papers_formula(study, path):
    fn, options, formula = FORMULAS[study]
    layer = PointWise(C, fn, alpha0=ALPHA, learnable_shift=False, kernels=path, **options).double()
    with torch.no_grad():
        layer.weight.copy_(torch.arange(1.0, C + 1))
        layer.bias.fill_(0.25)
    x = torch.linspace(-4, 4, 3 * 7 * C, dtype=torch.float64).reshape(3, 7, C)
    expected = formula(ALPHA * x) * torch.arange(1.0, C + 1, dtype=torch.float64) + 0.25
    torch.testing.assert_close(layer(x), expected, rtol=1e-7, atol=1e-7)  # fast_tanh, fast_erf: within 4e-8


def test_the_flat_zone_is_continuous_and_the_shifts_are_not_learned():
    layer = PointWise(C, "erf", alpha0=1.0, learnable_shift=False, flat=1.0, shift0=0.5).double()
    edge = torch.tensor([-1.5 - 1e-9, -1.5 + 1e-9, 0.5 - 1e-9, 0.5 + 1e-9], dtype=torch.float64)
    assert layer(edge[:, None].expand(-1, C)).abs().max() < 1e-8  # |u| = |x + 0.5| = 1 from either side
    assert [n for n, _ in layer.named_parameters()] == ["alpha", "weight", "bias"]
    assert list(PointWise(C, output_shift=0.5).state_dict()) == ["alpha", "shift", "weight", "bias"]


def test_prescale_is_the_l1_fit_of_tanh_to_erf():
    """Eq. 11: argmin_eps of the integral of |tanh(eps x) - erf(x)| is 1.205 (to the paper's 3 decimals)."""
    x = torch.linspace(-10, 10, 100001, dtype=torch.float64)
    eps = torch.linspace(1.195, 1.215, 201, dtype=torch.float64)
    l1 = torch.stack([torch.trapezoid((torch.tanh(e * x) - torch.erf(x)).abs(), x) for e in eps])
    assert round(eps[l1.argmin()].item(), 3) == 1.205


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("layout", ["channels_last", "channels_first"])
def test_the_vector_shift_is_one_per_channel(layout, path):
    """Table 15: ``s`` a per-channel vector, inside the function like the scalar."""
    layer = PointWise(C, "erf", alpha0=ALPHA, vector_shift=True, data_format=layout, kernels=path).double()
    shift = torch.linspace(-0.5, 0.5, C, dtype=torch.float64)
    with torch.no_grad():
        layer.shift.copy_(shift)
    x = torch.randn(2, 3, C, dtype=torch.float64)
    if layout == "channels_first":
        x, shift = x.permute(0, 2, 1)[..., None], shift[:, None, None]
    y = layer(x)
    torch.testing.assert_close(y, torch.erf(ALPHA * x + shift), rtol=1e-7, atol=1e-7)
    y.sum().backward()
    assert layer.shift.shape == layer.shift.grad.shape == (C,)


def test_the_defaults_are_the_plain_layer():
    layer = PointWise(C, "tanh", alpha0=ALPHA, shift0=0.25, kernels="autograd")
    x = torch.randn(3, 5, C)
    assert torch.equal(layer(x), FUNCTIONS["tanh"](ALPHA * x + 0.25))
    assert layer.shift.shape == (1,) and not layer.options.changed()
    assert "output_shift" not in repr(layer) and "flat=0.5" in repr(PointWise(C, flat=0.5))


# every option at a non-default value (with the scalar or the vector shift), some together
FUSED = {
    "output_shift": ("erf", {"output_shift": 0.5}),
    "clip": ("logsign", {"clip": 1.0}),
    "blend": ("arctan", {"blend": 0.1}),
    "flat": ("arctan", {"flat": 0.3}),
    "negate": ("satursin", {"negate": True}),
    "prescale": ("tanh", {"prescale": 1.205}),
    "vector_shift": ("erf", {"vector_shift": True}),
    "together": ("arcsinh", {"vector_shift": True, "output_shift": -0.1, "clip": 1.5, "blend": 0.2,
                             "flat": 0.25, "negate": True, "prescale": 0.8}),
}


def randomized(layer: PointWise, seed: int = 0) -> PointWise:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        layer.alpha.fill_(ALPHA)
        for p in (layer.shift, layer.weight, layer.bias):
            p.copy_(0.5 * torch.randn(p.shape, generator=gen, dtype=p.dtype) + (p is layer.weight))
    return layer


def outputs_and_grads(m: PointWise, x: torch.Tensor, g: torch.Tensor) -> list[torch.Tensor]:
    x = x.clone().requires_grad_()
    y = m(x)
    y.backward(g)
    return [y, x.grad, *(p.grad for p in m.parameters())]


@pytest.mark.parametrize("kernels", ["eager", NATIVE])
@pytest.mark.parametrize("layout", ["channels_last", "channels_first"])
@pytest.mark.parametrize("case", FUSED)
def test_fused_path_gradchecks_and_equals_the_plain_path_float64(case, layout, kernels):
    fn, options = FUSED[case]
    shape = (2, 3, C) if layout == "channels_last" else (2, C, 3, 2)
    fused = randomized(PointWise(C, fn, data_format=layout, kernels=kernels, **options).double())
    names = [n for n, _ in fused.named_parameters()]

    def call(x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        return functional_call(fused, dict(zip(names, params, strict=True)), (x,))

    x = 2 * torch.randn(shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    params = [p.detach().clone().requires_grad_() for p in fused.parameters()]
    assert torch.autograd.gradcheck(call, (x.requires_grad_(), *params))
    g = torch.randn(shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    plain = randomized(PointWise(C, fn, data_format=layout, kernels="autograd", **options).double())
    for a, b in zip(outputs_and_grads(fused, x.detach(), g), outputs_and_grads(plain, x.detach(), g),
                    strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kernels", ["eager", NATIVE])
def test_fused_path_takes_autograds_slope_on_the_options_kinks(kernels):
    """u exactly on the flat zone's edges (|u| = 0.25), the clip's (u - 0.25 = +-0.5) and at 0."""
    x = torch.tensor([0.0, 0.25, -0.25, 0.75, -0.75, 1.0, 0.1], dtype=torch.float64)[:, None].expand(-1, C)
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    options = {"alpha0": 1.0, "flat": 0.25, "clip": 0.5, "blend": 0.25, "learnable_shift": False}
    fused, plain = (PointWise(C, "linear", kernels=k, **options).double() for k in (kernels, "autograd"))
    for a, b in zip(outputs_and_grads(fused, x, g), outputs_and_grads(plain, x, g), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


@pytest.mark.slow
def test_compiled_kernels_take_the_options():
    fn, options = FUSED["together"]
    x, g = 2 * torch.randn(2, 3, C), torch.randn(2, 3, C)
    compiled, plain = (outputs_and_grads(randomized(PointWise(C, fn, kernels=k, **options)), x, g)
                       for k in ("compiled", "autograd"))
    for a, b in zip(compiled, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_the_options_are_config_keys_that_keep_run_ids_at_their_defaults():
    config = OmegaConf.to_container(compose_cfg("norm=pointwise"), resolve=True)
    assert {k: config["norm"][k] for k in OPTIONS} == {
        "vector_shift": False, "output_shift": 0.0, "clip": None, "blend": 0.0, "flat": 0.0, "negate": False,
        "prescale": 1.0}
    before = {**config, "norm": {k: v for k, v in config["norm"].items() if k not in OPTIONS}}
    assert config_hash(config) == config_hash(before)
    for key, value in (("clip", 1.0), ("negate", True), ("vector_shift", True), ("flat", 0.5)):
        assert config_hash({**config, "norm": {**config["norm"], key: value}}) != config_hash(config)


@pytest.mark.parametrize(("overrides", "says"), [
    (["norm.blend=1.0"], "norm.blend=1.0: must be < 1"),
    (["norm.clip=0.0"], "norm.clip=0.0: must be > 0"),
    (["norm.flat=-0.5"], "norm.flat=-0.5: must be >= 0"),
    (["norm.prescale=0.0"], "norm.prescale=0.0: must be > 0")])
def test_a_bad_option_is_one_line(overrides, says):
    with pytest.raises(UserError, match=f"^{says}"):
        validate(compose_cfg("norm=pointwise", *overrides), environment=False)


def test_options_the_layer_cannot_take_are_one_line():
    cfg = compose_cfg("norm=pointwise", "norm.fn=dyisru", "norm.negate=true")
    with pytest.raises(UserError, match=r"fn=dyisru takes none of the function options \(\['negate'\]\)"):
        build_backbone(cfg.backbone, cfg.norm)
    with pytest.raises(ValueError, match="alpha_init=calibrate reads f's slope at 0"):
        PointWise(C, prescale=1.205, alpha_init="calibrate")
