"""Point-wise normalizers: ``gamma * f(alpha * x + s) + beta`` with one function ``f`` from a family, scalar
``alpha`` and shift ``s`` (learnable; init 0.5 and 0) and ``gamma`` / ``beta`` per channel -- the functions
Derf's search compares (Chen et al., arXiv 2512.10938, Sec. 4 and Table 7; zlab-princeton/Derf
``ViT/other_functions/*.py``, ``DiT/other_functions/*.py``, whose ``--normtype`` names ``fn`` takes). No
statistics, like DyT.

``fn=erf`` is Derf (``norm=derf`` is this layer with ``fn`` fixed), ``fn=tanh`` is Table 7's tanh row: DyT
with Derf's shift (``norm=dyt`` is DyT as its paper has it, without one). ``learnable_shift=false`` fixes the
shift at ``shift0`` (0: Derf Sec. 7's ablation; else Table 1's horizontal shift), ``vector_shift`` makes it
one per channel (Table 15). The function-property options of Derf Sec. 3 and 7.2 (``output_shift``, ``clip``,
``blend``, ``flat``, ``negate``, ``prescale``) transform ``f`` as
:class:`normexp.norms.kernels.pointwise.PointOptions` says; the unbounded ``arcsinh``, ``logsign``,
``logquad``, ``power23``, ``linear`` (Tables 2, 4) and non-monotone ``sin``, ``dampx``, ``dampexp`` (Table
6, as Fig. 4 defines them) are functions of the family. ``fn=dyisru`` is DyISRU (Stollenwerk, arXiv
2503.21708), the element-wise counterpart of RMSNorm: ``gamma * sqrt(C) x / sqrt(b + x^2) + beta`` with one
learnable scalar ``b`` (the paper trains no model and gives no init: ours is ``beta0``, default C --
RMSNorm's denominator for unit-variance inputs -- so that the layer starts as the identity near 0); it has
no alpha, no shift and none of the options.

Three functions have an infinite slope at exactly 0 (``exproot``, ``power23``, ``power23_clip``): their
gradient there is NaN, in Derf's code and here.

``alpha_init=calibrate`` sets alpha from a pretrained LN model's statistics when its weights are converted
(``normexp.tasks.conversion``). ``kernels``: the fused path (:mod:`normexp.norms.kernels.pointwise`, whose
docstring lists the kinks), as DyT's; ``autograd`` is the definition below. DyISRU fuses as
``sqrt(C) * isru(x / sqrt(b))``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import nn

from .functional import channel_affine, check_data_format, output_dtype
from .kernels import KERNEL_MODES, check_kernels, resolve_kernels
from .kernels.pointwise import (
    ALPHA_INITS,
    PointOptions,
    channel_shape,
    check_alpha_init,
    pointwise,
    transformed,
)
from .registry import register_norm


def _sign_log1p_abs(u: torch.Tensor) -> torch.Tensor:
    return torch.sign(u) * torch.log(u.abs() + 1)


def _saturlog(u: torch.Tensor) -> torch.Tensor:
    log = torch.log(u.abs() + 1)
    return torch.sign(u) * log / (log + 1)


# f(u), u = alpha * x + s: each as zlab-princeton/Derf other_functions/<name>.py computes it
FUNCTIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "erf": torch.erf,
    "tanh": torch.tanh,
    "satursin": lambda u: torch.sin(torch.clip(u, -math.pi / 2, math.pi / 2)),
    "isru": lambda u: u / torch.sqrt(u * u + 1),
    "expsign": lambda u: torch.sign(u) * (1 - torch.exp(-u.abs())),
    "smoothsign": lambda u: u / (1 + u.abs()),
    "relsign": lambda u: u / (torch.sqrt(u * u + 1) + 1),
    "cubsign": lambda u: u ** 3 / (u.abs() ** 3 + 1),
    "exproot": lambda u: torch.sign(u) * (1 - torch.exp(-torch.sqrt(u.abs()))),
    "saturlog": _saturlog,
    "arctan": lambda u: torch.atan(u) * (2 / math.pi),
    "linear_clip": lambda u: torch.clip(u, -1, 1),
    "power23_clip": lambda u: torch.clip(torch.sign(u) * u.abs() ** (2 / 3), -1, 1),
    "logsign_clip": lambda u: torch.clip(_sign_log1p_abs(u), -1, 1),
    "smoothsign_clip": lambda u: torch.clip(u / (1 + u.abs()), -1, 1),
    "logquad_clip": lambda u: torch.clip(torch.sign(u) * torch.log(u * u + 1), -1, 1),
    "arcsinh_clip": lambda u: torch.clip(torch.asinh(u), -1, 1),  # Table 7's arcsinhclip row
    # Derf Sec. 3 (Fig. 3 and 4): unbounded, then non-monotone
    "arcsinh": torch.asinh,
    "logsign": _sign_log1p_abs,
    "logquad": lambda u: torch.sign(u) * torch.log(u * u + 1),
    "power23": lambda u: torch.sign(u) * u.abs() ** (2 / 3),
    "linear": lambda u: u,
    "sin": torch.sin,
    "dampx": lambda u: 2 * u / (1 + u * u),
    "dampexp": lambda u: 2.72 * u * torch.exp(-u.abs()),
}
FN_CHOICES = sorted([*FUNCTIONS, "dyisru"])


@register_norm("pointwise")
class PointWise(nn.Module):
    hparam_checks: ClassVar[dict[str, dict[str, Any]]] = {
        "fn": {"choices": FN_CHOICES}, "alpha0": {"above": 0}, "beta0": {"above": 0},
        "kernels": {"choices": list(KERNEL_MODES)}, "alpha_init": {"choices": list(ALPHA_INITS)},
        "clip": {"above": 0}, "blend": {"min": 0, "below": 1}, "flat": {"min": 0}, "prescale": {"above": 0}}
    output_affine = True  # gamma * f(alpha x + s) + beta: the affine folds (normexp.models.fold)

    def __init__(self, dim: int, fn: str = "erf", alpha0: float = 0.5, shift0: float = 0.0,
                 learnable_shift: bool = True, beta0: float | None = None,
                 data_format: str = "channels_last", kernels: str = "auto",
                 alpha_init: str = "alpha0", vector_shift: bool = False, output_shift: float = 0.0,
                 clip: float | None = None, blend: float = 0.0, flat: float = 0.0, negate: bool = False,
                 prescale: float = 1.0) -> None:
        super().__init__()
        if fn not in FN_CHOICES:
            raise ValueError(f"point-wise fn must be one of {FN_CHOICES}, got '{fn}'")
        self.dim, self.fn, self.alpha_init = dim, fn, check_alpha_init(alpha_init)
        self.data_format = check_data_format(data_format)
        self.kernels = check_kernels(kernels)
        self.options = PointOptions(float(prescale), float(flat), None if clip is None else float(clip),
                                    bool(negate), float(blend), float(output_shift))
        changed = list(self.options.changed())
        if fn == "dyisru" and (changed or vector_shift):
            raise ValueError(f"fn=dyisru takes none of the function options ({changed or ['vector_shift']}): "
                             "use another fn")
        if alpha_init == "calibrate" and changed:
            raise ValueError(f"alpha_init=calibrate reads f's slope at 0, which {changed} change: use "
                             "alpha_init=alpha0")
        if fn == "dyisru":
            self.beta = nn.Parameter(torch.full((1,), float(dim if beta0 is None else beta0)))
        else:
            self.alpha = nn.Parameter(torch.full((1,), float(alpha0)))
            shift = torch.full((dim if vector_shift else 1,), float(shift0))
            if learnable_shift:
                self.shift = nn.Parameter(shift)
            else:
                self.register_buffer("shift", shift)
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mode = resolve_kernels(self.kernels, x, (PointWise, self.fn, self.data_format), has_native=True)
        if mode == "autograd":  # the definition
            if self.fn == "dyisru":
                y = math.sqrt(self.dim) * x * torch.rsqrt(self.beta + x * x)
            else:
                shift = self.shift.view(channel_shape(x, self.data_format == "channels_first"))
                y, _ = transformed(FUNCTIONS[self.fn], self.options, self.alpha * x + shift)
            y = channel_affine(y, self.weight, self.bias, self.data_format)
        elif self.fn == "dyisru":  # sqrt(C) x / sqrt(b + x^2) = sqrt(C) isru(x / sqrt(b)): autograd does b's
            y = pointwise(x, torch.rsqrt(self.beta), None, math.sqrt(self.dim) * self.weight, self.bias,
                          "isru", self.data_format == "channels_first", mode)
        else:
            y = pointwise(x, self.alpha, self.shift, self.weight, self.bias, self.fn,
                          self.data_format == "channels_first", mode, self.options)
        return y.to(output_dtype(x))

    @property
    def point_function(self) -> str:
        """Its ``f`` by the name :data:`normexp.norms.kernels.pointwise.FUNCTIONS` gives it (DyISRU: isru)."""
        return "isru" if self.fn == "dyisru" else self.fn

    def extra_repr(self) -> str:
        if self.fn == "dyisru":
            scalars = f"beta={self.beta.item():.3g}"
        else:
            shift = f"{self.shift.item():.3g}" if self.shift.numel() == 1 else "per channel"
            scalars = f"alpha={self.alpha.item():.3g}, shift={shift}"
        changed = "".join(f", {k}={v}" for k, v in self.options.changed().items())
        return f"{self.dim}, fn={self.fn}, {scalars}{changed}, data_format={self.data_format}"
