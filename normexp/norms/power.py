"""PowerNorm (Shen et al., ICML 2020, "PowerNorm: Rethinking Batch Normalization in Transformers").

DTN compares against "PowerNorm with group scaling, warmup 3000 iterations" (dtn.md 1.2), but its released
module cannot run in training mode (dtn.md 4, defect 1). This one follows the paper's description:

* optional group scaling first (``scale_groups``, default 1 as in the PowerNorm code): each token is divided
  by the RMS of its channels within each group, ``x / sqrt(mean_group(x^2) + eps)``;
* no centring; each channel is divided by a running quadratic mean over batch and tokens,
  ``y = gamma * x / sqrt(psi^2 + eps) + beta``;
* training, first ``warmup_iters`` training forwards: the *current batch's* quadratic mean ``mean(x^2)``
  is used (exact gradient through it, like BatchNorm without centring), and ``psi^2`` is the cumulative
  average of the batch values seen so far (so it is an unbiased estimate when warm-up ends);
* training afterwards: ``x / sqrt(psi_{t-1}^2 + eps)`` with the running value *before* this batch, then
  ``psi_t^2 = (1 - momentum) psi_{t-1}^2 + momentum * mean(x^2)`` (momentum 0.1 = the paper's alpha 0.9);
* eval: the running value, no updates.

After warm-up the running statistic is a constant of the forward pass. With ``approx_backward=True``
(default) the gradient follows the paper's approximate backpropagation, which accounts for the running
statistic through a running estimate ``nu`` of ``mean(x_hat * dL/dx_hat)``:
``dL/dx = (g - nu_{t-1} * x_hat) / psi_{t-1}`` with ``g = dL/dx_hat``, then
``nu_t = nu_{t-1} (1 - momentum * mean(x_hat^2)) + momentum * mean(x_hat * g)`` (per channel, means over
batch and tokens; ``nu`` is a buffer updated during backward). This form is written from the paper's
Algorithm 1 as recalled, not from the reference notes (which do not give it); ``approx_backward=False``
treats the running statistic as a constant (gradient ``g / psi``).

``warmup_iters`` counts training-mode forward calls (``num_batches_tracked``), i.e. micro-batches when
gradients are accumulated.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .functional import channel_affine, check_data_format
from .registry import register_norm


class _RunningRMSScale(torch.autograd.Function):
    """x_hat = x * rstd with a constant per-channel rstd, and the paper's approximate backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, rstd: torch.Tensor, nu: torch.Tensor,
                momentum: float) -> torch.Tensor:
        x_hat = x * rstd
        ctx.save_for_backward(x_hat, rstd)
        ctx.nu, ctx.momentum = nu, momentum
        return x_hat

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:
        x_hat, rstd = ctx.saved_tensors
        nu, momentum = ctx.nu, ctx.momentum
        grad_x = (grad - nu * x_hat) * rstd
        with torch.no_grad():
            gamma_t = x_hat.square().mean(0)
            lambda_t = (x_hat * grad).mean(0)
            nu.mul_(1 - momentum * gamma_t).add_(momentum * lambda_t.to(nu.dtype))
        return grad_x, None, None, None


@register_norm("power")
class PowerNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5, momentum: float = 0.1, warmup_iters: int = 3000,
                 scale_groups: int | None = 1, approx_backward: bool = True, affine: bool = True,
                 data_format: str = "channels_last") -> None:
        super().__init__()
        if scale_groups and dim % scale_groups != 0:
            raise ValueError(f"PowerNorm: scale_groups={scale_groups} must divide dim={dim}")
        self.dim, self.eps, self.momentum, self.warmup_iters = dim, eps, momentum, warmup_iters
        self.scale_groups, self.approx_backward = scale_groups, approx_backward
        self.data_format = check_data_format(data_format)
        self.weight = nn.Parameter(torch.ones(dim)) if affine else None
        self.bias = nn.Parameter(torch.zeros(dim)) if affine else None
        self.register_buffer("running_phi", torch.ones(dim))  # psi^2
        self.register_buffer("running_nu", torch.zeros(dim))  # nu of the approximate backward
        self.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long))
        self._steps: int | None = None  # host copy of num_batches_tracked: no device sync per forward

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        super()._load_from_state_dict(*args, **kwargs)
        self._steps = None  # re-read the loaded counter on the next training forward

    def _normalize(self, x: torch.Tensor) -> torch.Tensor:
        """x: (M, C) rows = (sample, token) pairs."""
        if self.scale_groups:
            xg = x.view(x.shape[0], self.scale_groups, -1)
            x = (xg * torch.rsqrt(xg.square().mean(-1, keepdim=True) + self.eps)).view_as(x)
        if not self.training:
            return x * torch.rsqrt(self.running_phi + self.eps)
        if self._steps is None:
            self._steps = int(self.num_batches_tracked)
        self._steps += 1
        self.num_batches_tracked.add_(1)
        step = self._steps
        with torch.no_grad():
            batch_phi = x.detach().to(self.running_phi.dtype).square().mean(0)
        if step <= self.warmup_iters:
            phi = x.square().mean(0)  # current batch, gradient flows through it
            out = x * torch.rsqrt(phi + self.eps)
            with torch.no_grad():  # cumulative average over the warm-up batches
                self.running_phi.add_((batch_phi - self.running_phi) / step)
            return out
        rstd = torch.rsqrt(self.running_phi + self.eps).to(x.dtype)  # psi_{t-1}, before this batch
        if self.approx_backward and torch.is_grad_enabled() and x.requires_grad:
            out = _RunningRMSScale.apply(x, rstd, self.running_nu, self.momentum)
        else:
            out = x * rstd
        with torch.no_grad():
            self.running_phi.lerp_(batch_phi, self.momentum)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.data_format == "channels_first":
            xl = x.movedim(1, -1)
            y = self._normalize(xl.reshape(-1, self.dim)).view(xl.shape).movedim(-1, 1)
        else:
            y = self._normalize(x.reshape(-1, self.dim)).view(x.shape)
        return channel_affine(y, self.weight, self.bias, self.data_format)

    def extra_repr(self) -> str:
        return (f"{self.dim}, eps={self.eps}, momentum={self.momentum}, warmup_iters={self.warmup_iters}, "
                f"scale_groups={self.scale_groups}, approx_backward={self.approx_backward}, "
                f"data_format={self.data_format}")
