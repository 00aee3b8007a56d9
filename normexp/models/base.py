"""The backbone contract: what every model family in ``normexp/models`` offers, written down once.

A family is one file: a subclass of its paper's (or timm's) model that also derives from :class:`Backbone`
(put last among the bases, so the family's own methods win over the defaults here), plus registered
constructors and one yaml per size in ``configs/backbone/``. The rest of the suite relies only on this:

* ``serves``: what the family's models serve -- :data:`CLASSIFICATION` (logits), :data:`DENSE_FEATURES`
  (``features``, for dense tasks), :data:`DIFFUSION` (DiT's denoising); tasks ask it (:func:`served`).
  ``dense_weights``: prefixes of the weights only a dense build has (a classifier's checkpoint lacks them).
* ``features(x) -> list[Tensor]``: NCHW maps, finest first, for dense tasks (detection's FPN).
  ``feature_channels[i]`` and ``feature_strides[i]`` (input pixels per map pixel) describe map i.
  Plain models (one token grid) build ViTDet's simple pyramid when created with ``pyramid_scales``; without
  it their lists are empty and ``features`` raises.
* ``norm_context(name) -> NormContext``: what the norm slot ``name`` (a module the placement may swap, see
  ``normexp.norms.placement``) needs to know and only the model knows -- its block index, its block's head
  count, the token layout of its stage (whose grid the stage's patch embedding updates on every forward),
  the prefix tokens in front of the grid, and whether it normalises a pooled vector.
* ``norm_keep``: fnmatch patterns of slots that keep the layer the model was built with under every
  normalizer (the DTN code's late LayerNorm blocks, LeViT's classifier BatchNorm).
* ``no_weight_decay() -> set[str]``: parameter names the optimizer exempts from weight decay (beside the
  1-D parameters and biases, which timm's optimizer factory always exempts).
* ``fixed_input_size``: ``(H, W)`` when the model only accepts that input size (dense tasks resize every
  image to it), else None.
* ``residual_scales``: fnmatch patterns (relative to the model) of the modules whose output is a residual
  branch's up to a per-channel or scalar factor -- each block's attention and MLP: where a
  normalization-free rule scales the branches (``norm=skipinit``'s gates); ``branches_start_closed``: True
  when the model's own gates start those branches at zero (DiT's adaLN-Zero), which such a rule refuses.
"""

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
    """The context a model hands a norm slot (see ``normexp.norms.registry`` for how it is used).

    ``block``: index of the transformer block (in forward order) the slot belongs to, None outside blocks;
    ``num_heads``: head count of that block -- or the head count the family defines for the slot;
    ``layout``: the :class:`TokenLayout` of the tokens the slot sees, None for maps (grid in the shape); a
    :class:`FoldedHeads` for a per-head slot (an attention's q / k / v norm: each head's tokens, the heads
    folded into the batch, with ``num_heads`` 1);
    ``num_prefix_tokens``: class / distillation tokens in front of the grid tokens the slot sees;
    ``pooled``: True when the slot normalises one pooled vector per image (a classifier's norm): no token
    statistics exist there, so normalizers that take statistics over tokens leave it as built.
    """

    block: int | None
    num_heads: int
    layout: TokenLayout | FoldedHeads | None
    num_prefix_tokens: int
    pooled: bool


class Backbone(nn.Module):
    """Base of every backbone family: the contract above, with its defaults."""

    serves: frozenset[str] = frozenset({CLASSIFICATION})
    dense_weights: Sequence[str] = ()
    feature_channels: list[int]
    feature_strides: list[int]
    norm_keep: Sequence[str] = ()
    fixed_input_size: tuple[int, int] | None = None
    residual_scales: Sequence[str] = ()
    branches_start_closed: bool = False

    def features(self, x: torch.Tensor) -> list[torch.Tensor]:
        """NCHW maps at ``feature_strides``, finest first."""
        raise NotImplementedError(f"{type(self).__name__} does not implement features()")

    def norm_context(self, name: str) -> NormContext:
        """The context of the norm slot ``name``."""
        raise NotImplementedError(f"{type(self).__name__} does not implement norm_context()")

    def no_weight_decay(self) -> set[str]:
        """Parameter names exempt from weight decay (1-D parameters and biases always are)."""
        return set()


def served(model: nn.Module) -> frozenset[str]:
    """What ``model`` serves as built: its ``serves``, less dense features when it has no feature maps (a
    plain model built without a pyramid); a model outside the contract serves classification."""
    serves = frozenset(getattr(model, "serves", {CLASSIFICATION}))
    return serves - {DENSE_FEATURES} if not getattr(model, "feature_strides", None) else serves


class GridHook:
    """Forward hook: the (H, W) of a module's output map becomes the grid of a :class:`TokenLayout` -- how a
    stage tells its norm slots the grid its tokens lie on. Maps are (B, C, H, W), or (B, H, W, C) with
    ``channels_last`` (Swin's stages).

    A plain object rather than a closure so that ``copy.deepcopy(model)`` (EMA) copies it together with the
    layout it writes, which the copied norm layers share.
    """

    def __init__(self, layout: TokenLayout, channels_last: bool = False) -> None:
        self.layout, self.channels_last = layout, channels_last

    def __call__(self, _module: nn.Module, _args: Any, output: torch.Tensor) -> None:
        h, w = output.shape[1:3] if self.channels_last else output.shape[-2:]
        self.layout.set_grid(h, w)


def vit_init(module: nn.Module) -> None:
    """ViT's initialisation, applied by PVT's and T2T-ViT's code after construction (``model.apply``): Linear
    trunc-normal(std 0.02) with zero bias, LayerNorm weight 1 and bias 0."""
    if isinstance(module, nn.Linear):
        trunc_normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)


class PlainBackbone(Backbone):
    """A plain model (one token grid: ViT, T2T-ViT): ``features`` is ViTDet's simple pyramid over the last
    block's grid tokens, built when the model is created with ``pyramid_scales`` (``self.pyramid``)."""

    serves = frozenset({CLASSIFICATION, DENSE_FEATURES})  # dense features: built with ``pyramid_scales``
    dense_weights = ("pyramid.",)
    pyramid: nn.Module | None
    token_layout: TokenLayout
    num_prefix_tokens: int

    def features(self, x: torch.Tensor) -> list[torch.Tensor]:
        """NCHW maps of the simple pyramid from the last block's grid tokens."""
        if self.pyramid is None:
            raise RuntimeError(f"build the {type(self).__name__} with pyramid_scales=(4, 2, 1, 0.5) to use "
                               "features()")
        tokens = self.forward_features(x)[:, self.num_prefix_tokens:]
        h, w = self.token_layout.grid
        return self.pyramid(tokens.transpose(1, 2).reshape(x.shape[0], -1, h, w))
