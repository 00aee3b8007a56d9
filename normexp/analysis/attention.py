"""Mean attention distance per head and layer (ViT, Dosovitskiy et al., ICLR 2021, arXiv 2010.11929, Fig. 7
right and App. D.7; the DTN README's ``DTN_Head.png``, wqshao126/DTN): ``d_q = sum_k A_qk |p_q - p_k|`` in
pixels between patch centres, averaged over grid queries and images; prefix tokens are dropped and the grid
weights renormalised. The weights are read by a hook on ``attn_drop`` of timm-style attention with
``fused_attn`` off (no re-implementation); the grids come from ``norm_context``. Windowed (Swin) and
unreadable attention (LeViT, T2T layers) and attention-free models are reported as such, never a crash.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from ..norms.placement import norm_slot_names
from .slots import slot_context


def cell_centres(grid: tuple[int, int], image: tuple[int, int]) -> torch.Tensor:
    """(H*W, 2) pixel coordinates (row, col) of the cell centres of ``grid`` over an ``image`` in px."""
    h, w = grid
    rows = (torch.arange(h, dtype=torch.float64) + 0.5) * image[0] / h
    cols = (torch.arange(w, dtype=torch.float64) + 0.5) * image[1] / w
    return torch.stack(torch.meshgrid(rows, cols, indexing="ij"), dim=-1).reshape(-1, 2)


def mean_distances(attn: torch.Tensor, query_grid: tuple[int, int], key_grid: tuple[int, int],
                   image: tuple[int, int], query_prefix: int = 0,
                   key_prefix: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """((B, H), (B, H)): per image and head, the summed mean distance of the grid queries and their count.
    ``attn``: (B, heads, queries, keys), rows summing to 1."""
    a = attn[:, :, query_prefix:, key_prefix:].double()
    nq, nk = query_grid[0] * query_grid[1], key_grid[0] * key_grid[1]
    if a.shape[-2:] != (nq, nk):
        raise ValueError(f"attention over {tuple(attn.shape[-2:])} tokens does not fit prefixes "
                         f"({query_prefix}, {key_prefix}) + grids {query_grid} x {key_grid}")
    dist = torch.cdist(cell_centres(query_grid, image), cell_centres(key_grid, image))  # (Nq, Nk) px
    mass = a.sum(-1)
    counted = mass > 1e-12
    per_query = (a * dist).sum(-1) / mass.clamp_min(1e-12)
    return (per_query * counted).sum(-1), counted.sum(-1).double()


def uniform_distance(grid: tuple[int, int], image: tuple[int, int]) -> float:
    """The mean attention distance of a head attending uniformly to every token of ``grid``: a reference."""
    centres = cell_centres(grid, image)
    return float(torch.cdist(centres, centres).mean())


@dataclass
class LayerDistances:
    """One attention layer: its mean distance per head (px) and what it was computed over."""

    name: str
    block: int | None
    query_grid: tuple[int, int]
    key_grid: tuple[int, int]
    query_prefix: int
    sums: torch.Tensor | None = None
    counts: torch.Tensor | None = None
    images: int = 0

    @property
    def per_head(self) -> list[float]:
        assert self.sums is not None and self.counts is not None
        return (self.sums.sum(0) / self.counts.sum(0).clamp_min(1)).tolist()


@dataclass
class AttentionResult:
    layers: list[LayerDistances] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    image: tuple[int, int] = (0, 0)

    def rows(self) -> list[dict[str, Any]]:
        out = []
        for depth, layer in enumerate(self.layers):
            for head, d in enumerate(layer.per_head):
                out.append({"layer": layer.name, "depth": depth, "block": layer.block, "head": head,
                            "mean_distance_px": d, "query_grid": "x".join(map(str, layer.query_grid)),
                            "key_grid": "x".join(map(str, layer.key_grid)),
                            "prefix_tokens": layer.query_prefix,
                            "images": layer.images,
                            "uniform_px": uniform_distance(layer.query_grid, self.image)
                            if layer.query_grid == layer.key_grid else None})
        return out


def readable_attention(module: nn.Module) -> bool:
    """A timm-style attention: a ``fused_attn`` switch and ``attn_drop`` on the softmaxed weights."""
    return hasattr(module, "fused_attn") and isinstance(getattr(module, "attn_drop", None), nn.Module) \
        and hasattr(module, "num_heads")


def attention_like(module: nn.Module) -> bool:
    """Modules that attend, readable or not (for the notes on what was left out)."""
    return "attention" in type(module).__name__.lower() or (
        hasattr(module, "num_heads") and any(hasattr(module, a) for a in ("qkv", "kqv", "q")))


def _block_context(model: nn.Module, attn_name: str, slots: list[str]) -> dict[str, Any] | None:
    """The norm-slot context of the block an attention module sits in (its sibling slots)."""
    parent = attn_name.rpartition(".")[0]
    prefix = parent + "." if parent else ""
    for slot in slots:
        if slot.startswith(prefix) and not slot.startswith(attn_name + "."):
            return slot_context(model, slot)
    return None


def _inner_context(model: nn.Module, attn_name: str, slots: list[str]) -> dict[str, Any] | None:
    for slot in slots:
        if slot.startswith(attn_name + "."):
            return slot_context(model, slot)
    return None


class AttentionRecorder:
    """Hooks every readable attention module of ``model`` and accumulates the distances; ``keep_weights``
    also keeps each module's weights of the last batch (``weights``)."""

    def __init__(self, model: nn.Module, image: tuple[int, int], keep_weights: bool = False) -> None:
        self.model, self.image = model, image
        self.weights: dict[str, torch.Tensor] | None = {} if keep_weights else None  # the last batch's
        self.slots = norm_slot_names(model)
        self.result = AttentionResult(image=image)
        self.modules: list[tuple[str, nn.Module]] = []
        self._layers: dict[str, LayerDistances] = {}
        self._skipped: dict[str, str] = {}
        names = [n for n, m in model.named_modules() if n and attention_like(m)]
        for name in names:
            if any(name.startswith(other + ".") for other in names if other != name):
                continue  # inside another attention-like module
            module = model.get_submodule(name)
            if readable_attention(module):
                self.modules.append((name, module))
            else:
                self._skipped[name] = type(module).__name__

    def _record(self, name: str, attn: torch.Tensor) -> None:
        if self.weights is not None:
            self.weights[name] = attn
        if name in self._skipped:
            return
        block_ctx = _block_context(self.model, name, self.slots) or {}
        layout = block_ctx.get("layout")
        grid = getattr(layout, "grid", None)
        if grid is None:
            self._skipped[name] = f"no token grid known for its block ({attn.shape[-2]} query tokens)"
            return
        nq = grid[0] * grid[1]
        q_prefix = attn.shape[-2] - nq
        if q_prefix != getattr(layout, "num_prefix_tokens", 0):
            self._skipped[name] = (f"attends over {attn.shape[-2]} query tokens, not its stage's {grid[0]}x"
                                   f"{grid[1]} grid: windowed attention")
            return
        if attn.shape[-1] == attn.shape[-2]:
            key_grid, k_prefix = grid, q_prefix
        else:
            inner = _inner_context(self.model, name, self.slots) or {}
            key_grid = getattr(inner.get("layout"), "grid", None)
            if key_grid is None or attn.shape[-1] < key_grid[0] * key_grid[1]:
                self._skipped[name] = f"keys ({attn.shape[-1]}) on no grid the model describes"
                return
            k_prefix = attn.shape[-1] - key_grid[0] * key_grid[1]
        layer = self._layers.get(name)
        if layer is None:
            layer = self._layers[name] = LayerDistances(name, block_ctx.get("block"), tuple(grid),
                                                        tuple(key_grid), q_prefix)
        sums, counts = mean_distances(attn, tuple(grid), tuple(key_grid), self.image, q_prefix, k_prefix)
        layer.sums = sums if layer.sums is None else torch.cat([layer.sums, sums])
        layer.counts = counts if layer.counts is None else torch.cat([layer.counts, counts])
        layer.images += attn.shape[0]

    @contextmanager
    def hooked(self) -> Iterator[None]:
        handles, fused = [], []
        try:
            for name, module in self.modules:
                fused.append((module, module.fused_attn))
                module.fused_attn = False

                def hook(_mod: nn.Module, args: tuple[Any, ...], _out: Any, _name: str = name) -> None:
                    self._record(_name, args[0].detach())

                handles.append(module.attn_drop.register_forward_hook(hook))
            yield
        finally:
            for handle in handles:
                handle.remove()
            for module, value in fused:
                module.fused_attn = value

    def finish(self) -> AttentionResult:
        res = self.result
        res.layers = [self._layers[n] for n, _ in self.modules if n in self._layers]
        kinds: dict[str, list[str]] = {}
        for name, why in self._skipped.items():
            kinds.setdefault(why, []).append(name)
        for why, names in kinds.items():
            shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            reason = why if " " in why else (
                f"{why} has no explicit attention weights to read (no timm-style fused_attn switch with "
                "attn_drop on the softmaxed weights)")
            res.notes.append(f"left out {shown}: {reason}")
        if not self.modules and not self._skipped:
            res.notes.append(f"{type(self.model).__name__} has no attention layers: mean attention distance "
                             "does not apply")
        if res.layers and any(layer.query_prefix for layer in res.layers):
            res.notes.append("class / distillation tokens are left out: not as queries, and their key "
                             "weights dropped with the grid weights renormalised")
        return res


def summarise(result: AttentionResult) -> dict[str, Any]:
    rows = result.rows()
    per_layer = {}
    for layer in result.layers:
        heads = layer.per_head
        per_layer[layer.name] = {"mean_px": float(np.mean(heads)), "min_px": float(np.min(heads)),
                                 "max_px": float(np.max(heads))}
    return {"image_px": list(result.image), "layers": per_layer, "notes": result.notes,
            "definition": "attention-weighted mean distance between query and key patch centres (px), over "
                          "grid queries and images; prefix tokens left out", "rows": len(rows),
            "math": "d_q = sum_k A_qk |p_q - p_k| / sum_k A_qk over grid keys k"}
