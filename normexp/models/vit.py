"""ViT / DeiT (Dosovitskiy et al. 2021, arXiv 2010.11929; Touvron et al. 2021, arXiv 2012.12877) on timm's
``VisionTransformer``.

Sizes: DeiT's tiny / small / base, ``vit_large`` (ViT-L/16, DyT's Table 1 row, with ``global_pool='avg'``),
``vit_micro`` for the CPU demo (96 wide, 6 blocks, 16 px, 2 px patches), and the DTN code's ViTs
(wqshao126/DTN ``models/vit_norm_mix.py``; arXiv 2112.02624): ``vit_*_dtn`` are its ``vit_norm_s`` /
``vit_norm_b`` and ``vit_*_star`` its perfect-square head-count variants. ``dtn_blocks=k`` builds that code's
layout: the class token joins before block k, and only the first k blocks' slots take the configured
normalizer.

``norm_position``, ``qk_norm``, ``layer_scale`` and ``normformer`` (NormFormer, arXiv 2110.09456) place the
norms (``normexp.models.blocks``; docs/normalizers.md). The final norm stays under every position;
``+backbone.final_norm=false`` removes it. ``pyramid_scales`` adds ViTDet's simple feature pyramid;
``dynamic_img_size=True`` accepts any input size, the position table resampled by timm's
``resample_abs_pos_embed`` unless a task sets ``resample_positions`` (DINO's ``interpolate_pos_encoding``:
``normexp.models.dino``).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from timm.layers import trunc_normal_
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from ..norms.layout import FoldedHeads, TokenLayout
from .base import NormContext, PlainBackbone
from .blocks import PER_HEAD_SLOTS, HeadNormAttention, NormFormerAttention, block_class
from .pyramid import SimpleFeaturePyramid
from .registry import register_size


class ViT(VisionTransformer, PlainBackbone):
    """timm's ViT that tells each norm slot its block, head count and token layout (``norm_context``)."""

    # every position's branches end in the attention / MLP up to the slots' norms, which the methods that
    # read this (normalization-free ones) make the identity
    residual_scales = ("blocks.*.attn", "blocks.*.mlp")
    input_embedding = ("patch_embed.*", "pos_embed", "cls_token", "reg_token")
    final_norms = ("norm", "fc_norm")
    config_options = ("in_chans", "patch_size", "drop_path_rate", "global_pool", "dtn_blocks",
                      "norm_position", "qk_norm", "layer_scale", "normformer")

    def __init__(self, dtn_blocks: int | None = None, pyramid_scales: tuple[float, ...] | None = None,
                 norm_position: str = "pre", layer_scale: float | None = None, normformer: bool = False,
                 **kwargs: Any) -> None:
        block = block_class(norm_position)  # refuses a position it does not know
        if norm_position != "pre":
            kwargs["block_fn"] = block
        if kwargs.get("qk_norm"):  # timm's q / k norms, handed each head's tokens (see normexp.models.blocks)
            kwargs["attn_layer"] = HeadNormAttention
        if layer_scale is not None:
            if layer_scale <= 0:
                raise ValueError(f"layer_scale is LayerScale's initial value, > 0 (null: off), got "
                                 f"{layer_scale}")
            kwargs["init_values"] = layer_scale
        if normformer:  # NormFormer: head gains and a norm after the attention, a norm after the MLP's GELU
            if norm_position != "pre":
                raise ValueError(f"normformer adds its norms to the Pre-LN block (arXiv 2110.09456, Sec. 2): "
                                 f"it needs norm_position=pre, got {norm_position!r}")
            kwargs.update(attn_layer=NormFormerAttention, scale_mlp_norm=True)
        if dtn_blocks is not None:
            if not 0 < dtn_blocks <= kwargs.get("depth", 12):
                raise ValueError(f"dtn_blocks must be in 1..depth, got {dtn_blocks}")
            if kwargs.get("global_pool", "token") != "token":
                raise ValueError("dtn_blocks reads the class token: it needs global_pool=token")
            kwargs["no_embed_class"] = True  # position embedding covers the grid tokens only
        super().__init__(**kwargs)
        self.dtn_blocks, self.norm_position = dtn_blocks, norm_position
        # (table, grid, prefix tokens in it) -> the table for that grid; None: timm's resampling
        self.resample_positions: Callable[[torch.Tensor, tuple[int, int], int], torch.Tensor] | None = None
        # Blocks before the class token joins see no prefix tokens; the others see num_prefix_tokens.
        self.grid_layout = TokenLayout(num_prefix_tokens=0)
        self.token_layout = TokenLayout(num_prefix_tokens=self.num_prefix_tokens)
        self.patch_embed.register_forward_pre_hook(self._track_grid)
        if dtn_blocks is not None:
            self.norm_keep = [f"blocks.{i}.*" for i in range(dtn_blocks, len(self.blocks))] + ["norm"]
        self.stride = self.patch_embed.patch_size[0]  # input pixels per token, as T2T-ViT's
        self.pyramid = None
        self.feature_channels, self.feature_strides = [], []
        if pyramid_scales is not None:
            self.pyramid = SimpleFeaturePyramid(self.embed_dim, self.stride, tuple(pyramid_scales))
            self.feature_channels, self.feature_strides = self.pyramid.channels, self.pyramid.strides

    def affine_consumers(self) -> dict[str, tuple[str, ...]]:
        """Pre-LN blocks: ``norm1`` feeds only the attention's ``qkv``, ``norm2`` only the MLP's ``fc1``; the
        final norm (``fc_norm`` after average pooling) feeds only the head, through class-token selection or
        averaging, both per channel and linear. Every other position puts a norm on the residual stream, and
        a pyramid reads the final norm's tokens: those norms keep their affine."""
        if self.norm_position != "pre":
            return {}
        pairs = {}
        for i in range(len(self.blocks)):
            pairs[f"blocks.{i}.norm1"] = (f"blocks.{i}.attn.qkv",)
            pairs[f"blocks.{i}.norm2"] = (f"blocks.{i}.mlp.fc1",)
        final = "norm" if isinstance(self.fc_norm, nn.Identity) else "fc_norm"
        pooled_linearly = self.global_pool in ("token", "avg") and self.pyramid is None
        if pooled_linearly and isinstance(self.head, nn.Linear) and not isinstance(self.get_submodule(final),
                                                                                   nn.Identity):
            pairs[final] = ("head",)
        return pairs

    @classmethod
    def timm_twin(cls, kwargs: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
        """timm's ViT entrypoint of the same size (ViT-B/16's for sizes timm has not: every dim is in the
        arguments, which override the entrypoint's) with ``kwargs``, when none of normexp's own options is
        on and every argument is plain data (the DTN code's ViTs hand a LayerNorm class: no twin)."""
        own = {"dtn_blocks": None, "pyramid_scales": None, "norm_position": "pre", "normformer": False,
               "qk_norm": False}
        if any(kwargs.get(option, default) != default for option, default in own.items()):
            return None
        args = {k: v for k, v in kwargs.items() if k not in own and k != "layer_scale"}
        if kwargs.get("layer_scale") is not None:
            args["init_values"] = kwargs["layer_scale"]
        if not all(isinstance(v, (int, float, str, bool, list, tuple, type(None))) for v in args.values()):
            return None
        dims = (args.get("patch_size"), args.get("embed_dim"), args.get("depth"), args.get("num_heads"))
        return TIMM_SIZES.get(dims, "vit_base_patch16_224"), args

    def _track_grid(self, _module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        grid = self.patch_embed.dynamic_feat_size(args[0].shape[-2:])
        self.grid_layout.set_grid(*grid)
        self.token_layout.set_grid(*grid)

    def norm_context(self, name: str) -> NormContext:
        """Context for the norm slot ``name`` (``fc_norm``: ``pooled``)."""
        block = int(name.split(".")[1]) if name.startswith("blocks.") else None
        late_cls = self.dtn_blocks is not None and (block is None or block < self.dtn_blocks)
        layout = self.grid_layout if late_cls else self.token_layout
        num_heads = self.blocks[block if block is not None else 0].attn.num_heads
        parent, _, slot = name.rpartition(".")
        if block is not None and parent.endswith(".attn") and slot in PER_HEAD_SLOTS:
            return {"block": block, "num_heads": 1, "layout": FoldedHeads(layout, num_heads),
                    "num_prefix_tokens": layout.num_prefix_tokens, "pooled": False}
        return {"block": block, "num_heads": num_heads, "layout": layout,
                "num_prefix_tokens": layout.num_prefix_tokens, "pooled": name == "fc_norm"}

    def _pos_embed(self, x: torch.Tensor) -> torch.Tensor:
        """timm's, with the position table resampled by ``resample_positions`` when one is set."""
        if self.resample_positions is None or not self.dynamic_img_size or self.pos_embed is None:
            return super()._pos_embed(x)
        b, h, w, c = x.shape
        table_prefix = 0 if self.no_embed_class else self.num_prefix_tokens
        pos_embed = self.resample_positions(self.pos_embed, (h, w), table_prefix)
        prefix = [t.expand(b, -1, -1) for t in (self.cls_token, self.reg_token) if t is not None]
        x = x.view(b, -1, c)
        if self.no_embed_class:
            x = torch.cat([*prefix, x + pos_embed], dim=1)
        else:
            x = torch.cat([*prefix, x], dim=1) + pos_embed
        return self.pos_drop(x)

    def forward_features(self, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        if self.dtn_blocks is None:
            return super().forward_features(x, **kwargs)
        if kwargs.get("attn_mask") is not None:
            raise ValueError("attention masks are not supported with dtn_blocks")
        # timm adds the (resampled) position embedding to the grid tokens and puts the class token, which
        # has none (no_embed_class), in front; it joins the tokens again before block dtn_blocks.
        x = self._pos_embed(self.patch_embed(x))
        prefix, x = x[:, : self.num_prefix_tokens], x[:, self.num_prefix_tokens:]
        x = self.norm_pre(self.patch_drop(x))
        x = self.blocks[: self.dtn_blocks](x)
        x = self.blocks[self.dtn_blocks :](torch.cat([prefix, x], dim=1))
        return self.norm(x)


def _dtn_code_vit(**kwargs: Any) -> ViT:
    """A ViT as the DTN code's ``vit_norm_mix.py`` builds it (timm starts the class token at std 1e-6)."""
    model = ViT(**kwargs)
    trunc_normal_(model.cls_token, std=0.02)
    return model


# timm's ViT entrypoints by (patch size, width, depth, heads): a twin's architecture name
TIMM_SIZES = {(16, 192, 12, 3): "vit_tiny_patch16_224", (16, 384, 12, 6): "vit_small_patch16_224",
              (16, 768, 12, 12): "vit_base_patch16_224", (16, 1024, 24, 16): "vit_large_patch16_224"}

# DeiT's drop path, 0.1 for every size (its main.py), as the DTN code's train.py; the micro members have none
DEIT = {"drop_path_rate": 0.1}
# the DTN code's ViTs: no qkv bias, LN eps 1e-5, the normalizer in blocks 0-9 and the class token joining
# before block 10, LayerNorm in blocks 10-11 and the final norm
DTN_CODE = {**DEIT, "qkv_bias": False, "norm_layer": partial(nn.LayerNorm, eps=1e-5), "dtn_blocks": 10}

for _name, _build, _settings, _doc in [
    ("vit_micro", ViT, dict(img_size=16, patch_size=2, embed_dim=96, depth=6, num_heads=4),
     "The CPU member: DeiT's architecture at 96 wide, 6 blocks, 4 heads, 2 px patches."),
    ("vit_tiny", ViT, dict(DEIT, patch_size=16, embed_dim=192, depth=12, num_heads=3), "DeiT-Ti."),
    ("vit_small", ViT, dict(DEIT, patch_size=16, embed_dim=384, depth=12, num_heads=6), "DeiT-S."),
    ("vit_base", ViT, dict(DEIT, patch_size=16, embed_dim=768, depth=12, num_heads=12), "DeiT-B / ViT-B/16."),
    ("vit_large", ViT, dict(DEIT, patch_size=16, embed_dim=1024, depth=24, num_heads=16), "ViT-L/16."),
    ("vit_small_dtn", _dtn_code_vit, dict(DTN_CODE, patch_size=16, embed_dim=384, depth=12, num_heads=6),
     "The DTN code's ``vit_norm_s`` (the DTN tables' ViT-S)."),
    ("vit_base_dtn", _dtn_code_vit, dict(DTN_CODE, patch_size=16, embed_dim=768, depth=12, num_heads=12),
     "The DTN code's ``vit_norm_b`` (the DTN tables' ViT-B)."),
    ("vit_tiny_star", _dtn_code_vit, dict(DTN_CODE, patch_size=16, embed_dim=192, depth=12, num_heads=4),
     "The DTN code's ``vit_norm_ti_star`` (ViT-T*)."),
    ("vit_small_star", _dtn_code_vit, dict(DTN_CODE, patch_size=16, embed_dim=432, depth=12, num_heads=9),
     "The DTN code's ``vit_norm_s_star`` (ViT-S*: 432 wide, 9 heads)."),
    ("vit_base_star", _dtn_code_vit, dict(DTN_CODE, patch_size=16, embed_dim=768, depth=12, num_heads=16),
     "The DTN code's ``vit_norm_b_star`` (ViT-B*: 16 heads)."),
    ("vit_micro_star", _dtn_code_vit, dict(DTN_CODE, img_size=16, patch_size=2, embed_dim=96, depth=6,
                                           num_heads=4, dtn_blocks=5, drop_path_rate=0.0),
     "``vit_micro`` built as the DTN code builds its ViTs: the smoke-scale stand-in for them."),
]:
    register_size(_name, _build, _settings, _doc)
