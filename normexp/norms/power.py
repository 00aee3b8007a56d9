"""PowerNorm (Shen et al., ICML 2020, arXiv 2003.07845) as the DTN code configures it for its Table 2
baseline: ``PowerNorm(dim, group_num=num_heads, warmup_iters=3000)`` (wqshao126/DTN
``models/normkit/norm_select.py``).

The DTN module (``models/normkit/norms/us_powernorm.py``) cannot run as released (its forward calls an
undefined ``PowerFunction``); this is that module running the Function the file does define,
``PowerFunction_PN``: group scaling by the RMS of each head's channels, then per channel
``y = gamma * x / sqrt(phi + eps) + beta`` with the batch's ``mean(x^2)`` during warm-up and the running
``phi`` (EMA 0.9) after, and the approximate backward with ``nu``. The PowerNorm authors' code
(sIncerass/powernorm ``fairseq/modules/norms/mask_powernorm.py``) divides the backward by the batch value
throughout; the DTN file's running value after warm-up is what runs here.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from .functional import channel_affine, check_data_format
from .registry import register_norm

ALPHA_FWD = 0.9  # EMA factor of the running phi (official alpha_fwd)
ALPHA_BKW = 0.9  # the backward subtracts (1 - alpha_bkw) * nu * z (official alpha_bkw)


class _PowerFunction(torch.autograd.Function):
    """``z = x / sqrt(phi_used + eps)`` on (M, C) rows with the official approximate backward; ``bwd_phi`` is
    what the backward divides by, ``nu`` (the official ``ema_gz``) is updated in place during backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, fwd_phi: torch.Tensor, bwd_phi: torch.Tensor, nu: torch.Tensor,
                eps: float) -> torch.Tensor:
        z = x * torch.rsqrt(fwd_phi + eps)
        ctx.save_for_backward(z, bwd_phi)
        ctx.nu, ctx.eps = nu, eps
        return z

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        z, bwd_phi = ctx.saved_tensors
        nu = ctx.nu
        approx = grad - (1 - ALPHA_BKW) * nu.to(grad.dtype) * z
        with torch.no_grad():
            nu.add_((approx * z).mean(0).to(nu.dtype))
        return approx * torch.rsqrt(bwd_phi + ctx.eps), None, None, None, None


@register_norm("power")
class PowerNorm(nn.Module):
    hparam_checks: ClassVar[dict[str, dict[str, Any]]] = {"warmup_iters": {"min": 0}, "groups": {"min": 1}}

    def __init__(self, dim: int, eps: float = 1e-5, warmup_iters: int = 3000, groups: int | None = None,
                 num_heads: int | None = None, data_format: str = "channels_last") -> None:
        super().__init__()
        num_groups = groups if groups is not None else (num_heads or 1)
        if dim % num_groups != 0:
            raise ValueError(f"PowerNorm: {num_groups} scaling groups must divide dim={dim}")
        self.dim, self.eps, self.warmup_iters, self.groups = dim, eps, warmup_iters, num_groups
        self.data_format = check_data_format(data_format)
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))
        self.register_buffer("running_phi", torch.ones(dim))
        self.register_buffer("running_nu", torch.zeros(dim))  # the official ema_gz
        self.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long))
        self._steps: int | None = None  # host copy of num_batches_tracked: no device sync per forward

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        super()._load_from_state_dict(*args, **kwargs)
        self._steps = None  # re-read the loaded counter on the next training forward

    def _group_scale(self, x: torch.Tensor) -> torch.Tensor:
        """x: (M, C); each row divided by the RMS of its channels within each group."""
        xg = x.view(x.shape[0], self.groups, -1)
        return (xg * torch.rsqrt(xg.square().mean(-1, keepdim=True) + self.eps)).view_as(x)

    def _normalize(self, x: torch.Tensor) -> torch.Tensor:
        x = self._group_scale(x)
        if not self.training:
            return x * torch.rsqrt(self.running_phi + self.eps).to(x.dtype)
        if self._steps is None:
            self._steps = int(self.num_batches_tracked)
        self._steps += 1
        self.num_batches_tracked.add_(1)
        step = self._steps
        with torch.no_grad():
            batch_phi = x.detach().to(self.running_phi.dtype).square().mean(0)
            running_before = self.running_phi.clone()
            if step < self.warmup_iters:  # cumulative average of the batch values so far ...
                self.running_phi.mul_((step - 1) / step).add_(batch_phi / step)
            self.running_phi.mul_(ALPHA_FWD).add_((1 - ALPHA_FWD) * batch_phi)  # ... then the EMA, always
        fwd_phi = batch_phi if step <= self.warmup_iters else running_before
        bwd_phi = batch_phi if step < self.warmup_iters else self.running_phi.clone()
        return _PowerFunction.apply(x, fwd_phi.to(x.dtype), bwd_phi.to(x.dtype), self.running_nu, self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.data_format == "channels_first":
            xl = x.movedim(1, -1)
            y = self._normalize(xl.reshape(-1, self.dim)).view(xl.shape).movedim(-1, 1)
        else:
            y = self._normalize(x.reshape(-1, self.dim)).view(x.shape)
        return channel_affine(y, self.weight, self.bias, self.data_format)

    def extra_repr(self) -> str:
        return (f"{self.dim}, eps={self.eps}, warmup_iters={self.warmup_iters}, groups={self.groups}, "
                f"data_format={self.data_format}")
