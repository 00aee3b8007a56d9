"""PowerNorm against an element-by-element reference of the DTN code's module (wqshao126/DTN
``models/normkit/norms/us_powernorm.py``: ``GroupScaling1D`` + ``PowerFunction_PN``), with per-head group
scaling, through warm-up, the step where it ends, and after; then eval and the channels-first layout."""

from __future__ import annotations

import math

import pytest
import torch

from normexp.norms import norm_layer_factory
from normexp.norms.power import PowerNorm

C, HEADS, WARMUP, EPS = 6, 3, 3, 1e-5


class OfficialPowerNorm:
    """The official forward / backward written out per row and channel (float64, plain Python floats)."""

    def __init__(self, weight: list[float], bias: list[float]) -> None:
        self.weight, self.bias = weight, bias
        self.phi, self.nu, self.step = [1.0] * C, [0.0] * C, 0

    @staticmethod
    def group_scale(rows: torch.Tensor) -> torch.Tensor:
        """GroupScaling1D, row by row and head by head (autograd tracks it, as in the official code)."""
        d = C // HEADS
        out = []
        for m in range(rows.shape[0]):
            for h in range(HEADS):
                chans = [rows[m, h * d + j] for j in range(d)]
                rms = torch.sqrt(sum(v * v for v in chans) / d + EPS)
                out += [v / rms for v in chans]
        return torch.stack(out).view(rows.shape)

    def train_step(self, x: torch.Tensor, grad_out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Output, dL/dx, dL/dweight, dL/dbias of one training step with upstream gradient ``grad_out``."""
        self.step += 1
        t = self.step
        x = x.detach().double().requires_grad_(True)
        scaled = self.group_scale(x.reshape(-1, C))
        s = scaled.detach().tolist()
        g_out = grad_out.double().reshape(-1, C).tolist()
        rows = len(s)
        var = [sum(s[m][c] ** 2 for m in range(rows)) / rows for c in range(C)]
        used = var if t <= WARMUP else list(self.phi)                      # forward: batch, then running
        z = [[s[m][c] / math.sqrt(used[c] + EPS) for c in range(C)] for m in range(rows)]
        y = [[self.weight[c] * z[m][c] + self.bias[c] for c in range(C)] for m in range(rows)]
        for c in range(C):                                                  # running phi
            if t < WARMUP:
                self.phi[c] = self.phi[c] * (t - 1) / t + var[c] / t
            self.phi[c] = 0.9 * self.phi[c] + 0.1 * var[c]
        grad_scaled = [[0.0] * C for _ in range(rows)]
        for c in range(C):                                                  # approximate backward
            approx = [g_out[m][c] * self.weight[c] - 0.1 * self.nu[c] * z[m][c] for m in range(rows)]
            self.nu[c] += sum(approx[m] * z[m][c] for m in range(rows)) / rows
            denom = var[c] if t < WARMUP else self.phi[c]
            for m in range(rows):
                grad_scaled[m][c] = approx[m] / math.sqrt(denom + EPS)
        (grad_x,) = torch.autograd.grad(scaled, x, torch.tensor(grad_scaled, dtype=torch.float64))
        grad_w = [sum(g_out[m][c] * z[m][c] for m in range(rows)) for c in range(C)]
        grad_b = [sum(g_out[m][c] for m in range(rows)) for c in range(C)]
        f64 = torch.float64
        return (torch.tensor(y, dtype=f64).view(x.shape), grad_x, torch.tensor(grad_w, dtype=f64),
                torch.tensor(grad_b, dtype=f64))

    def eval(self, x: torch.Tensor) -> torch.Tensor:
        s = self.group_scale(x.double().reshape(-1, C)).tolist()
        return torch.tensor([[self.weight[c] * s[m][c] / math.sqrt(self.phi[c] + EPS) + self.bias[c]
                              for c in range(C)] for m in range(len(s))], dtype=torch.float64).view(x.shape)


def test_matches_the_official_module_through_warmup_and_after():
    torch.manual_seed(0)
    layer = norm_layer_factory("power", warmup_iters=WARMUP)(C, num_heads=HEADS).double()
    assert layer.groups == HEADS  # the DTN code's group_num = head count
    with torch.no_grad():
        layer.weight.copy_(1 + 0.5 * torch.randn(C))
        layer.bias.copy_(0.5 * torch.randn(C))
    ref = OfficialPowerNorm(layer.weight.tolist(), layer.bias.tolist())
    for step in range(1, 6):  # steps 1-2 warm-up, 3 the last warm-up forward, 4-5 after
        # heads at different scales: group scaling must divide each head by its own RMS
        x = torch.randn(2, 4, C, dtype=torch.float64) * torch.tensor([0.2, 0.2, 3, 3, 1, 1]) + 0.3 * step
        grad_out = torch.randn(2, 4, C, dtype=torch.float64)
        x.requires_grad_(True)
        layer.zero_grad()
        y = layer(x)
        y.backward(grad_out)
        y_ref, gx_ref, gw_ref, gb_ref = ref.train_step(x, grad_out)
        torch.testing.assert_close(y, y_ref, msg=f"output, step {step}")
        torch.testing.assert_close(x.grad, gx_ref, msg=f"dL/dx, step {step}")
        torch.testing.assert_close(layer.weight.grad, gw_ref)
        torch.testing.assert_close(layer.bias.grad, gb_ref)
        torch.testing.assert_close(layer.running_phi, torch.tensor(ref.phi, dtype=torch.float64))
        torch.testing.assert_close(layer.running_nu, torch.tensor(ref.nu, dtype=torch.float64))
    assert int(layer.num_batches_tracked) == 5
    layer.eval()
    x = torch.randn(3, 2, C, dtype=torch.float64)
    torch.testing.assert_close(layer(x), ref.eval(x))
    # channels-first maps: the same layer on (B, C, H, W)
    maps = PowerNorm(C, num_heads=HEADS, data_format="channels_first").double().eval()
    maps.load_state_dict(layer.state_dict())
    x = torch.randn(2, 2, 3, C, dtype=torch.float64)
    torch.testing.assert_close(maps(x.movedim(-1, 1)), layer(x).movedim(-1, 1))


def test_group_scaling_is_per_head_not_per_token():
    """Each head's channels come out with RMS 1 on their own (eval, running phi still 1)."""
    layer = PowerNorm(4, num_heads=2).eval()
    x = torch.tensor([[[10.0, -10.0, 0.1, 0.1]]])  # one RMS over the token would leave head 1 at 0.014
    y = layer(x)
    torch.testing.assert_close(y, torch.tensor([[[1.0, -1.0, 1.0, 1.0]]]), atol=1e-3, rtol=0)


@pytest.mark.parametrize("groups,heads,expected", [(None, 4, 4), (None, None, 1), (2, 4, 2)])
def test_groups_default_to_the_head_count(groups, heads, expected):
    assert PowerNorm(8, groups=groups, num_heads=heads).groups == expected
    with pytest.raises(ValueError, match="divide"):
        PowerNorm(8, groups=3)


def test_step_counter_survives_state_dict():
    m = PowerNorm(C, warmup_iters=3)
    for _ in range(2):
        m(torch.randn(2, 3, C))
    fresh = PowerNorm(C, warmup_iters=3)
    fresh(torch.randn(2, 3, C))  # its host counter is now 1
    fresh.load_state_dict(m.state_dict())
    fresh(torch.randn(2, 3, C))
    assert int(fresh.num_batches_tracked) == 3 and fresh._steps == 3
