"""Where the norm sits in a transformer block (``norm_position``; docs/normalizers.md has the table): timm's
blocks where timm has the placement, ours where not. Per sub-layer F, slot N, LayerScale ``ls`` (CaiT,
arXiv 2103.17239):

* ``pre``: Pre-LN (arXiv 2002.04745), ``x + ls(F(N(x)))``, timm's ``Block``;
* ``post``: Post-LN (Vaswani et al. 2017, arXiv 1706.03762), ``N(x + ls(F(x)))``;
* ``peri``: Peri-LN (arXiv 2502.02732) = Sandwich-LN (arXiv 2105.13290), ``x + ls(N_out(F(N_in(x))))``;
* ``res_post``: Swin-v2's res-post-norm (arXiv 2111.09883), ``x + ls(N(F(x)))``, timm's ``ResPostBlock``;
* ``hybrid``: HybridNorm (arXiv 2503.04598; BryceZhuo/HybridNorm's configs): per-head norms on Q, K, V and a
  post-norm FFN. HybridNorm* is not built.

Per-head slots (``qk_norm``, ViT-22B, arXiv 2302.05442; HybridNorm's ``v_norm``) see each head's tokens as
``(B * heads, N, head_dim)``. Blocks keep timm's module names, so ``pre`` and ``post`` state dicts are
interchangeable.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from timm.layers import Attention, LayerScale
from timm.models.vision_transformer import Block, ResPostBlock
from torch import nn

NORM_POSITIONS = ("pre", "post", "peri", "res_post", "hybrid")
PER_HEAD_SLOTS = ("q_norm", "k_norm", "v_norm")  # attention slots that see (B * heads, N, head_dim)


def _factory(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The device / dtype a timm constructor was given (newer timm passes them to every layer)."""
    return {k: kwargs[k] for k in ("device", "dtype") if kwargs.get(k) is not None}


def _reorder(module: nn.Module, order: tuple[str, ...]) -> None:
    """Register ``module``'s children in forward order (slot listings and state dicts follow it)."""
    children = module._modules
    ordered = [name for name in order if name in children] + [name for name in children if name not in order]
    items = [(name, children[name]) for name in ordered]
    children.clear()
    children.update(items)


class HeadNormAttention(Attention):
    """timm's ``Attention`` whose per-head norm slots (``q_norm``, ``k_norm``, ``v_norm``) see each head's
    tokens as ``(B * heads, N, head_dim)``; otherwise it computes what timm's does."""

    def __init__(self, dim: int, num_heads: int = 8, v_norm: bool = False, head_scale: bool = False,
                 out_norm: bool = False, **kwargs: Any) -> None:
        super().__init__(dim, num_heads=num_heads, **kwargs)
        norm_layer = kwargs.get("norm_layer")
        if (v_norm or out_norm) and norm_layer is None:
            raise ValueError("v_norm and out_norm need a norm_layer")
        self.v_norm = norm_layer(self.head_dim, **_factory(kwargs)) if v_norm else nn.Identity()
        # NormFormer's per-head gains (before the projection) and its norm after the projection
        self.head_gain = nn.Parameter(torch.ones(num_heads, **_factory(kwargs))) if head_scale else None
        self.out_norm = norm_layer(dim, **_factory(kwargs)) if out_norm else nn.Identity()
        _reorder(self, ("qkv", "q_norm", "k_norm", "v_norm", "attn_drop", "norm", "proj", "out_norm"))

    @staticmethod
    def _per_head(norm: nn.Module, t: torch.Tensor) -> torch.Tensor:
        if isinstance(norm, nn.Identity):
            return t
        b, h, n, d = t.shape
        return norm(t.reshape(b * h, n, d)).reshape(b, h, n, d)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None,
                is_causal: bool = False) -> torch.Tensor:
        b, n, _ = x.shape
        gate_layer = getattr(self, "gate", None)
        gate = gate_layer(x).sigmoid() if gate_layer is not None else None
        q, k, v = self.qkv(x).reshape(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        q, k, v = (self._per_head(self.q_norm, q), self._per_head(self.k_norm, k),
                   self._per_head(self.v_norm, v))
        if self.fused_attn:
            x = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal,
                                               dropout_p=self.attn_drop.p if self.training else 0.0)
        else:  # explicit weights through attn_drop: what `normexp analyze` reads
            attn = (q * self.scale) @ k.transpose(-2, -1)
            if is_causal:
                future = torch.ones(n, n, dtype=torch.bool, device=x.device).triu(1)
                attn = attn.masked_fill(future, float("-inf"))
            elif attn_mask is not None:
                attn = attn.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool \
                    else attn + attn_mask
            x = self.attn_drop(attn.softmax(dim=-1)) @ v
        if self.head_gain is not None:
            x = x * self.head_gain.view(1, -1, 1, 1).to(x.dtype)
        x = self.norm(x.transpose(1, 2).reshape(b, n, self.num_heads * self.head_dim))
        if gate is not None:
            x = x * gate
        return self.proj_drop(self.out_norm(self.proj(x)))


