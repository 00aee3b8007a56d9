"""ViT / DeiT (Dosovitskiy et al. 2021; Touvron et al. 2021) on timm's ``VisionTransformer``.

Sizes follow DeiT (qkv bias, class token, 12 blocks). ``vit_micro`` is the same architecture scaled down
for the CPU demo: 96 wide, 6 blocks, 4 heads, 16 px input with 2 px patches (64 tokens).
The ``*_star`` sizes are the DTN paper's head-count variants (perfect-square heads so that every DTN head
starts local; no qkv bias, as the DTN code builds its ViTs).

``pyramid_scales`` (e.g. ``(4, 2, 1, 0.5)``) adds ViTDet's simple feature pyramid for dense tasks:
``features(x)`` then returns NCHW maps at strides ``patch_size / scale``.

``dtn_blocks=k`` gives the DTN code's ViT layout (ConViT style, dtn.md 1.4): the first k blocks see the
patch tokens only, the class token joins before block k, and only the norm slots of those first k blocks
take the configured normalizer -- blocks k.. and the final norm keep LayerNorm.
"""

from __future__ import annotations

from typing import Any

import torch
from timm.models.vision_transformer import VisionTransformer

from ..norms.layout import TokenLayout
from .pyramid import SimpleFeaturePyramid
from .registry import register_model


class ViT(VisionTransformer):
    """timm's ViT that tells each norm slot its block, head count and token layout (``norm_context``)."""

    def __init__(self, dtn_blocks: int | None = None, pyramid_scales: tuple[float, ...] | None = None,
                 **kwargs: Any) -> None:
        if dtn_blocks is not None:
            if not 0 < dtn_blocks <= kwargs.get("depth", 12):
                raise ValueError(f"dtn_blocks must be in 1..depth, got {dtn_blocks}")
            if kwargs.get("dynamic_img_size") or kwargs.get("global_pool", "token") != "token":
                raise ValueError("dtn_blocks needs a fixed image size and global_pool=token")
            kwargs["no_embed_class"] = True  # position embedding covers the grid tokens only
        super().__init__(**kwargs)
        self.dtn_blocks = dtn_blocks
        # Blocks before the class token joins see no prefix tokens; the others see num_prefix_tokens.
        self.grid_layout = TokenLayout(num_prefix_tokens=0)
        self.token_layout = TokenLayout(num_prefix_tokens=self.num_prefix_tokens)
        self.patch_embed.register_forward_pre_hook(self._track_grid)
        if dtn_blocks is not None:
            self.norm_keep = [f"blocks.{i}.*" for i in range(dtn_blocks, len(self.blocks))] + ["norm"]
        self.stride = self.patch_embed.patch_size[0]  # input pixels per token, as T2T-ViT's
        self.pyramid = None
        if pyramid_scales is not None:
            self.pyramid = SimpleFeaturePyramid(self.embed_dim, self.stride, tuple(pyramid_scales))
            self.feature_channels, self.feature_strides = self.pyramid.channels, self.pyramid.strides

    def _track_grid(self, _module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        grid = self.patch_embed.dynamic_feat_size(args[0].shape[-2:])
        self.grid_layout.set_grid(*grid)
        self.token_layout.set_grid(*grid)

    def norm_context(self, name: str) -> dict[str, Any]:
        """Context for the norm slot ``name``: its block index, head count and token layout."""
        block = int(name.split(".")[1]) if name.startswith("blocks.") else None
        late_cls = self.dtn_blocks is not None and (block is None or block < self.dtn_blocks)
        layout = self.grid_layout if late_cls else self.token_layout
        num_heads = self.blocks[block if block is not None else 0].attn.num_heads
        return {"block": block, "num_heads": num_heads, "layout": layout,
                "num_prefix_tokens": layout.num_prefix_tokens}

    def forward_features(self, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        if self.dtn_blocks is None:
            return super().forward_features(x, **kwargs)
        if kwargs.get("attn_mask") is not None:
            raise ValueError("attention masks are not supported with dtn_blocks")
        x = self.patch_drop(self.pos_drop(self.patch_embed(x) + self.pos_embed))
        x = self.norm_pre(x)
        x = self.blocks[: self.dtn_blocks](x)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        x = self.blocks[self.dtn_blocks :](x)
        return self.norm(x)


    def features(self, x: torch.Tensor) -> list[torch.Tensor]:
        """NCHW maps of the simple pyramid (needs ``pyramid_scales``) from the last block's grid tokens."""
        if self.pyramid is None:
            raise RuntimeError("build the ViT with pyramid_scales=(4, 2, 1, 0.5) to use features()")
        tokens = self.forward_features(x)[:, self.num_prefix_tokens:]
        h, w = self.token_layout.grid
        return self.pyramid(tokens.transpose(1, 2).reshape(x.shape[0], -1, h, w))


def _vit(arch: dict[str, Any], **kwargs: Any) -> ViT:
    return ViT(**{**arch, **kwargs})


@register_model
def vit_micro(**kwargs: Any) -> ViT:
    return _vit(dict(img_size=16, patch_size=2, embed_dim=96, depth=6, num_heads=4), **kwargs)


@register_model
def vit_tiny(**kwargs: Any) -> ViT:
    return _vit(dict(patch_size=16, embed_dim=192, depth=12, num_heads=3), **kwargs)


@register_model
def vit_small(**kwargs: Any) -> ViT:
    return _vit(dict(patch_size=16, embed_dim=384, depth=12, num_heads=6), **kwargs)


@register_model
def vit_base(**kwargs: Any) -> ViT:
    return _vit(dict(patch_size=16, embed_dim=768, depth=12, num_heads=12), **kwargs)


@register_model
def vit_tiny_star(**kwargs: Any) -> ViT:
    return _vit(dict(patch_size=16, embed_dim=192, depth=12, num_heads=4, qkv_bias=False), **kwargs)


@register_model
def vit_small_star(**kwargs: Any) -> ViT:
    return _vit(dict(patch_size=16, embed_dim=432, depth=12, num_heads=9, qkv_bias=False), **kwargs)


@register_model
def vit_base_star(**kwargs: Any) -> ViT:
    return _vit(dict(patch_size=16, embed_dim=768, depth=12, num_heads=16, qkv_bias=False), **kwargs)


@register_model
def vit_micro_star(**kwargs: Any) -> ViT:
    """``vit_micro`` built as the DTN code builds its ViTs (no qkv bias; the class token joins late: the
    config's ``dtn_blocks``): the CPU member for the ``*_star`` and DTN-code ViTs at smoke scale."""
    return _vit(dict(img_size=16, patch_size=2, embed_dim=96, depth=6, num_heads=4, qkv_bias=False), **kwargs)
