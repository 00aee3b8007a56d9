"""ViT / DeiT (Dosovitskiy et al. 2021; Touvron et al. 2021) on timm's ``VisionTransformer``.

Sizes follow DeiT (qkv bias, class token, 12 blocks). ``vit_micro`` is the same architecture scaled down
for the CPU demo: 96 wide, 6 blocks, 4 heads, 16 px input with 2 px patches (64 tokens).
"""

from __future__ import annotations

from typing import Any

from timm.models.vision_transformer import VisionTransformer

from .registry import register_model


class ViT(VisionTransformer):
    """timm's ViT that tells each norm slot which block it sits in (``norm_context``)."""

    def norm_context(self, name: str) -> dict[str, Any]:
        """Context for the norm slot ``name``: the head count of its block (or of the model)."""
        block = self.blocks[int(name.split(".")[1])] if name.startswith("blocks.") else self.blocks[0]
        return {"num_heads": block.attn.num_heads, "num_prefix_tokens": self.num_prefix_tokens}


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
