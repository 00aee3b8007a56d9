"""A pretrained model's LayerNorms converted to other normalizers (``task.pretrained`` with another ``norm``):
how well each new layer reproduces its LayerNorm, and alpha set from the LN inputs' statistics.

Each LayerNorm's weight and bias become the new layer's affine (``normexp.tasks.pretrained``). On a few
training batches (``task.calibration_batches``) through the LN model, every converted layer is run on its
LayerNorm's own input and compared with that LayerNorm's output: R^2 = 1 - SS_res / SS_tot over all elements
(Carrigg et al., arXiv 2605.14047, report it per layer). ``norm.alpha_init=calibrate`` first sets each layer's
alpha to 1 / (f'(0) std), std the standard deviation of the LayerNorm's input over all its elements: DyT's
Sec. 6.2 (arXiv 2503.10622, Fig. 8) finds alpha tracking 1/std, and with the slope f'(0) (1 for tanh,
2/sqrt(pi) for erf) the layer then scales an input of that std as LayerNorm scales a zero-mean token.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..errors import UserError
from ..norms.kernels.pointwise import FUNCTIONS

# f'(0) is read at this u (the one-sided limit where the slope of sign(u) is 0 at exactly 0); functions
# whose slope there is outside SLOPE_RANGE (0 or infinite at 0) have no alpha this rule can set
_NEAR_ZERO = 1e-6
SLOPE_RANGE = (1e-3, 1e3)


def converted_layers(source: nn.Module, model: nn.Module) -> list[tuple[str, nn.Module, nn.Module]]:
    """(name, the source's LayerNorm, the layer that replaced it in ``model``) for every LayerNorm of
    ``source`` that ``model`` holds another layer in place of."""
    targets = dict(model.named_modules())
    return [(name, norm, targets[name]) for name, norm in source.named_modules()
            if isinstance(norm, nn.LayerNorm) and name in targets and type(targets[name]) is not type(norm)]


@functools.cache
def slope_at_zero(function: str) -> float:
    with torch.device("cpu"):  # also inside a model build on the meta device
        u = torch.tensor([_NEAR_ZERO], dtype=torch.float64)
        f = FUNCTIONS[function]
        return float(torch.as_tensor(f.slope(u, f.value(u))).reshape(-1)[0])


def check_calibration(model: nn.Module) -> None:
    """Refuse, before any work, ``alpha_init=calibrate`` on a layer the rule cannot set: one without alpha
    (DyISRU) or whose function has no finite, nonzero slope at 0."""
    for name, layer in model.named_modules():
        if getattr(layer, "alpha_init", None) != "calibrate":
            continue
        function = getattr(layer, "point_function", None)
        if not isinstance(getattr(layer, "alpha", None), torch.Tensor) or function is None or \
                getattr(layer, "fn", None) == "dyisru":
            raise UserError(f"norm.alpha_init=calibrate: {name} ({type(layer).__name__}) has no alpha to "
                            "set; use norm.alpha_init=alpha0")
        slope = slope_at_zero(function)
        if not SLOPE_RANGE[0] < abs(slope) < SLOPE_RANGE[1]:
            what = "slope 0" if abs(slope) <= SLOPE_RANGE[0] else "an infinite slope"
            raise UserError(f"norm.alpha_init=calibrate sets alpha = 1 / (f'(0) std), and {function} has "
                            f"{what} at 0: use norm.alpha_init=alpha0 (and norm.alpha0) for it")


def _summed(values: torch.Tensor) -> torch.Tensor:
    """Sums over every process (a calibration must set the same alpha in each)."""
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(values)
    return values


def _through(source: nn.Module, layers: list[nn.Module], images: Iterable[torch.Tensor],
             each: Callable[[int, torch.Tensor, torch.Tensor], None]) -> None:
    """Run ``images`` through ``source`` calling ``each(i, input, output)`` at its i-th LayerNorm."""
    hooks = [layer.register_forward_hook(lambda _, args, out, i=i: each(i, args[0], out))
             for i, layer in enumerate(layers)]
    try:
        for batch in images:
            source(batch)
    finally:
        for hook in hooks:
            hook.remove()


@torch.no_grad()
def calibrate_and_compare(source: nn.Module, model: nn.Module, images: list[torch.Tensor]) -> dict[str, Any]:
    """Set the alpha of ``model``'s layers with ``alpha_init=calibrate`` from ``source``'s LayerNorm
    inputs on ``images``, then measure each converted layer's R^2 against its LayerNorm; returns the record's
    ``{"layers": [{layer, input_std, alpha, r2}], "r2": mean over layers}``."""
    pairs = converted_layers(source, model)
    if not pairs:
        return {"layers": [], "r2": None}
    norms = [norm for _, norm, _ in pairs]
    source.eval()
    model.eval()
    device = images[0].device
    moments = torch.zeros(len(pairs), 3, dtype=torch.float64, device=device)  # count, sum, sum of squares

    def measure(i: int, x: torch.Tensor, _: torch.Tensor) -> None:
        x = x.double()
        moments[i] += torch.stack([torch.tensor(x.numel(), dtype=torch.float64, device=device), x.sum(),
                                   (x * x).sum()])

    _through(source, norms, images, measure)
    count, total, squares = _summed(moments).unbind(1)
    stds = (squares / count - (total / count) ** 2).clamp_min(0).sqrt().tolist()
    for (_, _, layer), std in zip(pairs, stds, strict=True):
        if getattr(layer, "alpha_init", None) == "calibrate":
            layer.alpha.fill_(1.0 / (slope_at_zero(layer.point_function) * max(std, 1e-12)))

    fit = torch.zeros(len(pairs), 4, dtype=torch.float64, device=device)  # SS_res, count, sum y, sum y^2

    def compare(i: int, x: torch.Tensor, y: torch.Tensor) -> None:
        y, y_new = y.double(), pairs[i][2](x).double()
        count = torch.tensor(y.numel(), dtype=torch.float64, device=device)
        fit[i] += torch.stack([((y_new - y) ** 2).sum(), count, y.sum(), (y * y).sum()])

    _through(source, norms, images, compare)
    residual, count, total, squares = _summed(fit).unbind(1)
    r2 = (1 - residual / (squares - total * total / count)).tolist()
    layers = [{"layer": name, "input_std": std, "r2": value,
               **({"alpha": float(layer.alpha.reshape(-1)[0])} if hasattr(layer, "alpha") else {})}
              for (name, _, layer), std, value in zip(pairs, stds, r2, strict=True)]
    finite = [value for value in r2 if math.isfinite(value)]
    return {"layers": layers, "r2": sum(finite) / len(finite) if finite else None}
