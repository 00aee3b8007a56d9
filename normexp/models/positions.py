"""Fixed 2-D sin-cos position embeddings, as MAE's ``util/pos_embed.py`` (``get_2d_sincos_pos_embed``,
He et al. 2022, arXiv 2111.06377) computes them; MAE's encoder and decoder and DiT (Peebles & Xie 2023, arXiv
2212.09748, whose ``models.py`` uses the same tables) read them from here."""

from __future__ import annotations

import numpy as np
import torch


def sincos_1d(dim: int, positions: np.ndarray) -> np.ndarray:
    """(len(positions), dim): sin(p w_k), then cos(p w_k), w_k = 10000^(-2k/dim) for k < dim/2."""
    omega = 1.0 / 10000 ** (np.arange(dim // 2, dtype=np.float64) / (dim / 2.0))
    angles = np.outer(positions.astype(np.float64), omega)
    return np.concatenate([np.sin(angles), np.cos(angles)], axis=1)


def sincos_2d(dim: int, grid: tuple[int, int], cls_token: bool) -> torch.Tensor:
    """(1, [1 +] h*w, dim) as MAE's ``get_2d_sincos_pos_embed``; a class token gets zeros."""
    if dim % 4:
        raise ValueError(f"a 2-D sin-cos position embedding needs a width divisible by 4, got {dim}")
    h, w = grid
    rows, cols = np.divmod(np.arange(h * w), w)
    emb = np.concatenate([sincos_1d(dim // 2, cols), sincos_1d(dim // 2, rows)], axis=1)
    if cls_token:
        emb = np.concatenate([np.zeros((1, dim)), emb], axis=0)
    return torch.from_numpy(emb).float()[None]
