"""Normalization-free baselines (DyT Table 9, arXiv 2503.10622 Sec. 6.3): the identity in every norm slot,
then the method's rule on the built model (``adapt_model``). ``norm=none``: nothing else;
``norm=skipinit`` (De & Smith 2020, arXiv 2002.10444, Sec. 4; ReZero, arXiv 2003.04887): a learnable scalar
gate at ``gate0`` on every residual branch (``<branch>.skip_gate``, a forward hook). DyT released no code.
"""

from __future__ import annotations

import fnmatch
from typing import Any

import torch
from torch import nn

from .functional import check_data_format
from .registry import register_norm


@register_norm("none")
class NoNorm(nn.Module):
    """The identity in a norm slot (it keeps the slot's data format for the placement's records)."""

    def __init__(self, dim: int, data_format: str = "channels_last") -> None:
        super().__init__()
        self.dim, self.data_format = dim, check_data_format(data_format)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def extra_repr(self) -> str:
        return f"{self.dim}, identity"


def declared_modules(model: nn.Module, attribute: str) -> list[str]:
    """The modules of ``model`` that its submodules name in ``attribute`` (fnmatch patterns, relative to the
    submodule declaring them), in module order."""
    modules = dict(model.named_modules())
    names: set[str] = set()
    for prefix, module in modules.items():
        for pattern in getattr(module, attribute, ()):
            full = f"{prefix}.{pattern}" if prefix else pattern
            names.update(n for n in modules if fnmatch.fnmatchcase(n, full))
    return [n for n in modules if n in names]


def residual_branches(model: nn.Module) -> list[str]:
    """The modules of ``model`` whose output is a residual branch's (every submodule's
    ``residual_scales``)."""
    return declared_modules(model, "residual_scales")


def branch_modules(model: nn.Module, method: str) -> list[nn.Module]:
    """The residual branches for ``method``; refused for a model that names none or whose branches start
    closed (DiT's adaLN-Zero)."""
    names = residual_branches(model)
    if not names:
        raise ValueError(f"{method} works on residual branches, and {type(model).__name__} names none "
                         "(residual_scales in normexp/models/base.py)")
    gated = [m for m in model.modules() if getattr(m, "branches_start_closed", False)]
    if gated:
        raise ValueError(f"{method} closes the residual branches at init, and {type(gated[0]).__name__}'s "
                         "zero-initialised gates already do: no branch would ever learn; build it with "
                         "backbone.zero_init=none")
    return [model.get_submodule(name) for name in names]


def classifier_layers(model: nn.Module) -> list[nn.Module]:
    """Every weight layer of the model's classifier(s) (``get_classifier()``, else ``head``)."""
    found = model.get_classifier() if hasattr(model, "get_classifier") else getattr(model, "head", None)
    heads = found if isinstance(found, (tuple, list)) else [found]
    return [m for head in heads if isinstance(head, nn.Module) for m in head.modules()
            if isinstance(m, (nn.Linear, nn.Conv2d))]


def _gated(module: nn.Module, _args: Any, output: torch.Tensor) -> torch.Tensor:
    return module.skip_gate * output


@register_norm("skipinit")
class SkipInit(NoNorm):
    """The identity in a norm slot; :meth:`adapt_model` puts the gates on the branches."""

    def __init__(self, dim: int, gate0: float = 0.0, data_format: str = "channels_last") -> None:
        super().__init__(dim, data_format)

    @staticmethod
    def adapt_model(model: nn.Module, gate0: float = 0.0) -> None:
        for branch in branch_modules(model, "norm=skipinit"):
            branch.register_parameter("skip_gate", nn.Parameter(torch.full((1,), float(gate0))))
            branch.register_forward_hook(_gated)
