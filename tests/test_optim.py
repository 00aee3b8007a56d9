"""normexp's optimizers in timm's factory: ``maelars`` against the rule of MAE's ``util/lars.py`` (by hand and
over several steps), where timm's ``Lars`` differs."""

from __future__ import annotations

import pytest
import torch
from timm.optim import Lars, create_optimizer_v2
from torch import nn

from normexp.optim import MAELars


def mae_lars_steps(params: list[torch.Tensor], grads: list[list[torch.Tensor]], lr: float, wd: float,
                   momentum: float = 0.9, trust: float = 0.001) -> list[torch.Tensor]:
    """The parameters after MAE's LARS steps (util/lars.py, from its description): matrices decayed and
    scaled by trust ||w|| / ||g + wd w||, vectors neither; momentum mu = m mu + update; w -= lr mu."""
    params = [p.clone() for p in params]
    buffers = [torch.zeros_like(p) for p in params]
    for step_grads in grads:
        for p, g, mu in zip(params, step_grads, buffers, strict=True):
            update = g.clone()
            if p.ndim > 1:
                update = update + wd * p
                w_norm, u_norm = p.norm(), update.norm()
                if w_norm > 0 and u_norm > 0:
                    update = update * (trust * w_norm / u_norm)
            mu.mul_(momentum).add_(update)
            p.sub_(lr * mu)
    return params


def test_one_step_by_hand():
    weight, bias = nn.Parameter(torch.tensor([[3.0, 4.0]])), nn.Parameter(torch.tensor([1.0]))
    optimizer = MAELars([weight, bias], lr=1.0, weight_decay=0.0)
    weight.grad, bias.grad = torch.tensor([[0.6, 0.8]]), torch.tensor([0.5])
    optimizer.step()
    # ||w|| = 5, ||g|| = 1: the weight moves by 0.001 x 5 x g; the bias by its plain gradient
    assert torch.allclose(weight, torch.tensor([[3 - 0.003, 4 - 0.004]]))
    assert torch.allclose(bias, torch.tensor([0.5]))


@pytest.mark.parametrize("wd", [0.0, 0.05])
def test_maelars_from_timms_factory_follows_maes_rule_and_timms_lars_does_not(wd):
    torch.manual_seed(0)
    head = nn.Linear(6, 4)
    zero = nn.Parameter(torch.zeros(3, 2))  # ||w|| = 0: trust ratio 1
    grads = [[torch.randn_like(p) for p in (head.weight, head.bias, zero)] for _ in range(4)]
    expected = mae_lars_steps([head.weight.detach(), head.bias.detach(), zero.detach()], grads, 0.3, wd)
    results = {}
    for name, opt in (("maelars", "maelars"), ("timm", "lars")):
        model = nn.Module()
        model.head, model.extra = nn.Linear(6, 4), nn.Module()
        model.head.load_state_dict(head.state_dict())
        model.extra.zero = nn.Parameter(torch.zeros(3, 2))
        optimizer = create_optimizer_v2(model, opt=opt, lr=0.3, weight_decay=wd)
        assert isinstance(optimizer, MAELars if name == "maelars" else Lars)
        params = [model.head.weight, model.head.bias, model.extra.zero]
        for step_grads in grads:
            for p, g in zip(params, step_grads, strict=True):
                p.grad = g.clone()
            optimizer.step()
        results[name] = [p.detach() for p in params]
    for ours, reference in zip(results["maelars"], expected, strict=True):
        torch.testing.assert_close(ours, reference, rtol=1e-6, atol=1e-7)
    moved, timm_moved = expected[0] - head.weight.detach(), results["timm"][0] - head.weight.detach()
    assert (timm_moved - moved).norm() > 0.01 * moved.norm()  # timm's rule moves it elsewhere
