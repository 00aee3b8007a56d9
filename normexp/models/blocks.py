"""Where the norm sits in a transformer block: timm's blocks where timm has the placement, ours where not.

``F`` is a block's attention or MLP, ``N`` a norm slot (filled by the configured normalizer like any other
slot), ``ls`` the optional LayerScale (CaiT, Touvron et al. 2021, arXiv 2103.17239; timm's ``init_values``: a
per-channel gain on the branch, identity when off) and stochastic depth acts on the branch before the
addition. Per sub-layer (attention, then MLP):

* ``pre`` -- Pre-LN (Xiong et al. 2020, arXiv 2002.04745): ``x + ls(F(N(x)))``. timm's ``Block`` itself;
  slots ``norm1`` / ``norm2`` (the inputs of attention / MLP).
* ``post`` -- the original Transformer's Post-LN (Vaswani et al. 2017, arXiv 1706.03762):
  ``N(x + ls(F(x)))`` (:class:`PostNormBlock`); ``norm1`` / ``norm2`` after each residual addition.
* ``peri`` -- Peri-LN (Kim et al. 2025, arXiv 2502.02732; = CogView's Sandwich-LN, arXiv 2105.13290):
  ``x + ls(N_out(F(N_in(x))))`` (:class:`PeriNormBlock`); ``norm1`` / ``norm2`` on the inputs as in ``pre``,
  ``norm1_out`` / ``norm2_out`` on the branch outputs.
* ``res_post`` -- Swin-v2's res-post-norm (Liu et al. 2022, arXiv 2111.09883): ``x + ls(N(F(x)))``, no norm
  on the input (:class:`ResPostNormBlock`: timm's ``ResPostBlock``); ``norm1`` / ``norm2`` on the branch
  outputs.
* ``hybrid`` -- HybridNorm (Zhuo et al. 2025, arXiv 2503.04598; BryceZhuo/HybridNorm, whose configs set
  ``attn_norm: false, use_query_norm / use_key_norm / use_value_norm: true, ffn_norm: true,
  ffn_residual_after_norm: true``): no norm on the attention input, a norm on Q, K and V of every head
  inside the attention (``attn.q_norm`` / ``k_norm`` / ``v_norm``), and the "post-norm FFN" as that code
  computes it: ``y = x + ls(Attn_QKVnorm(x))``, ``z = N(y)``, ``out = z + ls(MLP(z))``
  (:class:`HybridNormBlock`; ``N`` is ``norm2``, the MLP's input as in ``pre``). The residual of the MLP
  is taken after the norm, so the stream carries exactly one norm per block, after the attention's
  addition. HybridNorm* (pre-norm attention in the first block) is not built here.

Per-head norm slots: ``qk_norm`` (ViT-22B, Dehghani et al. 2023, arXiv 2302.05442; timm's ``qk_norm``) puts a
norm on the queries and keys of every head, over ``head_dim``; HybridNorm adds one on the values.
:class:`HeadNormAttention` (timm's ``Attention`` with, for HybridNorm, ``v_norm``) hands those slots each
head's tokens as ``(B * heads, N, head_dim)`` -- the heads folded into the batch, tokens in their order --
so a normalizer that reads tokens (DTN, IN, GN) sees one head's tokens on the grid (the model's
``norm_context`` gives those slots one head and the folded layout: ``normexp.norms.layout.FoldedHeads``);
per-token normalizers (LN, RMSNorm, DyT) compute what they compute on timm's ``(B, heads, N, head_dim)``.

Module names: every block keeps timm's (``attn``, ``mlp``, ``norm1``, ``norm2``, ``ls1``, ``ls2``), so the
state dicts of ``pre`` and ``post`` (and of ``res_post``: timm's own) are interchangeable, ``blocks.*.norm1``
patterns keep working, and the added slots have names of their own; a block without a norm where ``pre`` has
one holds ``nn.Identity`` there (no slot).
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
    """timm's ``Attention`` whose per-head norm slots see each head's tokens as ``(B * heads, N, head_dim)``.

    ``qk_norm`` (timm's) gives ``q_norm`` / ``k_norm``; ``v_norm`` (HybridNorm) one on the values, built by
    the same ``norm_layer``. Computes what timm's does -- fused or not, attention dropout, NormFormer's
    ``scale_norm`` (``norm``), timm's output gate -- with the norms applied to the folded tensors.
    """

    def __init__(self, dim: int, num_heads: int = 8, v_norm: bool = False, **kwargs: Any) -> None:
        super().__init__(dim, num_heads=num_heads, **kwargs)
        norm_layer = kwargs.get("norm_layer")
        if v_norm and norm_layer is None:
            raise ValueError("v_norm needs a norm_layer")
        self.v_norm = norm_layer(self.head_dim, **_factory(kwargs)) if v_norm else nn.Identity()
        _reorder(self, ("qkv", "q_norm", "k_norm", "v_norm"))

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
        x = self.norm(x.transpose(1, 2).reshape(b, n, self.num_heads * self.head_dim))
        if gate is not None:
            x = x * gate
        return self.proj_drop(self.proj(x))


class QKVNormAttention(HeadNormAttention):
    """HybridNorm's attention: a norm on the queries, keys and values of every head."""

    def __init__(self, dim: int, num_heads: int = 8, **kwargs: Any) -> None:
        kwargs.update(qk_norm=True, v_norm=True)
        super().__init__(dim, num_heads, **kwargs)


class PostNormBlock(Block):
    """Post-LN (Vaswani et al. 2017, arXiv 1706.03762): ``x = N(x + ls(F(x)))`` per sub-layer; ``norm1`` /
    ``norm2`` follow the attention's / MLP's residual addition. timm's ``Block`` with its norms moved."""

    def __init__(self, dim: int, num_heads: int, **kwargs: Any) -> None:
        super().__init__(dim, num_heads, **kwargs)
        _reorder(self, ("attn", "ls1", "drop_path1", "norm1", "mlp", "ls2", "drop_path2", "norm2"))

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None,
                is_causal: bool = False) -> torch.Tensor:
        x = self.norm1(x + self.drop_path1(self.ls1(self.attn(x, attn_mask=attn_mask, is_causal=is_causal))))
        return self.norm2(x + self.drop_path2(self.ls2(self.mlp(x))))


