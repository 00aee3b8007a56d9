"""The fused paths of the point-wise family (every ``norm=pointwise`` fn, DyISRU, ``norm=derf``) and of
RMSNorm against their plain paths (``kernels=autograd``, the definitions): float64 gradcheck through the fused
Function -- its kernels op by op (``eager``) and as native CPU loops (``native``) -- away from the kinks and
equality at them, float32 native loops at shapes that leave vector remainders, bfloat16 autocast against
float32 at the rounded input, both layouts; the fused path is the default, and a checkpoint of either path
loads in the other."""

from __future__ import annotations

import collections
import math

import pytest
import torch
from torch import nn
from torch.func import functional_call

from normexp.norms import kernels
from normexp.norms.derf import Derf
from normexp.norms.kernels import native
from normexp.norms.kernels import pointwise as pointwise_kernels
from normexp.norms.kernels import rms as rms_kernels
from normexp.norms.pointwise import FN_CHOICES, PointWise
from normexp.norms.rms import RMSNorm

C = 4
LAYOUTS = {"tokens": ((2, 3, C), "channels_last"), "map_channels_first": ((2, C, 3, 2), "channels_first")}
NORMS = [*FN_CHOICES, "rms"]
# the fused Function's kernels under test: op by op, and the native loops where they build here
FUSED = ["eager", pytest.param("native", marks=pytest.mark.skipif(
    not native.available(), reason="native kernels do not build here"))]
# where a slope jumps or is infinite: the clips' boundaries (linear, satursin, power23: |u| = 1 or pi/2;
# logsign: log(1 + |u|) = 1; logquad: log(1 + u^2) = 1; arcsinh: asinh(u) = 1) and u = 0 (sign)
KINKS = torch.tensor([0.0, 1.0, math.pi / 2, math.e - 1, math.sqrt(math.e - 1), math.sinh(1)],
                     dtype=torch.float64)


def build(norm: str, kernels: str, fmt: str = "channels_last", **kw) -> nn.Module:
    if norm == "rms":
        return RMSNorm(C, data_format=fmt, kernels=kernels)
    return PointWise(C, norm, data_format=fmt, kernels=kernels, **kw)


def randomized(m: nn.Module, seed: int = 0) -> nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            value = {"weight": lambda: 1 + 0.5 * torch.randn(C, generator=gen),
                     "bias": lambda: 0.5 * torch.randn(C, generator=gen),
                     "alpha": lambda: torch.tensor([0.75]), "shift": lambda: torch.tensor([0.125]),
                     "beta": lambda: torch.tensor([3.0])}[name]
            p.copy_(value())
    return m


def away_from_kinks(shape: tuple[int, ...], seed: int = 1, margin: float = 0.02) -> torch.Tensor:
    """float64 inputs whose u = 0.75 x + 0.125 (randomized's alpha and shift) keeps ``margin`` from kinks."""
    gen = torch.Generator().manual_seed(seed)
    u = torch.randn(shape, generator=gen, dtype=torch.float64) * 2
    for k in torch.cat([KINKS, -KINKS[1:]]):
        near = (u - k).abs() < margin
        u = torch.where(near, k + margin * torch.where(u >= k, 1.0, -1.0), u)
    return (u - 0.125) / 0.75


def outputs_and_grads(m: nn.Module, x: torch.Tensor, g: torch.Tensor) -> list[torch.Tensor]:
    x = x.clone().requires_grad_()
    y = m(x)
    y.backward(g)
    return [y, x.grad, *(p.grad for p in m.parameters())]


