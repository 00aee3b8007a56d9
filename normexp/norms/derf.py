"""Dynamic erf (Derf; Chen et al., arXiv 2512.10938, Eq. 10; zlab-princeton/Derf ``dynamic_erf.py``):
``gamma * erf(alpha * x + s) + beta``, ``alpha`` and the shift ``s`` learnable scalars (init 0.5 and 0),
``gamma``/``beta`` per channel: the point-wise layer with ``fn=erf`` (:mod:`normexp.norms.pointwise`).
"""

from __future__ import annotations

from typing import Any, ClassVar

from .kernels import KERNEL_MODES
from .kernels.pointwise import ALPHA_INITS
from .pointwise import PointWise
from .registry import register_norm


@register_norm("derf")
class Derf(PointWise):
    hparam_checks: ClassVar[dict[str, dict[str, Any]]] = {
        "alpha0": {"above": 0}, "kernels": {"choices": list(KERNEL_MODES)},
        "alpha_init": {"choices": list(ALPHA_INITS)}}

    def __init__(self, dim: int, alpha0: float = 0.5, shift0: float = 0.0,
                 data_format: str = "channels_last", kernels: str = "auto",
                 alpha_init: str = "alpha0") -> None:
        super().__init__(dim, "erf", alpha0, shift0, data_format=data_format, kernels=kernels,
                         alpha_init=alpha_init)