class PeriNormBlock(Block):
    """Peri-LN / Sandwich-LN (arXiv 2502.02732, 2105.13290): ``x = x + ls(N_out(F(N_in(x))))`` per
    sub-layer; ``norm1`` / ``norm2`` on the inputs (as timm's ``Block``), ``norm1_out`` / ``norm2_out`` on the
    outputs."""

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
    """Swin-v2's res-post-norm (arXiv 2111.09883): ``x = x + ls(N(F(x)))`` per sub-layer -- timm's
    ``ResPostBlock`` (``norm1`` / ``norm2`` on the branch outputs), with one change for ``init_values``:
    timm starts the norms' weight at ``init_values`` (a LayerScale folded into the norm), which the placement
    would undo when it swaps the norm and which a normalizer without a per-channel weight could not hold; here
    the norms are built as every other slot and ``init_values`` is a LayerScale after them (``ls1`` /
    ``ls2``): the same function at initialisation for LN, RMSNorm and DyT. Without it, timm's block
    unchanged."""

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
    """HybridNorm (arXiv 2503.04598), as its code computes it: ``y = x + ls(Attn_QKVnorm(x))``,
    ``z = N(y)``, ``out = z + ls(MLP(z))``. The attention is :class:`QKVNormAttention` (slots
    ``attn.q_norm`` / ``k_norm`` / ``v_norm``), ``norm2`` is ``N``; ``norm1`` is the identity (no slot)."""

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
