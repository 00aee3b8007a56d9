"""Optimizers beyond timm's, registered in timm's optimizer registry so that ``trainer.opt`` names them as it
names timm's own (the factory, parameter groups, weight-decay exemptions and layer decay stay timm's).

``maelars``: the LARS of MAE's linear probe (facebookresearch/mae ``util/lars.py``, ``main_linprobe.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from timm.optim import OptimInfo
from timm.optim._optim_factory import default_registry


class MAELars(torch.optim.Optimizer):
    """LARS (You et al. 2017, arXiv 1708.03888) as MAE's ``util/lars.py`` applies it: a parameter of more
    than one dimension has the weight decay added to its gradient, and the sum scaled by its trust ratio
    ``trust_coefficient * ||w|| / ||g + wd w||`` (1 where either norm is 0); one of one dimension (a bias, a
    norm's affine) is neither decayed nor adapted; then heavy-ball momentum without dampening, ``w -= lr m``.
    timm's ``Lars`` is another rule: it divides by ``||g|| + wd ||w||`` and adapts every parameter of a group
    that has weight decay (none when, as in MAE's linear probe, the decay is 0)."""

    def __init__(self, params: Iterable[Any], lr: float = 0.0, weight_decay: float = 0.0,
                 momentum: float = 0.9, trust_coefficient: float = 0.001) -> None:
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay, "momentum": momentum,
                                  "trust_coefficient": trust_coefficient})

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                update = p.grad
                if p.ndim > 1:
                    update = update.add(p, alpha=group["weight_decay"])
                    w_norm, u_norm = torch.linalg.vector_norm(p), torch.linalg.vector_norm(update)
                    trust = torch.where((w_norm > 0) & (u_norm > 0),
                                        group["trust_coefficient"] * w_norm / u_norm, torch.ones_like(w_norm))
                    update = update * trust
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                buffer = state["momentum_buffer"]
                buffer.mul_(group["momentum"]).add_(update)
                p.add_(buffer, alpha=-group["lr"])
        return loss


# timm splits an optimizer's name at "_" (lookahead_adamw), so the name has none
default_registry.register(OptimInfo(name="maelars", opt_class=MAELars, has_eps=False, has_momentum=True,
                                    description="LARS as facebookresearch/mae util/lars.py"))