class NormFormerAttention(HeadNormAttention):
    """NormFormer's attention (arXiv 2110.09456, Sec. 2, Fig. 1): ``LN(Concat(g_1 h_1, ..., g_n h_n) W_O)``,
    a learnable gain per head (at 1) before the output projection and a norm slot (``out_norm``) after it.
    fairseq (``TransformerDecoderLayerBase``, ``scale_heads``) scales the projected output's channel blocks
    instead, which its maintainers call not equivalent (fairseq issue 3973); the paper's is built here."""

    def __init__(self, dim: int, num_heads: int = 8, **kwargs: Any) -> None:
        kwargs.update(head_scale=True, out_norm=True)
        super().__init__(dim, num_heads, **kwargs)


class QKVNormAttention(HeadNormAttention):
    """HybridNorm's attention: a norm on the queries, keys and values of every head."""

    def __init__(self, dim: int, num_heads: int = 8, **kwargs: Any) -> None:
        kwargs.update(qk_norm=True, v_norm=True)
        super().__init__(dim, num_heads, **kwargs)


class PostNormBlock(Block):
    """Post-LN (arXiv 1706.03762): timm's ``Block`` with ``norm1`` / ``norm2`` after each addition."""

    def __init__(self, dim: int, num_heads: int, **kwargs: Any) -> None:
        super().__init__(dim, num_heads, **kwargs)
        _reorder(self, ("attn", "ls1", "drop_path1", "norm1", "mlp", "ls2", "drop_path2", "norm2"))

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None,
                is_causal: bool = False) -> torch.Tensor:
        x = self.norm1(x + self.drop_path1(self.ls1(self.attn(x, attn_mask=attn_mask, is_causal=is_causal))))
        return self.norm2(x + self.drop_path2(self.ls2(self.mlp(x))))


class PeriNormBlock(Block):
    """Peri-LN / Sandwich-LN (arXiv 2502.02732, 2105.13290): ``norm1_out`` / ``norm2_out`` on the outputs."""

    def __init__(self, dim: int, num_heads: int, norm_layer: Any = nn.LayerNorm, **kwargs: Any) -> None:
        super().__init__(dim, num_heads, norm_layer=norm_layer, **kwargs)
        self.norm1_out = norm_layer(dim, **_factory(kwargs))
        self.norm2_out = norm_layer(dim, **_factory(kwargs))
        _reorder(self, ("norm1", "attn", "norm1_out", "ls1", "drop_path1",
                        "norm2", "mlp", "norm2_out", "ls2", "drop_path2"))

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None,
                is_causal: bool = False) -> torch.Tensor:
        attn = self.attn(self.norm1(x), attn_mask=attn_mask, is_causal=is_causal)
        x = x + self.drop_path1(self.ls1(self.norm1_out(attn)))
        return x + self.drop_path2(self.ls2(self.norm2_out(self.mlp(self.norm2(x)))))


class ResPostNormBlock(ResPostBlock):
    """Swin-v2's res-post-norm (arXiv 2111.09883): timm's ``ResPostBlock``, except that ``init_values`` is a
    LayerScale after the norms (``ls1`` / ``ls2``) rather than their weight init, so any normalizer fits."""

    def __init__(self, dim: int, num_heads: int, init_values: float | None = None, **kwargs: Any) -> None:
        super().__init__(dim, num_heads, init_values=None, **kwargs)
        for name in ("ls1", "ls2"):
            setattr(self, name, LayerScale(dim, init_values=init_values, **_factory(kwargs)) if init_values
                    else nn.Identity())
        _reorder(self, ("attn", "norm1", "ls1", "drop_path1", "mlp", "norm2", "ls2", "drop_path2"))

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None,
                is_causal: bool = False) -> torch.Tensor:
        x = x + self.drop_path1(self.ls1(self.norm1(self.attn(x, attn_mask=attn_mask, is_causal=is_causal))))
        return x + self.drop_path2(self.ls2(self.norm2(self.mlp(x))))


class HybridNormBlock(Block):
    """HybridNorm (arXiv 2503.04598) as its code computes it: ``y = x + ls(Attn_QKVnorm(x))``, ``z = N(y)``,
    ``out = z + ls(MLP(z))``; ``norm1`` is the identity (no slot)."""

    def __init__(self, dim: int, num_heads: int, **kwargs: Any) -> None:
        kwargs["attn_layer"] = QKVNormAttention
        super().__init__(dim, num_heads, **kwargs)
        self.norm1 = nn.Identity()

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None,
                is_causal: bool = False) -> torch.Tensor:
        x = self.norm2(x + self.drop_path1(self.ls1(self.attn(x, attn_mask=attn_mask, is_causal=is_causal))))
        return x + self.drop_path2(self.ls2(self.mlp(x)))


BLOCKS: dict[str, type[nn.Module]] = {"pre": Block, "post": PostNormBlock, "peri": PeriNormBlock,
                                      "res_post": ResPostNormBlock, "hybrid": HybridNormBlock}


def block_class(norm_position: str) -> type[nn.Module]:
    """The block class of ``norm_position`` (one of :data:`NORM_POSITIONS`)."""
    if norm_position not in BLOCKS:
        raise ValueError(f"norm_position must be one of {', '.join(NORM_POSITIONS)}, got {norm_position!r}")
    return BLOCKS[norm_position]
