"""The norm slots of a built model, hooked: what each slot sees and returns, as (B, grid tokens, C) plus
prefix tokens whatever its layout (tokens, maps either way, pooled vectors, per-head folds). The slot names
and contexts are the placement's (``norm_context``): no family needs code here."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..norms.placement import SLOT_TYPES, slot_shape


def slot_format(module: nn.Module) -> str:
    """``channels_last`` or ``channels_first``: how the slot reads its input."""
    if isinstance(module, SLOT_TYPES):
        return slot_shape(module)[1]
    return getattr(module, "data_format", "channels_last")


def slot_context(model: nn.Module, name: str) -> dict[str, Any]:
    """The slot's context from the backbone contract (empty for a model without ``norm_context``)."""
    context_fn = getattr(model, "norm_context", None)
    return dict(context_fn(name)) if context_fn is not None else {}


@dataclass
class Tokens:
    """A slot tensor as tokens: ``grid`` (B, H*W, C), ``prefix`` (B, P, C), ``shape`` (H, W) or None
    (pooled)."""

    grid: torch.Tensor
    prefix: torch.Tensor
    shape: tuple[int, int] | None


def grid_tokens(t: torch.Tensor, data_format: str, layout: Any = None) -> Tokens:
    """``t`` as seen by a slot of ``data_format`` with token ``layout`` -> :class:`Tokens`."""
    if t.dim() == 2:  # pooled (B, C)
        return Tokens(t[:, None], t[:, :0], None)
    if t.dim() == 4:
        if data_format == "channels_first":
            t = t.permute(0, 2, 3, 1)
        b, h, w, c = t.shape
        return Tokens(t.reshape(b, h * w, c), t.new_zeros(b, 0, c), (h, w))
    if t.dim() == 3:
        if data_format == "channels_first":  # (B, C, L): a 1-D map
            t = t.transpose(1, 2)
        grid = getattr(layout, "grid", None)
        if grid is None:
            return Tokens(t, t[:, :0], None)
        n = grid[0] * grid[1]
        prefix = t.shape[1] - n
        if prefix < 0:
            raise ValueError(f"{t.shape[1]} tokens do not fit the layout's grid {grid}")
        return Tokens(t[:, prefix:], t[:, :prefix], (int(grid[0]), int(grid[1])))
    raise ValueError(f"a norm slot tensor of shape {tuple(t.shape)} is not tokens, a map or a vector")


def unfold_heads(t: torch.Tensor, layout: Any) -> tuple[torch.Tensor, Any]:
    """A per-head slot's (B * heads, N, head_dim) tensor as its block's (B, N, C) tokens and layout; others
    as they are."""
    if t.dim() != 3 or not hasattr(layout, "unfold"):
        return t, layout
    return layout.unfold(t), layout.layout


def channel_dim(t: torch.Tensor, data_format: str) -> int:
    return 1 if data_format == "channels_first" and t.dim() > 2 else t.dim() - 1


SlotCallback = Callable[[str, nn.Module, torch.Tensor, torch.Tensor], None]


@contextmanager
def hooked_slots(model: nn.Module, names: Sequence[str], callback: SlotCallback) -> Iterator[None]:
    """While inside: ``callback(name, module, input, output)`` after each forward of a slot in ``names``."""
    handles = []
    try:
        for name in names:
            module = model.get_submodule(name)

            def hook(mod: nn.Module, args: tuple[Any, ...], output: Any, _name: str = name) -> None:
                callback(_name, mod, args[0], output)

            handles.append(module.register_forward_hook(hook))
        yield
    finally:
        for handle in handles:
            handle.remove()


def affine_params(module: nn.Module) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The slot's final per-channel affine (``weight``, ``bias``), each None when it has none."""
    weight = getattr(module, "weight", None)
    bias = getattr(module, "bias", None)
    return (weight if isinstance(weight, torch.Tensor) else None,
            bias if isinstance(bias, torch.Tensor) else None)


@torch.no_grad()
def without_affine(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The slot's output for ``x`` before its per-channel affine (what DyT Fig. 2 plots for LN)."""
    weight, bias = affine_params(module)
    saved = [(p, p.detach().clone()) for p in (weight, bias) if p is not None]
    try:
        if weight is not None:
            weight.fill_(1.0)
        if bias is not None:
            bias.zero_()
        return module.forward(x)
    finally:
        for p, value in saved:
            p.copy_(value)
