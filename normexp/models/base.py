"""The backbone contract: what every model family in ``normexp/models`` offers, written down once.

A family is one file: a subclass of its paper's (or timm's) model that also derives from :class:`Backbone`
(put last among the bases, so the family's own methods win over the defaults here), plus registered
constructors and one yaml per size in ``configs/backbone/``. The rest of the suite relies only on this:

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
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypedDict

import torch
from torch import nn

from ..norms.layout import TokenLayout


class NormContext(TypedDict, total=False):
    """The context a model hands a norm slot (see ``normexp.norms.registry`` for how it is used).

    ``block``: index of the transformer block (in forward order) the slot belongs to, None outside blocks;
    ``num_heads``: head count of that block -- or the head count the family defines for the slot;
    ``layout``: the :class:`TokenLayout` of the tokens the slot sees, None for maps (grid in the shape);
    ``num_prefix_tokens``: class / distillation tokens in front of the grid tokens the slot sees;
    ``pooled``: True when the slot normalises one pooled vector per image (a classifier's norm): no token
    statistics exist there, so normalizers that take statistics over tokens leave it as built.
    """

    block: int | None
    num_heads: int
    layout: TokenLayout | None
    num_prefix_tokens: int
    pooled: bool


class Backbone(nn.Module):
    """Base of every backbone family: the contract above, with its defaults."""

    feature_channels: list[int]
    feature_strides: list[int]
    norm_keep: Sequence[str] = ()
    fixed_input_size: tuple[int, int] | None = None

    def features(self, x: torch.Tensor) -> list[torch.Tensor]:
        """NCHW maps at ``feature_strides``, finest first."""
        raise NotImplementedError(f"{type(self).__name__} does not implement features()")

    def norm_context(self, name: str) -> NormContext:
        """The context of the norm slot ``name``."""
        raise NotImplementedError(f"{type(self).__name__} does not implement norm_context()")

    def no_weight_decay(self) -> set[str]:
        """Parameter names exempt from weight decay (1-D parameters and biases always are)."""
        return set()
