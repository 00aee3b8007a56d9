"""Fixup, the initialization-based baseline of DyT Table 9 (arXiv 2503.10622 Sec. 6.3, which cites "Fixup
(Zhang et al., 2019; Huang et al., 2020)"); DyT released no code for it. ``norm=fixup`` makes every norm slot
the identity and applies one of the two papers' rules to the built model (:meth:`Fixup.adapt_model`), over the
residual branches a model names in ``residual_scales``:

* ``rule=fixup`` -- Zhang et al. 2019 (arXiv 1901.09321) as their code applies it. A model with attention
  branches follows their Transformer code (hongyi-zhang/Fixup ``fairseq/models/transformer_zero.py``,
  ``modules/multihead_attention_zero.py``), with L the model's residual branches: the attention's input
  projections (q, k and v alike) Xavier-uniform x ``L^(-1/6)``, an MLP's layers but the last Xavier-uniform x
  ``L^(-1/(2m-2))`` (m layers: fc1 x ``L^(-1/2)``), every branch's last layer and the classifier at zero, no
  bias in a branch; a scalar shift on the attention's input, before each MLP layer and activation, a scalar
  multiplier on every branch's output, and a shift and a multiplier in the final norm's place (``fixup_bias``,
  ``fixup_scale``: forward hooks). A convolutional model (ResNet, ConvNeXt) follows their ResNet code
  (``imagenet/models/fixup_resnet_imagenet.py``): its layers as built x ``L^(-1/(2m-2))``, the last at zero, a
  scalar bias before each layer and activation, a multiplier and a bias on the branch output.
* ``rule=t_fixup`` -- T-Fixup (Huang et al., ICML 2020; layer6ai-labs/T-Fixup
  ``fairseq/modules/transformer_layer.py`` ``fixup_initialization``), Transformers only: every branch layer
  Xavier-uniform (biases 0; q, k, v biases torch's default), then in a stack of N blocks the value rows x
  ``sqrt(2) * 0.67 N^(-1/4)`` (fairseq draws q, k, v at gain 1/sqrt(2)), the attention's output projection and
  the MLP's layers x ``0.67 N^(-1/4)``, queries and keys as drawn; the input embedding the model declares
  (``input_embedding``: the ViT's patch embedding, position table and class token) x ``(9N)^(-1/4)``. Nothing
  starts at zero and no scalar is added.

A stack is the blocks whose names share the part before the first index (a ViT's ``blocks``, MAE's
``encoder.blocks`` and ``decoder_blocks``). Which rule DyT ran is not published; the ``dyt_normfree`` table
runs ``t_fixup``, the rule Huang et al. derived for Transformers (docs/normalizers.md says why).
"""

from __future__ import annotations

import fnmatch
import math
import re
from typing import Any

import torch
from torch import nn

from .normfree import NoNorm, branch_modules, classifier_layers, declared_modules, residual_branches
from .registry import register_norm

RULES = ("fixup", "t_fixup")
WEIGHT_LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d)
ACTIVATIONS = (nn.GELU, nn.ReLU, nn.SiLU, nn.Hardswish, nn.ReLU6, nn.Tanh)
ATTENTION_INPUTS = ("qkv", "q", "k", "v", "kv")  # a branch with one of these (first name part) is attention
FIRST = ("sr",)  # PVT's spatial reduction feeds the keys and values, though PVT registers it after ``proj``


