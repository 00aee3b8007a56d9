"""Per-slot statistics of each norm slot's input: kurtosis and max |x| (arXiv 2511.23225) and, for point-wise
layers, the saturated fraction (arXiv 2604.23434: DyT's share of ``|alpha x| > 2``), read from the layer: its
slope at each input (autograd) below ``tanh'(2) / tanh'(0)`` times its slope at the function's centre (the
affine cancels). The centre is ``alpha x + s = 0``, or the edge of a flat zone (Derf Table 5), whose inputs
then count as flat. ``normexp analyze`` reports them per slot; the ``activations`` probe
(``task.probes=[alpha,activations]``) logs their summary each epoch and into the final metrics, for tables."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..norms.kernels.pointwise import channel_shape
from ..norms.placement import norm_slot_names
from .alpha_probe import probe_batch

SATURATED_SLOPE = 1 - math.tanh(2.0) ** 2  # tanh's slope at 2 relative to its slope at 0


def is_pointwise(module: nn.Module) -> bool:
    """An element-wise layer ``gamma f(alpha x ...) + beta`` (it names its ``f``)."""
    return getattr(module, "point_function", None) is not None


@dataclass
class SlotMoments:
    """Sums over a slot's input elements (float64): count, powers 1-4, max |x|, saturated count."""

    count: int = 0
    powers: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)
    max_abs: float = 0.0
    saturated: int | None = None  # None: not a point-wise layer

    def row(self) -> dict[str, Any]:
        n = self.count
        mean = self.powers[0] / n
        raw = [p / n for p in self.powers]  # E[x^k]
        variance = raw[1] - mean ** 2
        fourth = raw[3] - 4 * mean * raw[2] + 6 * mean ** 2 * raw[1] - 3 * mean ** 4  # E[(x - mean)^4]
        return {"elements": n, "mean": mean, "std": math.sqrt(max(variance, 0.0)),
                "kurtosis": fourth / variance ** 2 if variance > 0 else math.nan, "max_abs": self.max_abs,
                "saturated_fraction": self.saturated / n if self.saturated is not None else None}


class ActivationRecorder:
    """Forward-hook callback: :class:`SlotMoments` of each hooked slot's input over every batch."""

    def __init__(self) -> None:
        self.moments: dict[str, SlotMoments] = {}
        self.kinds: dict[str, str] = {}

    def __call__(self, name: str, module: nn.Module, x: torch.Tensor, _y: torch.Tensor) -> None:
        values = x.detach().double()
        found = self.moments.setdefault(name, SlotMoments())
        self.kinds[name] = type(module).__name__
        found.count += values.numel()
        found.powers = tuple(s + float((values ** (k + 1)).sum()) for k, s in enumerate(found.powers))
        found.max_abs = max(found.max_abs, float(values.abs().max()))
        if is_pointwise(module):
            centre = slopes(module, centre_inputs(module, x)).abs()
            flat = slopes(module, x).abs() < SATURATED_SLOPE * centre
            found.saturated = (found.saturated or 0) + int(flat.sum())

    def rows(self) -> list[dict[str, Any]]:
        return [{"slot": name, "layer": self.kinds[name], **m.row()} for name, m in self.moments.items()]


def centre_inputs(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Inputs shaped as ``x`` where ``gamma f(alpha x + s) + beta`` has its centre slope: ``alpha x + s = 0``,
    or just past a flat zone's edge (``prescale (alpha x + s) = flat``)."""
    alpha = getattr(module, "alpha", None)
    if alpha is None:  # DyISRU: x alone
        return torch.zeros_like(x)
    options = getattr(module, "options", None)
    edge = options.flat / options.prescale * (1 + 1e-6) if options is not None and options.flat else 0.0
    shift = getattr(module, "shift", None)
    if shift is None:
        shift = torch.zeros(())
    elif shift.numel() > 1:
        shift = shift.view(channel_shape(x, getattr(module, "data_format", "") == "channels_first"))
    return ((edge - shift.detach()) / alpha.detach()).to(x.dtype).expand_as(x).clone()


def slopes(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """d output / d input of an element-wise layer at each element of ``x`` (its Jacobian's diagonal)."""
    with torch.enable_grad():
        inputs = x.detach().float().requires_grad_(True)
        # forward, not __call__: inside a forward hook, that would run the hook again
        (slope,) = torch.autograd.grad(module.forward(inputs).float().sum(), inputs)
    return slope


ACTIVATIONS_KEY = "activations/"


@torch.no_grad()
def activation_probe(model: nn.Module, loader: Any, forward: Callable[[torch.Tensor], Any] | None = None
                     ) -> dict[str, float]:
    """Over every norm slot, on the probe batch: ``activations/kurtosis`` (the slots' mean),
    ``activations/max_abs`` (their largest) and, with point-wise slots, ``activations/saturated_fraction``
    (the share of all their input elements that saturate)."""
    slots = norm_slot_names(model)
    batch = probe_batch(loader.dataset)
    if not slots or batch is None:
        return {}
    recorder = ActivationRecorder()
    handles = [model.get_submodule(name).register_forward_hook(
        lambda module, args, out, _name=name: recorder(_name, module, args[0], out)) for name in slots]
    was_training = model.training
    try:
        model.eval()
        (forward or model)(batch.to(next(model.parameters()).device))
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
    rows = recorder.rows()
    kurtosis = [r["kurtosis"] for r in rows if math.isfinite(r["kurtosis"])]
    row = {ACTIVATIONS_KEY + "max_abs": max(r["max_abs"] for r in rows)}
    if kurtosis:
        row[ACTIVATIONS_KEY + "kurtosis"] = sum(kurtosis) / len(kurtosis)
    pointwise = [r for r in rows if r["saturated_fraction"] is not None]
    if pointwise:
        elements = sum(r["elements"] for r in pointwise)
        row[ACTIVATIONS_KEY + "saturated_fraction"] = sum(r["saturated_fraction"] * r["elements"]
                                                          for r in pointwise) / elements
    return row
