"""sigma-Reparam (Zhai et al. 2023, arXiv 2303.06296, Sec. 3), the weight-normalization-based baseline of
DyT Table 9 (arXiv 2503.10622 Sec. 6.3): every norm slot the identity, every Linear and Conv weight used as
``gamma / sigma(W) * W``, as apple/ml-sigma-reparam ``vision/layers.py`` ``convert_to_sn`` does it: every
Linear and Conv2d, the classifier included (``convert_classifier``), re-initialised as a new ``SNLinear``
(``reinit``), SVD at conversion, one power-iteration step per forward (kept in training), in the dtype
autocast gives (``float32_sigma``: in float32); ``plain`` names layers to leave (fnmatch).
"""

from __future__ import annotations

import contextlib
import fnmatch
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

from .normfree import NoNorm, classifier_layers
from .registry import register_norm

CONVERTED = (nn.Linear, nn.Conv2d)


class SpectralReparam(nn.Module):
    """The parametrization ``W -> gamma / sigma(W) * W`` of one weight."""

    def __init__(self, weight: torch.Tensor, float32: bool = False) -> None:
        super().__init__()
        self.float32 = float32
        u, sigma = self.decompose(weight)
        self.register_buffer("u", u)
        self.register_buffer("sigma", sigma.reshape(1).clone())  # the latest estimate, for logging
        self.gamma = nn.Parameter(sigma.reshape(1).clone())

    @staticmethod
    def decompose(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(top right-singular vector, spectral norm) of ``weight`` by SVD."""
        matrix = weight.detach().flatten(1).float()
        if matrix.is_meta:  # a dry build: no values to decompose
            return torch.empty(matrix.shape[1], device="meta"), torch.empty((), device="meta")
        _, singular, vh = torch.linalg.svd(matrix, full_matrices=False)
        if singular[0] == 0:
            raise ValueError("a weight is all zeros at conversion (spectral norm 0): norm.reinit=true "
                             "re-initialises every converted layer, as apple/ml-sigma-reparam does")
        return vh[0], singular[0]

    @torch.no_grad()
    def restart(self, weight: torch.Tensor) -> None:
        """Start again from a re-initialised ``weight``, as a new layer would (a fine-tuning's fresh head)."""
        u, sigma = self.decompose(weight)
        self.u.copy_(u)
        self.sigma.fill_(sigma)
        self.gamma.fill_(sigma)

    def spectral_norm(self, weight: torch.Tensor) -> torch.Tensor:
        """sigma(W) from one power-iteration step from ``u`` (kept in training), differentiable in W."""
        precision = torch.autocast("cuda" if weight.is_cuda else "cpu", enabled=False) if self.float32 \
            else contextlib.nullcontext()  # else in the dtype the surrounding autocast gives
        with precision:
            matrix = weight.flatten(1).float() if self.float32 else weight.flatten(1)
            with torch.no_grad():
                v = F.normalize(matrix.mv(self.u.to(matrix.dtype)), dim=0)
                u = F.normalize(matrix.t().mv(v), dim=0)
                if self.training:
                    self.u.copy_(u)
            sigma = torch.einsum("c,cd,d->", v, matrix, u)
            if self.training:
                self.sigma.copy_(sigma.detach())
        return sigma

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight * (self.gamma / self.spectral_norm(weight)).to(weight.dtype)


def reinitialise(layer: nn.Module, gain: float) -> None:
    """A new ``SNLinear`` / ``SNConv2d``'s parameters: weight trunc-normal(0.02 x gain), bias torch's."""
    nn.init.trunc_normal_(layer.weight, std=0.02 * gain)
    if layer.bias is not None:
        fan_in = layer.weight[0].numel()
        nn.init.uniform_(layer.bias, -1 / math.sqrt(fan_in), 1 / math.sqrt(fan_in))


@register_norm("sigma_reparam")
class SigmaReparam(NoNorm):
    """The identity in a norm slot; :meth:`adapt_model` reparametrizes every Linear and Conv2d weight."""

    hparam_checks = {"linear_init_gain": {"above": 0}, "conv_init_gain": {"above": 0}}

    def __init__(self, dim: int, reinit: bool = True, linear_init_gain: float = 1.0,
                 conv_init_gain: float = 1.0, convert_classifier: bool = True, plain: tuple[str, ...] = (),
                 float32_sigma: bool = False, data_format: str = "channels_last") -> None:
        super().__init__(dim, data_format)

    @staticmethod
    def adapt_model(model: nn.Module, reinit: bool = True, linear_init_gain: float = 1.0,
                    conv_init_gain: float = 1.0, convert_classifier: bool = True,
                    plain: tuple[str, ...] = (), float32_sigma: bool = False) -> None:
        kept = [] if convert_classifier else classifier_layers(model)
        layers = [(n, m) for n, m in model.named_modules() if isinstance(m, CONVERTED)
                  and not any(m is k for k in kept) and not any(fnmatch.fnmatchcase(n, p) for p in plain)]
        for name, layer in layers:
            if reinit:
                reinitialise(layer, linear_init_gain if isinstance(layer, nn.Linear) else conv_init_gain)
            try:
                parametrize.register_parametrization(layer, "weight",
                                                     SpectralReparam(layer.weight, float32_sigma))
            except ValueError as e:
                raise ValueError(f"norm=sigma_reparam, layer {name}: {e}") from None