def _shift_input(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    return (args[0] + module.fixup_bias, *args[1:])


def _shift_output(module: nn.Module, _args: Any, output: torch.Tensor) -> torch.Tensor:
    return output + module.fixup_bias


def _scale_output(module: nn.Module, _args: Any, output: torch.Tensor) -> torch.Tensor:
    return module.fixup_scale * output


def _scale_and_shift_output(module: nn.Module, _args: Any, output: torch.Tensor) -> torch.Tensor:
    return module.fixup_scale * output + module.fixup_bias


def _scalar(value: float) -> nn.Parameter:
    return nn.Parameter(torch.full((1,), float(value)))


def _add_shift(module: nn.Module, on_output: bool = False) -> None:
    """A learnable scalar added to ``module``'s input (or output)."""
    module.register_parameter("fixup_bias", _scalar(0.0))
    if on_output:
        module.register_forward_hook(_shift_output)
    else:
        module.register_forward_pre_hook(_shift_input)


def projection_rows(name: str, layer: nn.Module, branch: nn.Module) -> dict[str, torch.Tensor]:
    """The output rows of an attention input layer by projection (``q``, ``k``, ``v``): a fused ``qkv``'s
    thirds, a ``kv``'s halves, or, where the attention says its per-head widths (LeViT's ``key_dim`` and
    ``val_dim``), each head's q, k and v rows in turn."""
    role, rows = name.split(".")[0], layer.weight.shape[0]
    parts = {"qkv": ("q", "k", "v"), "kv": ("k", "v")}.get(role, (role,))
    heads, widths = getattr(branch, "num_heads", None), {"q": getattr(branch, "key_dim", None),
                                                         "k": getattr(branch, "key_dim", None),
                                                         "v": getattr(branch, "val_dim", None)}
    index = torch.arange(rows)
    if len(parts) > 1 and heads and all(widths[p] for p in parts) and \
            rows == heads * sum(widths[p] for p in parts):
        per_head = index.view(heads, -1).split([widths[p] for p in parts], dim=1)
        return {p: block.flatten() for p, block in zip(parts, per_head, strict=True)}
    if rows % len(parts):
        return {role: index}
    return dict(zip(parts, index.chunk(len(parts)), strict=True))


def branch_layers(model: nn.Module, name: str, branch: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, layer) of the branch's weight layers in the order data flows through them: its own, or those its
    parent registers before it (a ResNet's bottleneck, whose branch output is ``bn3``)."""
    own = [(n, m) for n, m in branch.named_modules() if isinstance(m, WEIGHT_LAYERS)]
    if not own and "." in name:
        parent = model.get_submodule(name.rpartition(".")[0])
        for child_name, child in parent.named_children():
            if child is branch:
                break
            own += [(f"{child_name}.{n}".rstrip("."), m) for n, m in child.named_modules()
                    if isinstance(m, WEIGHT_LAYERS)]
    own.sort(key=lambda nm: nm[0].split(".")[0] not in FIRST)  # stable: registration order otherwise
    if not own:
        raise ValueError(f"norm=fixup: a residual branch ({type(branch).__name__}) has no weights")
    return own


def slots_before(model: nn.Module, name: str, branch: nn.Module) -> list[nn.Module]:
    """The identity slots the branch's parent registers before it (a ResNet block's ``bn1``, ``bn2``:
    after a convolution, before its ReLU)."""
    if "." not in name:
        return []
    found = []
    for child in model.get_submodule(name.rpartition(".")[0]).children():
        if child is branch:
            return found
        if isinstance(child, NoNorm):
            found.append(child)
    return []


def is_attention(layers: list[tuple[str, nn.Module]]) -> bool:
    return any(n.split(".")[0] in ATTENTION_INPUTS for n, _ in layers)


def stack_of(branch_name: str) -> str:
    """The stack a block belongs to: its name up to the first index (``encoder.blocks.3.attn`` ->
    ``encoder.blocks.``)."""
    return re.split(r"\d", branch_name, maxsplit=1)[0]


def _zero(layer: nn.Module) -> None:
    layer.weight.zero_()
    if layer.bias is not None:
        layer.bias.zero_()


def _xavier(layer: nn.Module, gain: float = 1.0, rows: list[torch.Tensor] | None = None,
            bias: str = "zero") -> None:
    """Xavier-uniform weight at ``gain``, drawn for each of ``rows`` (a fused projection's parts) on its own;
    the bias at zero, or (``bias='default'``) torch's default for a new layer. A grouped (depthwise)
    convolution keeps its weight: Xavier's fans ignore groups."""
    if getattr(layer, "groups", 1) == 1:
        for index in rows if rows is not None else [torch.arange(layer.weight.shape[0])]:
            block = layer.weight[index]
            nn.init.xavier_uniform_(block, gain=gain)
            layer.weight[index] = block
    if layer.bias is not None:
        if bias == "zero":
            nn.init.zeros_(layer.bias)
        else:
            bound = 1 / math.sqrt(layer.weight[0].numel())
            nn.init.uniform_(layer.bias, -bound, bound)


def _drop_bias(layer: nn.Module) -> None:
    """No per-channel bias (Zhang et al.'s layers are built with ``bias=False``; scalars stand in)."""
    if layer.bias is not None:
        layer.register_parameter("bias", None)


@torch.no_grad()
def zhang_fixup(model: nn.Module, names: list[str], branches: list[nn.Module]) -> None:
    """``rule=fixup``: Zhang et al.'s Transformer code on a model with attention branches, their ResNet code
    on one without."""
    depth = len(branches)
    layers = [branch_layers(model, n, b) for n, b in zip(names, branches, strict=True)]
    transformer = any(is_attention(found) for found in layers)
    for name, branch, found in zip(names, branches, layers, strict=True):
        attention = is_attention(found)
        *inputs, (_, last) = found
        m = len(found)
        scale = depth ** (-1 / 6) if attention else depth ** (-1 / (2 * m - 2)) if m > 1 else 1.0
        for _, layer in inputs:
            if transformer:
                _xavier(layer)
            layer.weight.mul_(scale)
        _zero(last)
        for _, layer in found:
            _drop_bias(layer)
        activations = [m for m in branch.modules() if isinstance(m, ACTIVATIONS)]
        if transformer:  # a shift on the attention's input; before each MLP layer and activation
            for module in [branch] if attention else [layer for _, layer in found] + activations:
                _add_shift(module)
            branch.register_parameter("fixup_scale", _scalar(1.0))
            branch.register_forward_hook(_scale_output)
        else:  # the ResNet code: a bias before each layer and each ReLU, a multiplier and bias at the end
            for module in [layer for _, layer in found] + activations:
                _add_shift(module)
            for slot in slots_before(model, name, branch):
                _add_shift(slot, on_output=True)  # bias1b, bias2b
            branch.register_parameter("fixup_scale", _scalar(1.0))
            branch.register_parameter("fixup_bias", _scalar(0.0))
            branch.register_forward_hook(_scale_and_shift_output)
    if transformer:  # the final norm's place: a shift, then a multiplier
        for slot in declared_modules(model, "final_norms"):
            module = model.get_submodule(slot)
            if isinstance(module, NoNorm):
                _add_shift(module)
                module.register_parameter("fixup_scale", _scalar(1.0))
                module.register_forward_hook(_scale_output)
    for layer in classifier_layers(model):
        _zero(layer)
        if not transformer:
            _add_shift(layer)  # the ResNet code's bias before the classifier


@torch.no_grad()
def t_fixup(model: nn.Module, names: list[str], branches: list[nn.Module]) -> None:
    """``rule=t_fixup``: Huang et al.'s encoder rule, stack by stack."""
    layers = [branch_layers(model, n, b) for n, b in zip(names, branches, strict=True)]
    blocks: dict[str, int] = {}
    for name, found in zip(names, layers, strict=True):
        if is_attention(found):
            blocks[stack_of(name)] = blocks.get(stack_of(name), 0) + 1
    for name, branch, found in zip(names, branches, layers, strict=True):
        if stack_of(name) not in blocks:
            raise ValueError(f"norm.rule=t_fixup is T-Fixup's rule for Transformer blocks, and the residual "
                             f"branch {name} is in no stack of attention blocks: use norm.rule=fixup "
                             f"(Fixup's own rule, which covers convolutional branches)")
        factor = 0.67 * blocks[stack_of(name)] ** (-1 / 4)
        for layer_name, layer in found:
            role = layer_name.split(".")[0]
            if role in ATTENTION_INPUTS:  # q, k, v each at fairseq's gain 1 / sqrt(2), biases torch's default
                rows = projection_rows(layer_name, layer, branch)
                _xavier(layer, gain=1 / math.sqrt(2), rows=list(rows.values()), bias="default")
                if "v" in rows:
                    layer.weight[rows["v"]] *= math.sqrt(2) * factor
            else:
                _xavier(layer)
                if role not in FIRST:  # the output projection and the MLP's layers
                    layer.weight.mul_(factor)
    for layer in classifier_layers(model):
        _xavier(layer)
    for prefix, module in model.named_modules():
        patterns = getattr(module, "input_embedding", ())
        if not patterns:
            continue
        depth = sum(count for stack, count in blocks.items() if not prefix or stack.startswith(prefix + "."))
        factor = (9 * depth) ** (-1 / 4)
        for name, parameter in module.named_parameters():
            if any(fnmatch.fnmatchcase(name, p) for p in patterns):
                parameter.mul_(factor)


@register_norm("fixup")
class Fixup(NoNorm):
    """The identity in a norm slot; :meth:`adapt_model` applies the rule."""

    def __init__(self, dim: int, rule: str = "fixup", data_format: str = "channels_last") -> None:
        super().__init__(dim, data_format)

    @staticmethod
    def adapt_model(model: nn.Module, rule: str = "fixup") -> None:
        if rule not in RULES:
            raise ValueError(f"norm.rule must be one of {', '.join(RULES)}, got {rule!r}")
        branches = branch_modules(model, "norm=fixup")
        names = residual_branches(model)
        (zhang_fixup if rule == "fixup" else t_fixup)(model, names, branches)
