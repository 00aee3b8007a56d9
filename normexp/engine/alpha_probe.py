"""Per-epoch log of every scalar-alpha norm layer (DyT, Derf): its alpha and the std of its input, as DyT
(Zhu et al., CVPR 2025, arXiv 2503.10622, Sec. 6.2, Fig. 8 left) tracks them. One eval forward of a fixed
probe batch per epoch, drawing no random number; a task opts in with ``task.probes: [alpha]`` (its cost is in
docs/benchmarks.md)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

PROBE_IMAGES = 16
ALPHA_KEY, STD_KEY = "alpha/", "alpha_input_std/"


def scalar_alpha_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The layers with one scalar ``alpha`` (parameter or buffer), outermost first, in module order."""
    found = []
    for name, module in model.named_modules():
        alpha = getattr(module, "alpha", None)
        if name and isinstance(alpha, torch.Tensor) and alpha.numel() == 1:
            found.append((name, module))
    return found


def probe_batch(dataset: Any, count: int = PROBE_IMAGES) -> torch.Tensor | None:
    """``count`` images of ``dataset`` at evenly spaced indices (unreadable ones skipped), stacked."""
    n = len(dataset)
    if n == 0:
        return None
    indices = sorted({round(i * (n - 1) / max(count - 1, 1)) for i in range(min(count, n))})
    images = []
    for i in indices:
        item = dataset[i]
        if item is None:  # an unreadable image (data.on_bad_image=skip)
            continue
        image, target = (item[0], item[1]) if isinstance(item, (tuple, list)) else (item, None)
        if not isinstance(image, torch.Tensor) or image.dim() != 3 or isinstance(target, dict):
            return None  # not image classification (detection: dict targets, any image size)
        if images and image.shape != images[0].shape:
            return None
        images.append(image)
    return torch.stack(images) if images else None


@torch.no_grad()
def alpha_probe(model: nn.Module, loader: Any, forward: Callable[[torch.Tensor], Any] | None = None
                ) -> dict[str, float]:
    """``{"alpha/<slot>": ..., "alpha_input_std/<slot>": ...}`` on the probe batch; ``forward``: how the batch
    goes through the model when not ``model(batch)`` (it must draw no random number)."""
    layers = scalar_alpha_layers(model)
    if not layers:
        return {}
    batch = probe_batch(loader.dataset)
    if batch is None:
        return {}
    stds: dict[str, float] = {}
    handles = [module.register_forward_hook(
        lambda _m, args, _out, _name=name: stds.__setitem__(_name, float(args[0].float().std())))
        for name, module in layers]
    was_training = model.training
    try:
        model.eval()
        device = next(model.parameters()).device
        (forward or model)(batch.to(device))
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
    row = {}
    for name, module in layers:
        row[ALPHA_KEY + name] = float(module.alpha.detach().reshape(()))
        if name in stds:
            row[STD_KEY + name] = stds[name]
    return row
