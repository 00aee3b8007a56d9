"""Switchable Normalization against a per-element loop of its equations (Luo et al. 2019, Eq. 3), its one-hot
limits (exactly IN, LN and BN, train and eval), and the same numbers for tokens and both map layouts."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from normexp.norms.instance import InstanceNorm
from normexp.norms.sn import SwitchableNorm

B, T, C, EPS = 3, 5, 4, 1e-5


def reference(x: torch.Tensor, wm: list[float], wv: list[float], weight: list[float], bias: list[float],
              bn_stats: tuple[list[float], list[float]] | None = None) -> torch.Tensor:
    """Loop over (b, t, c): mean / variance of IN (over t), LN (over c) and BN (over b, t), mixed."""
    xs = x.tolist()

    def mean_var(values: list[float]) -> tuple[float, float]:
        mu = sum(values) / len(values)
        return mu, sum((v - mu) ** 2 for v in values) / len(values)

    out = torch.empty_like(x)
    for c in range(C):
        if bn_stats is None:
            mu_bn, var_bn = mean_var([xs[b][t][c] for b in range(B) for t in range(T)])
        else:
            mu_bn, var_bn = bn_stats[0][c], bn_stats[1][c]
        for b in range(B):
            mu_in, var_in = mean_var([xs[b][t][c] for t in range(T)])
            for t in range(T):
                mu_ln, var_ln = mean_var(xs[b][t])
                mu = wm[0] * mu_in + wm[1] * mu_ln + wm[2] * mu_bn
                var = wv[0] * var_in + wv[1] * var_ln + wv[2] * var_bn
                out[b, t, c] = weight[c] * (xs[b][t][c] - mu) / math.sqrt(var + EPS) + bias[c]
    return out


def randomized(layer: SwitchableNorm) -> SwitchableNorm:
    with torch.no_grad():
        layer.mean_weight.copy_(torch.tensor([0.3, -0.5, 1.0]))
        layer.var_weight.copy_(torch.tensor([-1.0, 0.7, 0.2]))
        layer.weight.uniform_(0.5, 1.5)
        layer.bias.uniform_(-0.5, 0.5)
    return layer


def test_matches_the_loop_reference_in_train_and_eval():
    torch.manual_seed(0)
    layer = randomized(SwitchableNorm(C)).double()
    x = torch.randn(B, T, C, dtype=torch.float64) * torch.tensor([1.0, 2.0, 0.5, 3.0]) + 1
    wm, wv = layer.mean_weight.softmax(0).tolist(), layer.var_weight.softmax(0).tolist()
    args = (wm, wv, layer.weight.tolist(), layer.bias.tolist())
    torch.testing.assert_close(layer(x), reference(x, *args))
    flat = x.reshape(-1, C)
    torch.testing.assert_close(layer.running_mean, 0.1 * flat.mean(0))  # momentum 0.1 from 0 / 1
    torch.testing.assert_close(layer.running_var, 0.9 + 0.1 * flat.var(0, unbiased=True))
    layer.eval()
    x2 = torch.randn(B, T, C, dtype=torch.float64)
    bn_stats = (layer.running_mean.tolist(), layer.running_var.tolist())
    torch.testing.assert_close(layer(x2), reference(x2, *args, bn_stats=bn_stats))


def one_hot(layer: SwitchableNorm, k: int) -> SwitchableNorm:
    logits = torch.full((3,), -math.inf)
    logits[k] = 0.0
    with torch.no_grad():
        layer.mean_weight.copy_(logits)
        layer.var_weight.copy_(logits)
    return layer


def test_one_hot_weights_are_exactly_in_ln_and_bn():
    torch.manual_seed(1)
    x = torch.randn(B, T, C) * 2 + 0.5
    torch.testing.assert_close(one_hot(SwitchableNorm(C), 0)(x), InstanceNorm(C, unbiased=False)(x))
    torch.testing.assert_close(one_hot(SwitchableNorm(C), 1)(x), F.layer_norm(x, (C,), eps=EPS))
    sn, bn = one_hot(SwitchableNorm(C), 2), nn.BatchNorm1d(C)
    for _ in range(3):  # train: batch statistics, same running statistics
        xb = torch.randn(B, T, C) + 1
        torch.testing.assert_close(sn(xb), bn(xb.reshape(-1, C)).view_as(xb))
    torch.testing.assert_close(sn.running_mean, bn.running_mean)
    torch.testing.assert_close(sn.running_var, bn.running_var)
    sn.eval(), bn.eval()
    torch.testing.assert_close(sn(x), bn(x.reshape(-1, C)).view_as(x))


@pytest.mark.parametrize("train", [True, False])
def test_tokens_and_both_map_layouts_agree(train):
    torch.manual_seed(2)
    tokens = randomized(SwitchableNorm(C)).train(train)
    last = SwitchableNorm(C).train(train)
    first = SwitchableNorm(C, data_format="channels_first").train(train)
    last.load_state_dict(tokens.state_dict())
    first.load_state_dict(tokens.state_dict())
    x = torch.randn(B, 2, 3, C)  # a (B, H, W, C) map of 6 tokens
    expected = tokens(x.reshape(B, 6, C)).view_as(x)
    torch.testing.assert_close(last(x), expected)
    torch.testing.assert_close(first(x.permute(0, 3, 1, 2)), expected.permute(0, 3, 1, 2))
    torch.testing.assert_close(first.running_var, tokens.running_var)


def test_a_pooled_vector_is_refused():
    with pytest.raises(ValueError, match="token"):
        SwitchableNorm(C)(torch.randn(B, C))
