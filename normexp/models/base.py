"""The backbone contract every family in ``normexp/models`` derives from (docs/backbones.md): ``serves`` (what
a task may ask of it), ``config_options`` (the constructor options its yaml shows), ``dense_weights``,
``features``, ``norm_context``, ``norm_keep``, ``no_weight_decay``, ``fixed_input_size``, ``residual_scales``,
``input_embedding``, ``final_norms``, ``branches_start_closed``, ``affine_consumers`` and ``timm_twin``.
Put :class:`Backbone` last among a family's bases so its own methods win."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypedDict

import torch
from timm.layers import trunc_normal_
from torch import nn

from ..norms.layout import FoldedHeads, TokenLayout

CLASSIFICATION, DENSE_FEATURES, DIFFUSION = "classification", "dense features", "diffusion"
NEEDS = (CLASSIFICATION, DENSE_FEATURES, DIFFUSION)  # what a task may ask a model to serve


class NormContext(TypedDict, total=False):
    """What a model tells a norm slot: its ``block`` (None outside blocks), the block's ``num_heads``, the
    ``layout`` of the tokens it sees (None for maps; :class:`FoldedHeads` for per-head slots), the prefix
    tokens before the grid, and whether it normalises a ``pooled`` vector (no token statistics there)."""

    block: int | None
    num_heads: int
    layout: TokenLayout | FoldedHeads | None
    num_prefix_tokens: int
    pooled: bool


class Backbone(nn.Module):
    """Base of every backbone family: the contract, with its defaults."""

    serves: frozenset[str] = frozenset({CLASSIFICATION})
    # the options a run's config shows (``backbone.<option>=``), at the values the size is built with
    # (registry.config_defaults; stored as backbone/code/<name>)
    config_options: Sequence[str] = ("in_chans",)
    dense_weights: Sequence[str] = ()
    feature_channels: list[int]
    feature_strides: list[int]
    norm_keep: Sequence[str] = ()
    fixed_input_size: tuple[int, int] | None = None
    residual_scales: Sequence[str] = ()
    input_embedding: Sequence[str] = ()  # parameters (fnmatch) that make the input tokens (T-Fixup scales)
    final_norms: Sequence[str] = ()  # the norm(s) after the last block (Fixup puts its scalars there)
    branches_start_closed: bool = False

    def features(self, x: torch.Tensor) -> list[torch.Tensor]:
        """NCHW maps at ``feature_strides``, finest first."""
        raise NotImplementedError(f"{type(self).__name__} does not implement features()")

    def norm_context(self, name: str) -> NormContext:
        raise NotImplementedError(f"{type(self).__name__} does not implement norm_context()")

    def no_weight_decay(self) -> set[str]:
        """Parameter names exempt from weight decay (1-D parameters and biases always are)."""
        return set()

    def affine_consumers(self) -> dict[str, tuple[str, ...]]:
        """Norm slot -> the Linear layers that read only its output, through per-channel linear maps at most
        (token selection, average pooling): where its affine folds (:mod:`normexp.models.fold`). None here."""
        return {}

    @classmethod
    def timm_twin(cls, kwargs: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
        """(timm's model name, its arguments) that build this model with ``kwargs`` (the constructor's) in
        timm's own architecture, key for key, when its norms are timm's; None: no such model."""
        return None


def served(model: nn.Module) -> frozenset[str]:
    """What ``model`` serves as built: its ``serves``, less dense features when it has no feature maps (a
    plain model built without a pyramid); a model outside the contract serves classification."""
    serves = frozenset(getattr(model, "serves", {CLASSIFICATION}))
    return serves - {DENSE_FEATURES} if not getattr(model, "feature_strides", None) else serves


class GridHook:
    """Forward hook: the (H, W) of a module's output map (NCHW, or NHWC with ``channels_last``) becomes the
    grid of a :class:`TokenLayout`; an object, not a closure, so that ``copy.deepcopy`` (EMA) copies it."""

    def __init__(self, layout: TokenLayout, channels_last: bool = False) -> None:
        self.layout, self.channels_last = layout, channels_last

    def __call__(self, _module: nn.Module, _args: Any, output: torch.Tensor) -> None:
        h, w = output.shape[1:3] if self.channels_last else output.shape[-2:]
        self.layout.set_grid(h, w)


def vit_init(module: nn.Module) -> None:
    """ViT's initialisation (PVT's and T2T-ViT's code): Linear trunc-normal(0.02), zero bias; LN (1, 0)."""
    if isinstance(module, nn.Linear):
        trunc_normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)


class PlainBackbone(Backbone):
    """A one-grid model (ViT, T2T-ViT): ``features`` is ViTDet's simple pyramid (``pyramid_scales``)."""

    serves = frozenset({CLASSIFICATION, DENSE_FEATURES})  # dense features: built with ``pyramid_scales``
    dense_weights = ("pyramid.",)
    pyramid: nn.Module | None
    token_layout: TokenLayout
    num_prefix_tokens: int

    def features(self, x: torch.Tensor) -> list[torch.Tensor]:
        if self.pyramid is None:
            raise RuntimeError(f"build the {type(self).__name__} with pyramid_scales=(4, 2, 1, 0.5) to use "
                               "features()")
        tokens = self.forward_features(x)[:, self.num_prefix_tokens:]
        h, w = self.token_layout.grid
        return self.pyramid(tokens.transpose(1, 2).reshape(x.shape[0], -1, h, w))
