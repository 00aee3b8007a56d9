"""DINO's network (Caron et al. 2021, arXiv 2104.14294): a backbone and a projection head that takes the views
of an image at several resolutions -- facebookresearch/dino ``vision_transformer.DINOHead`` and
``utils.MultiCropWrapper``, written from their behaviour.

* :class:`DINOHead`: an MLP (``nlayers`` Linear layers, GELU, ``hidden_dim`` wide, no BatchNorm: DINO's
  ``use_bn_in_head=False``) to a ``bottleneck_dim`` vector, L2-normalised, then a weight-normalised linear
  layer without bias to ``out_dim`` logits whose norm ``g`` is fixed at 1 with ``norm_last_layer``. The MLP
  starts trunc-normal(0.02) with zero biases; the last layer as ``nn.Linear`` starts.
* :class:`MultiCropNetwork`: the views of one resolution go through the backbone together (the first
  consecutive ones of a size, then the next), their class-token features are concatenated in view order,
  and the head runs once on all of them.

Norm slots: the backbone's (the head has none); the placement walker reaches them through
:meth:`MultiCropNetwork.norm_context` as in any model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from timm.layers import trunc_normal_
from torch import nn
from torch.nn.utils.parametrizations import weight_norm

from .base import NormContext


class DINOHead(nn.Module):
    """DINO's projection head (see the module docstring)."""

    def __init__(self, in_dim: int, out_dim: int, hidden_dim: int = 2048, bottleneck_dim: int = 256,
                 nlayers: int = 3, norm_last_layer: bool = True) -> None:
        super().__init__()
        nlayers = max(nlayers, 1)
        dims = [in_dim, *[hidden_dim] * (nlayers - 1), bottleneck_dim]
        layers: list[nn.Module] = []
        for i, (a, b) in enumerate(zip(dims[:-1], dims[1:], strict=True)):
            layers.append(nn.Linear(a, b))
            if i < nlayers - 1:
                layers.append(nn.GELU())
        self.mlp = nn.Sequential(*layers)
        for layer in self.mlp:
            if isinstance(layer, nn.Linear):
                trunc_normal_(layer.weight, std=0.02)
                nn.init.zeros_(layer.bias)
        self.last_layer = weight_norm(nn.Linear(bottleneck_dim, out_dim, bias=False))
        magnitude = self.last_layer.parametrizations.weight.original0
        with torch.no_grad():
            magnitude.fill_(1)
        magnitude.requires_grad_(not norm_last_layer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last_layer(F.normalize(self.mlp(x), dim=-1, p=2))


class MultiCropNetwork(nn.Module):
    """A backbone (built without a classifier: its output is the class token's feature) and a head, over a
    list of views (see the module docstring)."""

    def __init__(self, backbone: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.backbone, self.head = backbone, head
        self.norm_keep = [f"backbone.{pattern}" for pattern in getattr(backbone, "norm_keep", ())]

    def features(self, views: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
        """The backbone's features of every view, in view order, one backbone pass per run of equal sizes."""
        views = views if isinstance(views, (list, tuple)) else [views]
        sizes = torch.tensor([tuple(v.shape[-2:]) for v in views])
        changes = [0, *[i for i in range(1, len(views)) if not torch.equal(sizes[i], sizes[i - 1])],
                   len(views)]
        return torch.cat([self.backbone(torch.cat(views[a:b])) for a, b in zip(changes[:-1], changes[1:],
                                                                                strict=True)])

    def forward(self, views: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
        return self.head(self.features(views))

    def norm_context(self, name: str) -> NormContext:
        if not name.startswith("backbone."):
            raise ValueError(f"{name} is no norm slot of the backbone (DINO's head has none)")
        return self.backbone.norm_context(name.removeprefix("backbone."))

    def no_weight_decay(self) -> set[str]:
        """None beyond the 1-D parameters and biases: DINO's optimizer decays the class token and the
        position embedding (``utils.get_params_groups``)."""
        return set()
