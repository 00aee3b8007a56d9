"""Fixup (Zhang et al. 2019, arXiv 1901.09321, Sec. 3) adapted to Transformers, the initialization-based
baseline of DyT Table 9 (arXiv 2503.10622 Sec. 6.3). DyT released no code for it; ``norm=fixup`` applies to
the built model (:meth:`Fixup.adapt_model`), over the L residual branches a model names in
``residual_scales``: each branch's last weight layer and the classifier start at zero, its other value-path
weight layers are scaled by ``L ** (-1 / (2m - 2))`` (queries and keys kept, as T-Fixup, Huang et al. 2020),
and scalar biases and a multiplier are added by forward hooks (``fixup_bias`` / ``fixup_scale``). LeViT's
fused ``qkv.linear`` interleaves q, k, v per head, so it is scaled whole.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .normfree import NoNorm, branch_modules, classifier_layers, residual_branches
from .registry import register_norm

WEIGHT_LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d)
ACTIVATIONS = (nn.GELU, nn.ReLU, nn.SiLU, nn.Hardswish, nn.ReLU6, nn.Tanh)
QUERY_KEY = ("q", "k")  # projections that only feed the attention's weights
FIRST = ("sr",)  # PVT's spatial reduction feeds the keys and values, though PVT registers it after ``proj``


def _shift_input(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    return (args[0] + module.fixup_bias, *args[1:])


def _scale_output(module: nn.Module, _args: Any, output: torch.Tensor) -> torch.Tensor:
    return module.fixup_scale * output + module.fixup_bias


def _scalar(value: float) -> nn.Parameter:
    return nn.Parameter(torch.full((1,), float(value)))


def value_rows(name: str, layer: nn.Module) -> slice:
    """The output rows of ``layer`` on the value path: a fused ``qkv``'s last third, a ``kv``'s second
    half."""
    leaf, rows = name.rsplit(".", 1)[-1], layer.weight.shape[0]
    if leaf == "qkv" and rows % 3 == 0:
        return slice(2 * rows // 3, rows)
    if leaf == "kv" and rows % 2 == 0:
        return slice(rows // 2, rows)
    return slice(0, rows)


def branch_layers(model: nn.Module, name: str, branch: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, layer) of the branch's weight layers: its own, or those its parent registers before it."""
    own = [(n, m) for n, m in branch.named_modules() if isinstance(m, WEIGHT_LAYERS)]
    if own or "." not in name:
        return own
    parent = model.get_submodule(name.rpartition(".")[0])
    before = []
    for child_name, child in parent.named_children():
        if child is branch:
            break
        before += [(f"{child_name}.{n}".rstrip("."), m) for n, m in child.named_modules()
                   if isinstance(m, WEIGHT_LAYERS)]
    return before


@register_norm("fixup")
class Fixup(NoNorm):
    """The identity in a norm slot; :meth:`adapt_model` applies Fixup's rules."""

    @staticmethod
    def adapt_model(model: nn.Module) -> None:
        branches = branch_modules(model, "norm=fixup")
        depth = len(branches)
        for name, branch in zip(residual_branches(model), branches, strict=True):
            layers = branch_layers(model, name, branch)
            path = [(n, m) for n, m in layers if n.rsplit(".", 1)[-1] not in QUERY_KEY]
            path.sort(key=lambda nm: nm[0].rsplit(".", 1)[-1] not in FIRST)  # stable: registration order
            if not path:
                raise ValueError(f"norm=fixup: a residual branch ({type(branch).__name__}) has no weights")
            scale = depth ** (-1 / (2 * len(path) - 2)) if len(path) > 1 else 1.0
            with torch.no_grad():
                for layer_name, layer in path[:-1]:
                    layer.weight[value_rows(layer_name, layer)] *= scale
                last = path[-1][1]
                last.weight.zero_()
                if last.bias is not None:
                    last.bias.zero_()
            activations = [m for m in branch.modules() if isinstance(m, ACTIVATIONS)]
            for module in [m for _, m in layers] + activations:
                module.register_parameter("fixup_bias", _scalar(0.0))
                module.register_forward_pre_hook(_shift_input)
            branch.register_parameter("fixup_scale", _scalar(1.0))
            branch.register_parameter("fixup_bias", _scalar(0.0))
            branch.register_forward_hook(_scale_output)
        with torch.no_grad():
            for layer in classifier_layers(model):
                layer.weight.zero_()
                if layer.bias is not None:
                    layer.bias.zero_()
