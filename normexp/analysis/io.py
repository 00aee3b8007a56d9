"""Input-output maps of norm slots (DyT, Zhu et al., CVPR 2025, arXiv 2503.10622, Sec. 3, Figs. 2 and 4):
a seeded sample of each slot's (input, output) elements with the output before its affine (Fig. 2), plus
highlighted tokens and channels (Fig. 4), and :func:`fit_tanh`, a least-squares ``a tanh(b x) + c`` fit."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from ..tracking.provenance import stream_seed
from .slots import (
    affine_params,
    channel_dim,
    grid_tokens,
    slot_context,
    slot_format,
    unfold_heads,
    without_affine,
)

SATURATION = 2.0  # |b x| beyond which tanh(b x) is within 3.6 % of +-1
HIGHLIGHT = 4     # tokens and channels shown in colour


@dataclass
class SlotSample:
    """The sampled elements of one slot: ``points`` (``x``, ``y``, ``y_pre``, ``image``, ``token``,
    ``channel``), and the same for the highlighted ``tokens`` / ``channels``; ``token`` -1: a prefix token or
    a pooled vector."""

    name: str
    kind: str
    grid: tuple[int, int] | None
    points: dict[str, np.ndarray] = field(default_factory=dict)
    tokens: dict[str, np.ndarray] = field(default_factory=dict)
    channels: dict[str, np.ndarray] = field(default_factory=dict)
    affine_removed: bool = True


def _flat_positions(t: torch.Tensor, fmt: str, layout: Any) -> tuple[torch.Tensor, ...]:
    """For every element of the slot tensor ``t`` (flattened in memory order): image, token and channel."""
    c_dim = channel_dim(t, fmt)
    shape = t.shape
    image = torch.arange(shape[0]).view(-1, *([1] * (t.dim() - 1))).expand(shape)
    trailing = [1] * (t.dim() - c_dim - 1)
    channel = torch.arange(shape[c_dim]).view(*([1] * c_dim), -1, *trailing).expand(shape)
    # token index: position among the non-channel, non-batch dims, minus the prefix tokens
    other = [d for d in range(1, t.dim()) if d != c_dim]
    if other:
        sizes = [shape[d] for d in other]
        pos = torch.arange(math.prod(sizes)).view(sizes)
        view = [1] * t.dim()
        for d, s in zip(other, sizes, strict=True):
            view[d] = s
        token = pos.view(view).expand(shape)
        tokens = grid_tokens(t, fmt, layout)
        token = token - tokens.prefix.shape[1]  # prefix tokens come first: they become negative
    else:
        token = torch.full(shape, -1)
    token = token.clamp(min=-1)
    return image.reshape(-1), token.reshape(-1), channel.reshape(-1)


class IOSampler:
    """Forward-hook callback keeping ``points`` seeded samples per slot over ``total_images``; the same
    images give the same points."""

    def __init__(self, model: nn.Module, names: list[str], points: int = 2000, seed: int = 0,
                 total_images: int | None = None, highlight: int = HIGHLIGHT) -> None:
        self.model, self.names = model, list(names)
        self.points, self.seed, self.total, self.highlight = points, seed, total_images, highlight
        self.samples: dict[str, SlotSample] = {}
        self._calls: dict[str, int] = {}
        self._seen: dict[str, int] = {}
        self._channels: dict[str, torch.Tensor] = {}

    def __call__(self, name: str, module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
        x, y = x.detach(), y.detach()
        fmt = slot_format(module)
        layout = slot_context(self.model, name).get("layout")
        y_pre = without_affine(module, x).detach()
        (x, _), (y, _), (y_pre, layout) = (unfold_heads(t, layout) for t in (x, y, y_pre))
        k, j = self.names.index(name), self._calls.get(name, 0)
        self._calls[name] = j + 1
        image, token, channel = _flat_positions(x, fmt, layout)
        image = image + self._seen.get(name, 0)
        self._seen[name] = self._seen.get(name, 0) + x.shape[0]
        sample = self.samples.get(name)
        if sample is None:
            sample = self.samples[name] = SlotSample(
                name, type(module).__name__, grid_tokens(x, fmt, layout).shape,
                affine_removed=any(p is not None for p in affine_params(module)))
        flat = {"x": x.reshape(-1), "y": y.reshape(-1), "y_pre": y_pre.reshape(-1)}
        where = {"image": image, "token": token, "channel": channel}

        def take(sel: torch.Tensor) -> dict[str, np.ndarray]:
            out = {k: v[sel].float().cpu().numpy() for k, v in flat.items()}
            out.update({k: v[sel].cpu().numpy() for k, v in where.items()})
            return out

        generator = torch.Generator().manual_seed(stream_seed(self.seed, k * 1_009 + j) % 2**31)
        share = x.shape[0] / self.total if self.total else 1.0
        n = min(x.numel(), max(1, round(self.points * share)))
        chosen = torch.randperm(x.numel(), generator=generator)[:n].sort().values
        _extend(sample.points, take(chosen))
        if j == 0:  # highlighted tokens: every channel of a few grid tokens of the first image
            grid_ids = token[(image == image.min()) & (token >= 0)].unique()
            if len(grid_ids):
                pick = grid_ids[torch.randperm(len(grid_ids), generator=generator)[: self.highlight]]
                sel = (image == image.min()) & torch.isin(token, pick)
            else:  # pooled vectors: the first image's
                sel = image == image.min()
            _extend(sample.tokens, take(sel))
            # highlighted channels: those with the largest |input| in the first batch, every position
            c_dim = channel_dim(x, fmt)
            peak = x.abs().movedim(c_dim, 0).reshape(x.shape[c_dim], -1).amax(dim=1)
            self._channels[name] = peak.topk(min(self.highlight, len(peak))).indices
        _extend(sample.channels, take(torch.isin(channel, self._channels[name])))


def _extend(store: dict[str, np.ndarray], new: dict[str, np.ndarray]) -> None:
    for key, value in new.items():
        store[key] = np.concatenate([store[key], value]) if key in store else value


# ---------------------------------------------------------------- the tanh fit
@dataclass
class TanhFit:
    a: float
    b: float
    c: float
    r2: float
    linear_r2: float
    saturated: float
    n: int

    def as_dict(self) -> dict[str, float | int]:
        return {"a": self.a, "b": self.b, "c": self.c, "r2": self.r2, "linear_r2": self.linear_r2,
                "saturated_fraction": self.saturated, "n": self.n}


def _r2(y: np.ndarray, pred: np.ndarray) -> float:
    total = float(((y - y.mean()) ** 2).sum())
    return 1.0 - float(((y - pred) ** 2).sum()) / total if total > 0 else float("nan")


def _linear_in_ac(t: np.ndarray, y: np.ndarray) -> tuple[float, float, float]:
    """Least squares of y ~ a t + c: (a, c, residual sum of squares)."""
    tm, ym = t.mean(), y.mean()
    var = float(((t - tm) ** 2).sum())
    a = float(((t - tm) * (y - ym)).sum()) / var if var > 0 else 0.0
    c = float(ym - a * tm)
    return a, c, float(((y - a * t - c) ** 2).sum())


def fit_tanh(x: np.ndarray, y: np.ndarray) -> TanhFit:
    """Least-squares ``y = a tanh(b x) + c`` (b > 0); a near-linear cloud gets the line's R^2."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    scale = float(np.abs(x).max()) if len(x) else 0.0
    if len(x) < 3 or scale == 0 or not np.isfinite(scale):
        return TanhFit(math.nan, math.nan, math.nan, math.nan, math.nan, math.nan, len(x))

    def sse(log_b: float) -> float:
        return _linear_in_ac(np.tanh(math.exp(log_b) * x), y)[2]

    # b in [1e-3, 1e3] / max|x|: from a straight line over the data to a step at its centre
    grid = np.linspace(math.log(1e-3 / scale), math.log(1e3 / scale), 121)
    errors = [sse(g) for g in grid]
    i = int(np.argmin(errors))
    lo, hi = grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)]
    golden = (math.sqrt(5) - 1) / 2
    for _ in range(60):  # golden-section refinement inside the bracket
        m1, m2 = hi - golden * (hi - lo), lo + golden * (hi - lo)
        if sse(m1) < sse(m2):
            hi = m2
        else:
            lo = m1
    b = math.exp((lo + hi) / 2)
    a, c, _ = _linear_in_ac(np.tanh(b * x), y)
    pred = a * np.tanh(b * x) + c
    la, lc, _ = _linear_in_ac(x, y)
    return TanhFit(a=a, b=b, c=c, r2=_r2(y, pred), linear_r2=_r2(y, la * x + lc),
                   saturated=float(np.mean(np.abs(b * x) > SATURATION)), n=len(x))


def io_numbers(sample: SlotSample, module: nn.Module | None = None) -> dict[str, Any]:
    """The numbers of one slot: the fit on the pre-affine output, and DyT's own alpha when it has one."""
    pts = sample.points
    fit = fit_tanh(pts["x"], pts["y_pre"])
    out: dict[str, Any] = {"slot": sample.name, "layer": sample.kind, "grid": sample.grid,
                           "affine_removed": sample.affine_removed, **fit.as_dict()}
    alpha = scalar_alpha(module) if module is not None else None
    if alpha is not None:
        out["layer_alpha"] = alpha
        out["layer_squash"] = getattr(module, "squash", None)
    return out


def scalar_alpha(module: nn.Module) -> float | None:
    """A layer's one scalar alpha (DyT, Derf), else None."""
    alpha = getattr(module, "alpha", None)
    if isinstance(alpha, torch.Tensor) and alpha.numel() == 1:
        return float(alpha.detach().reshape(()))
    return None