@pytest.mark.parametrize("kernels", FUSED)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("norm", NORMS)
def test_fused_path_gradchecks_and_equals_the_plain_path_float64(norm, layout, kernels):
    shape, fmt = LAYOUTS[layout]
    fused = randomized(build(norm, kernels, fmt)).double()
    names = [n for n, _ in fused.named_parameters()]

    def call(x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        return functional_call(fused, dict(zip(names, params, strict=True)), (x,))

    x = away_from_kinks(shape).requires_grad_()
    params = [p.detach().clone().requires_grad_() for p in fused.parameters()]
    assert torch.autograd.gradcheck(call, (x, *params))
    g = torch.randn(shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    plain = randomized(build(norm, "autograd", fmt)).double()
    x = x.detach()
    for a, b in zip(outputs_and_grads(fused, x, g), outputs_and_grads(plain, x, g), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)  # fast_tanh: tanh within 2e-8


@pytest.mark.parametrize("kernels", FUSED)
@pytest.mark.parametrize("fn", FN_CHOICES)
def test_fused_path_takes_autograds_slope_at_the_kinks(fn, kernels):
    """At u exactly on a kink (alpha 1, shift 0) the fused slope is the plain path's: clamp's is 0 on the
    boundary, sign's 0 at 0, exproot's and power23_clip's infinite slope at 0 NaN."""
    x = torch.cat([KINKS, -KINKS[1:]])[:, None].expand(-1, C).contiguous()
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    fused, plain = (build(fn, k, alpha0=1.0, shift0=0.0).double() for k in (kernels, "autograd"))
    for a, b in zip(outputs_and_grads(fused, x, g), outputs_and_grads(plain, x, g), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, equal_nan=True)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("norm", NORMS)
def test_fused_path_in_bfloat16_matches_float32_at_the_rounded_input(norm, layout):
    shape, fmt = LAYOUTS[layout]
    gen = torch.Generator().manual_seed(4)
    x = away_from_kinks(shape).float().bfloat16()
    g = torch.randn(shape, generator=gen).bfloat16()
    with torch.autocast("cpu", torch.bfloat16):
        low = outputs_and_grads(randomized(build(norm, "eager", fmt)), x, g)
    ref = outputs_and_grads(randomized(build(norm, "autograd", fmt)), x.float(), g.float())
    assert low[0].dtype == low[1].dtype == torch.bfloat16
    for a, b in zip(low[:2], ref[:2], strict=True):  # y and dL/dx: rounded once to bfloat16
        torch.testing.assert_close(a.float(), b, rtol=1e-2, atol=1e-2)
    for a, b in zip(low[2:], ref[2:], strict=True):  # the parameters' gradients: float32 throughout
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def fused_function_of(y: torch.Tensor) -> str:
    return type(y.grad_fn).__name__


@pytest.mark.parametrize("norm", ["erf", "dyisru", "rms", "derf"])
def test_the_fused_path_is_the_default_and_autograd_selectable(norm, monkeypatch):
    # "auto" compiles large, common shapes (test_norm_definitions): here every input is large and common,
    # and the compiled kernels run op by op, to check that the default reaches the fused Function
    monkeypatch.setattr(kernels, "compiler_available", lambda device_type: True)
    monkeypatch.setattr(kernels, "_calls", collections.Counter())
    monkeypatch.setattr(kernels, "COMPILE_AFTER_CALLS", 0)
    monkeypatch.setattr(kernels, "COMPILE_MIN_NUMEL", 0)
    for module in (pointwise_kernels, rms_kernels):
        monkeypatch.setattr(module._KERNELS, "get", lambda mode, k=module._KERNELS: k.eager)
    default = Derf(C) if norm == "derf" else build(norm, "auto")
    assert default.kernels == "auto"
    x = torch.randn(2, 3, C, requires_grad=True)
    function = "_RMSNormFunctionBackward" if norm == "rms" else "_PointWiseFunctionBackward"
    assert fused_function_of(default(x)) == function
    assert fused_function_of(build("erf" if norm == "derf" else norm, "autograd")(x)) != function


@pytest.mark.parametrize("norm", ["erf", "tanh", "dyisru", "rms"])
def test_the_fused_path_saves_only_its_input_and_row_statistics(norm):
    m = build(norm, "eager")
    x = torch.randn(2, 3, C, requires_grad=True)
    params = {p.data_ptr() for p in m.parameters()}
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        m(x)
    large = [t for t in saved if t.data_ptr() not in params and t.numel() > 2 * 3]
    assert [t.data_ptr() for t in large] == [x.data_ptr()]  # rms: a sum of squares per row beside it


@pytest.mark.parametrize("kernels", FUSED)
@pytest.mark.parametrize("norm", ["erf", "dyisru", "rms"])
def test_a_checkpoint_of_either_path_loads_in_the_other(norm, kernels):
    x, g = torch.randn(2, 3, C), torch.randn(2, 3, C)
    for train, other in ((kernels, "autograd"), ("autograd", kernels)):
        m = build(norm, train)
        outputs_and_grads(m, x, g)
        with torch.no_grad():
            for p in m.parameters():
                p -= 0.1 * p.grad
        loaded = build(norm, other)
        loaded.load_state_dict(m.state_dict())
        assert list(loaded.state_dict()) == list(m.state_dict())
        torch.testing.assert_close(loaded(x), m(x))
    fixed = PointWise(C, "tanh", learnable_shift=False, kernels="eager")
    assert [n for n, _ in fixed.named_parameters()] == ["alpha", "weight", "bias"]
    torch.testing.assert_close(fixed(x), torch.tanh(0.5 * x))


@pytest.mark.parametrize("norm", [n if n in ("erf", "rms") else pytest.param(n, marks=pytest.mark.slow)
                                  for n in NORMS])
def test_compiled_kernels_match_the_plain_path(norm):
    shape, fmt = LAYOUTS["tokens"] if norm != "rms" else LAYOUTS["map_channels_first"]
    x, g = away_from_kinks(shape).float(), torch.randn(shape)
    compiled = outputs_and_grads(randomized(build(norm, "compiled", fmt)), x, g)
    plain = outputs_and_grads(randomized(build(norm, "autograd", fmt)), x, g)
    for a, b in zip(compiled, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not native.available(), reason="native kernels do not build here")
@pytest.mark.parametrize("norm", NORMS)
def test_native_loops_in_float32_match_the_plain_path_with_vector_and_block_remainders(norm):
    """37 rows (a block of 32 and 5), 20 channels (a vector of 16 and 4), two threads; channels first with an
    inner size of 35."""
    channels = 20
    for shape, fmt in (((37, channels), "channels_last"), ((2, channels, 5, 7), "channels_first")):
        x = 2 * torch.randn(shape, generator=torch.Generator().manual_seed(5))
        g = torch.randn(shape, generator=torch.Generator().manual_seed(6))
        layers = []
        for k in ("native", "autograd"):
            layer = (RMSNorm(channels, data_format=fmt, kernels=k) if norm == "rms" else
                     PointWise(channels, norm, data_format=fmt, kernels=k, vector_shift=norm != "dyisru"))
            torch.manual_seed(7)
            with torch.no_grad():
                for p in layer.parameters():
                    p.add_(0.3 * torch.randn(p.shape))
            layers.append(layer)
        with torch.autograd.set_grad_enabled(True):
            threads = torch.get_num_threads()
            torch.set_num_threads(2)
            try:
                fused = outputs_and_grads(layers[0], x, g)
            finally:
                torch.set_num_threads(threads)
        for a, b in zip(fused, outputs_and_grads(layers[1], x, g), strict=True):  # rtol: exproot near 0
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, equal_nan=True)


def test_auto_picks_the_native_loops_for_large_cpu_inputs_and_compiled_elsewhere(monkeypatch):
    monkeypatch.setattr(native, "supports", lambda x: x.device.type == "cpu" and x.dtype in native.DTYPES)
    monkeypatch.setattr(kernels, "compiler_available", lambda device_type: True)
    monkeypatch.setattr(kernels, "COMPILE_AFTER_CALLS", 0)
    big, small = torch.empty(kernels.COMPILE_MIN_NUMEL), torch.empty(8)
    assert kernels.resolve_kernels("auto", big, "kind", has_native=True) == "native"
    assert kernels.resolve_kernels("auto", small, "kind", has_native=True) == "autograd"  # smoke tables
    assert kernels.resolve_kernels("auto", big.bfloat16(), "kind", has_native=True) == "compiled"
    assert kernels.resolve_kernels("auto", big, "kind") == "compiled"  # DTN has no native loops
    assert kernels.resolve_kernels("native", big.bfloat16(), "kind", has_native=True) == "compiled"
    monkeypatch.setattr(native, "supports", lambda x: False)  # no compiler, or not Linux
    assert kernels.resolve_kernels("auto", big, "kind", has_native=True) == "compiled"


def test_a_library_that_does_not_build_is_said_once_and_the_layers_run_on(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("NORMEXP_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(native, "FLAGS", (*native.FLAGS, "--no-such-flag"))
    native.library.cache_clear()
    try:
        with caplog.at_level("WARNING"):
            assert not native.available() and not native.available()
        assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1
        assert "native CPU kernels unavailable" in caplog.text and "--no-such-flag" in caplog.text
        assert list(tmp_path.iterdir()) == []  # no partial library left behind
        assert kernels.resolve_kernels("native", torch.empty(4), "kind", has_native=True) == "compiled"
    finally:
        native.library.cache_clear()
