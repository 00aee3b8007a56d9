"""Switchable Normalization (Luo et al., ICLR 2019, arXiv 1806.10779): the "SN" column of DTN's Table 2.
A softmax-weighted mix of IN, LN and BN statistics, one for the mean and one for the variance (paper Eq. 3;
switchablenorms/Switchable-Normalization ``devkit/ops/switchable_norm.py``, logits initialised to 1). For
tokens LN is per token (the layer SN replaces in DTN's Table 2); all variances are the population's, so a
one-hot choice gives exactly IN, LN or BN.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from .functional import channel_affine, check_data_format
from .registry import register_norm

KINDS = ("in", "ln", "bn")


@register_norm("sn")
class SwitchableNorm(nn.Module):
    token_statistics = True  # its IN statistics are over the tokens of a sample

    hparam_checks: ClassVar[dict[str, dict[str, Any]]] = {"momentum": {"min": 0, "max": 1}}

    def __init__(self, dim: int, eps: float = 1e-5, momentum: float = 0.1,
                 data_format: str = "channels_last") -> None:
        super().__init__()
        self.dim, self.eps, self.momentum = dim, eps, momentum
        self.data_format = check_data_format(data_format)
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))
        self.mean_weight = nn.Parameter(torch.ones(len(KINDS)))  # softmax -> importance of (IN, LN, BN)
        self.var_weight = nn.Parameter(torch.ones(len(KINDS)))
        self.register_buffer("running_mean", torch.zeros(dim))
        self.register_buffer("running_var", torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() < 3:
            raise ValueError(f"SwitchableNorm needs a token / spatial dim, got shape {tuple(x.shape)}")
        channels_first = self.data_format == "channels_first"
        xt = x.flatten(2).transpose(1, 2) if channels_first else x.reshape(x.shape[0], -1, x.shape[-1])
        y = self._normalize(xt)  # (B, T, C)
        y = y.transpose(1, 2).reshape(x.shape) if channels_first else y.reshape(x.shape)
        return channel_affine(y, self.weight, self.bias, self.data_format)

    def _normalize(self, x: torch.Tensor) -> torch.Tensor:
        var_in, mean_in = torch.var_mean(x, dim=1, keepdim=True, correction=0)  # (B, 1, C)
        var_ln, mean_ln = torch.var_mean(x, dim=2, keepdim=True, correction=0)  # (B, T, 1)
        if self.training:
            var_bn, mean_bn = torch.var_mean(x, dim=(0, 1), correction=0)  # (C,)
            with torch.no_grad():
                count = x.shape[0] * x.shape[1]
                unbiased = var_bn * count / max(count - 1, 1)
                self.running_mean.lerp_(mean_bn.to(self.running_mean.dtype), self.momentum)
                self.running_var.lerp_(unbiased.to(self.running_var.dtype), self.momentum)
        else:
            mean_bn, var_bn = self.running_mean.to(x.dtype), self.running_var.to(x.dtype)
        wm, wv = self.mean_weight.softmax(0), self.var_weight.softmax(0)
        mean = wm[0] * mean_in + wm[1] * mean_ln + wm[2] * mean_bn
        var = wv[0] * var_in + wv[1] * var_ln + wv[2] * var_bn
        return (x - mean) * torch.rsqrt(var + self.eps)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}, momentum={self.momentum}, data_format={self.data_format}"
