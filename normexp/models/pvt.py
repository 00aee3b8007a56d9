"""PVT v1, the Pyramid Vision Transformer (Wang et al., ICCV 2021, arXiv 2102.12122).

timm has no PVT v1, so this builds it from the paper (Sec. 3, Table 1) with the official code's module names
(whai362/PVT ``classification/pvt.py``). The class token joins in stage 4 only. ``num_heads=(4, 4, 5, 8),
dtn_stages=3`` gives the DTN code's PVT (wqshao126/DTN ``models/pvt_norm.py``): only norm1/norm2 of stages
1..k take the configured normalizer, the other slots keep LayerNorm; by default ``norm=<x>`` fills every
slot. Each stage's layout follows the input size (hooks on the patch-embedding and ``attn.sr`` convs).
``no_weight_decay()`` is the class token only, as in the PVT and DTN code; ``decay_pos_embed=False`` also
exempts the position embeddings. ``pvt_micro`` (the CPU demo) has a 1 px stem patch at 16 px, so stage 4
still has a 2x2 grid.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from timm.layers import DropPath, Mlp, to_2tuple, trunc_normal_, use_fused_attn
from torch import nn

from ..norms.layout import TokenLayout
from .base import CLASSIFICATION, DENSE_FEATURES, Backbone, GridHook, NormContext, vit_init
from .registry import register_size


class PatchEmbed(nn.Module):
    """Non-overlapping patches: Conv2d(kernel = stride = P, bias), flattened, LayerNorm (eps 1e-5)."""

    def __init__(self, patch_size: int, in_chans: int, embed_dim: int) -> None:
        super().__init__()
        self.patch_size = patch_size
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size)
        self.norm = nn.LayerNorm(embed_dim)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
        x = self.proj(x)
        grid = (x.shape[2], x.shape[3])
        return self.norm(x.flatten(2).transpose(1, 2)), grid


class SpatialReductionAttention(nn.Module):
    """SRA (paper Sec. 3.3): full-resolution queries; keys/values from the grid reduced R x R by a conv."""

    def __init__(self, dim: int, num_heads: int, sr_ratio: int = 1, qkv_bias: bool = True,
                 attn_drop: float = 0.0, proj_drop: float = 0.0) -> None:
        super().__init__()
        if dim % num_heads != 0:
            raise ValueError(f"dim {dim} is not divisible by num_heads {num_heads}")
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.scale = self.head_dim ** -0.5
        self.fused_attn = use_fused_attn()
        self.q = nn.Linear(dim, dim, bias=qkv_bias)
        self.kv = nn.Linear(dim, dim * 2, bias=qkv_bias)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)
        self.sr_ratio = sr_ratio
        if sr_ratio > 1:
            self.sr = nn.Conv2d(dim, dim, kernel_size=sr_ratio, stride=sr_ratio)
            self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        b, n, c = x.shape
        q = self.q(x).reshape(b, n, self.num_heads, self.head_dim).transpose(1, 2)
        if self.sr_ratio > 1:  # only grid tokens reach here: stages with a class token have R = 1
            x = x.transpose(1, 2).reshape(b, c, *grid)
            x = self.norm(self.sr(x).flatten(2).transpose(1, 2))
        k, v = self.kv(x).reshape(b, -1, 2, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        if self.fused_attn:
            x = F.scaled_dot_product_attention(q, k, v, dropout_p=self.attn_drop.p if self.training else 0.0)
        else:  # explicit matmuls (FLOP counters see these; on CPU they miss the fused kernel)
            attn = (q * self.scale) @ k.transpose(-2, -1)
            x = self.attn_drop(attn.softmax(dim=-1)) @ v
        return self.proj_drop(self.proj(x.transpose(1, 2).reshape(b, n, c)))


class Block(nn.Module):

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float, sr_ratio: int, qkv_bias: bool = True,
                 proj_drop: float = 0.0, attn_drop: float = 0.0, drop_path: float = 0.0) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = SpatialReductionAttention(dim, num_heads, sr_ratio, qkv_bias, attn_drop, proj_drop)
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), act_layer=nn.GELU, drop=proj_drop)

    def forward(self, x: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        x = x + self.drop_path(self.attn(self.norm1(x), grid))
        return x + self.drop_path(self.mlp(self.norm2(x)))


class PyramidVisionTransformer(Backbone):
    """PVT v1. ``features(x)`` returns the 4 stage maps (NCHW, strides ``feature_strides``)."""

    serves = frozenset({CLASSIFICATION, DENSE_FEATURES})
    config_options = ("in_chans", "drop_path_rate", "num_heads", "dtn_stages")
    residual_scales = ("block[1-4].*.attn", "block[1-4].*.mlp")
    final_norms = ("norm",)

    def __init__(
        self,
        img_size: int | tuple[int, int] = 224,
        patch_size: int = 4,
        in_chans: int = 3,
        num_classes: int = 1000,
        embed_dims: tuple[int, ...] = (64, 128, 320, 512),
        num_heads: tuple[int, ...] = (1, 2, 5, 8),
        mlp_ratios: tuple[float, ...] = (8, 8, 4, 4),
        depths: tuple[int, ...] = (3, 4, 6, 3),
        sr_ratios: tuple[int, ...] = (8, 4, 2, 1),
        qkv_bias: bool = True,
        drop_rate: float = 0.0,
        proj_drop_rate: float = 0.0,
        attn_drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
        dtn_stages: int | None = None,
        decay_pos_embed: bool = True,
    ) -> None:
        super().__init__()
        num_stages = len(depths)
        embed_dims, num_heads, mlp_ratios, sr_ratios = (
            tuple(v) for v in (embed_dims, num_heads, mlp_ratios, sr_ratios))
        if not all(len(v) == num_stages for v in (embed_dims, num_heads, mlp_ratios, sr_ratios)):
            raise ValueError("embed_dims, num_heads, mlp_ratios, sr_ratios, depths: one value per stage")
        if sr_ratios[-1] != 1:
            raise ValueError("the last stage holds the class token, so its sr_ratio must be 1")
        if dtn_stages is not None and not 0 < dtn_stages <= num_stages:
            raise ValueError(f"dtn_stages must be in 1..{num_stages}, got {dtn_stages}")
        self.num_classes, self.in_chans = num_classes, in_chans
        self.num_stages, self.depths = num_stages, tuple(depths)
        self.embed_dims, self.num_heads, self.sr_ratios = embed_dims, num_heads, sr_ratios
        self.num_features = self.head_hidden_size = embed_dims[-1]
        self.num_prefix_tokens = 1
        self.dtn_stages = dtn_stages
        self.decay_pos_embed = decay_pos_embed

        # stage grids at img_size: the position embeddings are built for these
        patch_sizes = (patch_size,) + (2,) * (num_stages - 1)
        grid = to_2tuple(img_size)
        self.grids: list[tuple[int, int]] = []
        for i, p in enumerate(patch_sizes):
            grid = (grid[0] // p, grid[1] // p)
            if min(grid) < max(1, sr_ratios[i]):
                raise ValueError(f"img_size {img_size} gives stage {i + 1} a {grid} grid, smaller than its "
                                 f"sr_ratio {sr_ratios[i]} (or empty): use a larger img_size")
            self.grids.append(grid)
        self.feature_channels = list(embed_dims)
        self.feature_strides = [patch_size * 2 ** i for i in range(num_stages)]

        dpr = torch.linspace(0, drop_path_rate, sum(depths), device="cpu").tolist()  # also on the meta device
        self.block_offsets = [sum(depths[:i]) for i in range(num_stages)]
        in_dim = in_chans
        for i in range(num_stages):
            s = i + 1
            setattr(self, f"patch_embed{s}", PatchEmbed(patch_sizes[i], in_dim, embed_dims[i]))
            num_pos = self.grids[i][0] * self.grids[i][1] + (1 if s == num_stages else 0)
            setattr(self, f"pos_embed{s}", nn.Parameter(torch.zeros(1, num_pos, embed_dims[i])))
            setattr(self, f"pos_drop{s}", nn.Dropout(drop_rate))
            setattr(self, f"block{s}", nn.ModuleList([
                Block(embed_dims[i], num_heads[i], mlp_ratios[i], sr_ratios[i], qkv_bias, proj_drop_rate,
                      attn_drop_rate, dpr[self.block_offsets[i] + j]) for j in range(depths[i])]))
            in_dim = embed_dims[i]
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dims[-1]))
        self.norm = nn.LayerNorm(embed_dims[-1], eps=1e-6)
        self.head_drop = nn.Dropout(drop_rate)
        self.head = nn.Linear(embed_dims[-1], num_classes) if num_classes > 0 else nn.Identity()

        for i in range(num_stages):
            trunc_normal_(getattr(self, f"pos_embed{i + 1}"), std=0.02)
        trunc_normal_(self.cls_token, std=0.02)
        self.apply(vit_init)

        # Token layouts: one per stage for the stage's tokens (the last one with the class token in front)
        # and one per stage for the reduced grid the sr-branch norm sees; hooks keep their grids current.
        self.stage_layouts = [TokenLayout(num_prefix_tokens=int(i == num_stages - 1))
                              for i in range(num_stages)]
        self.sr_layouts = [TokenLayout(num_prefix_tokens=0) for _ in range(num_stages)]
        for i in range(num_stages):
            getattr(self, f"patch_embed{i + 1}").proj.register_forward_hook(GridHook(self.stage_layouts[i]))
            for blk in getattr(self, f"block{i + 1}"):
                if blk.attn.sr_ratio > 1:
                    blk.attn.sr.register_forward_hook(GridHook(self.sr_layouts[i]))
        if dtn_stages is not None:  # the DTN code's placement (pvt_norm.py)
            self.norm_keep = ["patch_embed*", "block*.attn.norm", "norm",
                              *(f"block{s}.*" for s in range(dtn_stages + 1, num_stages + 1))]

    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        if self.decay_pos_embed:  # PVT's (and the DTN code's) exempts the class token only
            return {"cls_token"}
        return {"cls_token", *(f"pos_embed{i + 1}" for i in range(self.num_stages))}

    def get_classifier(self) -> nn.Module:
        return self.head

    def reset_classifier(self, num_classes: int) -> None:
        self.num_classes = num_classes
        self.head = nn.Linear(self.num_features, num_classes) if num_classes > 0 else nn.Identity()

    # ---------------------------------------------------------------- norm slots
    def norm_context(self, name: str) -> NormContext:
        last = self.num_stages - 1
        if m := re.match(r"block(\d+)\.(\d+)\.", name):
            stage, j = int(m.group(1)) - 1, int(m.group(2))
            block = self.block_offsets[stage] + j
            layout = self.sr_layouts[stage] if name.startswith(f"{m.group(0)}attn.norm") \
                else self.stage_layouts[stage]
            prefix = layout.num_prefix_tokens
        elif m := re.match(r"patch_embed(\d+)\.", name):
            stage, block = int(m.group(1)) - 1, None
            layout, prefix = self.stage_layouts[stage], 0  # the class token joins after the patch embedding
        elif name == "norm" or name.startswith("norm."):
            stage, block = last, None
            layout = self.stage_layouts[last]
            prefix = layout.num_prefix_tokens
        else:
            raise ValueError(f"PVT has no norm slot '{name}'")
        return {"block": block, "num_heads": self.num_heads[stage], "layout": layout,
                "num_prefix_tokens": prefix}

    # ---------------------------------------------------------------- forward
    def _pos_embed(self, stage: int, grid: tuple[int, int], class_token: bool) -> torch.Tensor:
        """The stage's position embedding, resized bilinearly when ``grid`` is not the built one."""
        pos = getattr(self, f"pos_embed{stage + 1}")
        prefix = 1 if stage == self.num_stages - 1 else 0
        cls_pos, grid_pos = pos[:, :prefix if class_token else 0], pos[:, prefix:]
        if grid != self.grids[stage]:
            gh, gw = self.grids[stage]
            grid_pos = grid_pos.reshape(1, gh, gw, -1).permute(0, 3, 1, 2)
            grid_pos = F.interpolate(grid_pos, size=grid, mode="bilinear", align_corners=False)
            grid_pos = grid_pos.flatten(2).transpose(1, 2)
        return torch.cat((cls_pos, grid_pos), dim=1)

    def _forward_stages(self, x: torch.Tensor, class_token: bool = True
                        ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(stage-4 tokens before the final norm, the 4 stage maps NCHW)."""
        maps = []
        b = x.shape[0]
        for i in range(self.num_stages):
            s = i + 1
            x, grid = getattr(self, f"patch_embed{s}")(x)
            if class_token and i == self.num_stages - 1:
                x = torch.cat((self.cls_token.expand(b, -1, -1), x), dim=1)
            x = getattr(self, f"pos_drop{s}")(x + self._pos_embed(i, grid, class_token))
            for blk in getattr(self, f"block{s}"):
                x = blk(x, grid)
            tokens = x
            x = x[:, -grid[0] * grid[1]:].transpose(1, 2).reshape(b, -1, *grid)
            maps.append(x)
        return tokens, maps

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self._forward_stages(x)[0])

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        x = self.head_drop(x[:, 0])
        return x if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))

    def features(self, x: torch.Tensor) -> list[torch.Tensor]:
        """The 4 stage maps, NCHW, as PVT's detection backbone (whai362/PVT ``detection/pvt.py``) runs them:
        without the class token and without the final norm."""
        return self._forward_stages(x, class_token=False)[1]


for _name, _settings, _doc in [
    ("pvt_micro", dict(img_size=16, patch_size=1, embed_dims=(32, 64, 160, 256), depths=(1, 1, 1, 1),
                       sr_ratios=(4, 2, 1, 1)), "The CPU member: 16 px, 1 px patches, one block a stage."),
    ("pvt_tiny", dict(depths=(2, 2, 2, 2)), "PVT-Tiny (Table 1)."),
    ("pvt_small", dict(depths=(3, 4, 6, 3)), "PVT-Small (Table 1)."),
    ("pvt_medium", dict(depths=(3, 4, 18, 3)), "PVT-Medium (Table 1)."),
    ("pvt_large", dict(depths=(3, 8, 27, 3)), "PVT-Large (Table 1)."),
]:
    register_size(_name, PyramidVisionTransformer, _settings, _doc)
