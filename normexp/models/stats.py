"""Model statistics recorded in every run summary."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode


def count_params(model: nn.Module, trainable: bool = False) -> int:
    """Parameters as the papers count them (fixed ones included: DiT's position table), or the trainable."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable)


@torch.no_grad()
def count_gmacs(model: nn.Module, input_shape: tuple[int, ...]) -> float:
    """Multiply-accumulates (1e9) of one forward pass -- the figure papers call "FLOPs".

    Counted by torch's FlopCounterMode (matmuls, convolutions, attention matmuls -- timm's fused attention is
    switched off while counting); element-wise ops such as normalizers are not counted, as in fvcore.
    """
    device = next(model.parameters()).device
    was_training = model.training
    # Fused attention kernels are invisible to the counter on some devices: count the plain matmuls.
    fused = [m for m in model.modules() if getattr(m, "fused_attn", False)]
    for m in fused:
        m.fused_attn = False
    model.eval()
    counter = FlopCounterMode(display=False)
    try:
        with counter:
            model(torch.zeros(1, *input_shape, device=device))
    finally:
        for m in fused:
            m.fused_attn = True
        model.train(was_training)
    return counter.get_total_flops() / 2 / 1e9
