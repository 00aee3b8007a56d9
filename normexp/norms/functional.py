"""Small helpers shared by the normalizers."""

from __future__ import annotations

import torch

DATA_FORMATS = ("channels_last", "channels_first")


def check_data_format(data_format: str) -> str:
    if data_format not in DATA_FORMATS:
        raise ValueError(f"data_format must be one of {DATA_FORMATS}, got '{data_format}'")
    return data_format


def channel_affine(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                   data_format: str) -> torch.Tensor:
    """Apply a per-channel scale and shift along the channel dim of ``data_format``."""
    if data_format == "channels_first" and x.dim() > 2:
        shape = (-1,) + (1,) * (x.dim() - 2)
        weight = None if weight is None else weight.view(shape)
        bias = None if bias is None else bias.view(shape)
    if weight is not None:
        x = x * weight
    if bias is not None:
        x = x + bias
    return x


def output_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype LayerNorm returns for ``x`` here, which every normalizer returns too: float32 under CUDA
    autocast (``layer_norm`` is on its float32 list), else ``x``'s (CPU autocast keeps bfloat16 inputs)."""
    if x.device.type == "cuda" and torch.is_autocast_enabled("cuda"):
        return torch.float32
    return x.dtype
