"""T2T-ViT (Yuan et al., ICCV 2021, arXiv 2101.11986).

timm has no T2T-ViT and the official code (yitu-opensource/T2T-ViT) is under the Clear BSD licence, so this is
a clean-room implementation from the paper (Sec. 3, Table 1); its parameter counts equal the official ones for
both T2T layer types (Performer, paper Sec. 3.1, and Transformer, the T2T-ViT_t models). The fixed sinusoidal
position table is a frozen Parameter (the README counts it) and is recomputed, not interpolated, at another
input size; soft splits use their actual output grids, so non-square inputs work.

Norm slots (``norm_context``): ``tokens_to_token.layers.{i}.norm1/norm2`` have ``block`` i, one head and the
layout of layer i's grid; ``blocks.{j}.norm1/norm2`` have ``block`` j + 2, the backbone's heads and layout
(class token + grid); the final norm has ``block`` None. Each soft split owns and updates its layout, so
``norm_keep`` is empty. ``pyramid_scales`` adds ViTDet's simple feature pyramid to ``features(x)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from timm.layers import Mlp, trunc_normal_, use_fused_attn
from timm.models.vision_transformer import Block
from torch import nn

from ..norms.layout import TokenLayout
from .base import NormContext, PlainBackbone, vit_init
from .pyramid import SimpleFeaturePyramid
from .registry import register_size

# (kernel, stride, padding) of the three soft splits (paper Sec. 3.1)
PUBLISHED_SOFT_SPLIT = ((7, 4, 2), (3, 2, 1), (3, 2, 1))
MICRO_SOFT_SPLIT = ((3, 1, 1), (3, 2, 1), (3, 1, 1))


def sinusoid_table(num_tokens: int, dim: int, device: torch.device | None = None,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(1, num_tokens, dim) sin/cos table, base 10000 (Vaswani et al.)."""
    pos = torch.arange(num_tokens, device=device, dtype=torch.float64)[:, None]
    chan = torch.arange(dim, device=device)
    angle = pos / torch.pow(10000.0, (2 * (chan // 2)).double() / dim)
    table = torch.where(chan % 2 == 0, torch.sin(angle), torch.cos(angle))
    return table.to(dtype)[None]


class SoftSplit(nn.Unfold):
    """Overlapping soft split (paper Sec. 3.1): (B, C, H, W) -> (B, h*w, C*k*k); sets its layout's grid."""

    def __init__(self, kernel_size: int, stride: int, padding: int, layout: TokenLayout) -> None:
        super().__init__(kernel_size, stride=stride, padding=padding)
        self.k, self.s, self.p = kernel_size, stride, padding
        self.layout = layout  # shared with the norms that see these tokens; plain object, not a submodule
        self.register_forward_pre_hook(self._track_grid)

    def out_grid(self, height: int, width: int) -> tuple[int, int]:
        return ((height + 2 * self.p - self.k) // self.s + 1, (width + 2 * self.p - self.k) // self.s + 1)

    def _track_grid(self, _module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        self.layout.set_grid(*self.out_grid(*args[0].shape[-2:]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x).transpose(1, 2)


class PerformerT2TLayer(nn.Module):
    """Performer T2T layer (paper Sec. 3.1): single-head linear attention, residual from v, then LN + MLP."""

    def __init__(self, in_dim: int, dim: int = 64, mlp_ratio: float = 1.0, kernel_ratio: float = 0.5,
                 drop: float = 0.1) -> None:
        super().__init__()
        self.dim, self.num_heads = dim, 1
        self.norm1 = nn.LayerNorm(in_dim)
        self.kqv = nn.Linear(in_dim, 3 * dim)  # with bias, split k, q, v
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(drop)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), dim, drop=(0.0, drop))  # dropout after the MLP only
        m = int(dim * kernel_ratio)
        # Frozen random features, kept as a Parameter as published (counted, saved in the state dict).
        self.w = nn.Parameter(nn.init.orthogonal_(torch.empty(m, dim)) * math.sqrt(m), requires_grad=False)

    def feature_map(self, x: torch.Tensor) -> torch.Tensor:
        """phi(x) = exp(w x - |x|^2 / 2) / sqrt(m)."""
        m = self.w.shape[0]
        return torch.exp(x @ self.w.t() - 0.5 * x.square().sum(-1, keepdim=True)) / math.sqrt(m)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        k, q, v = self.kqv(x).chunk(3, dim=-1)
        with torch.autocast(device_type=x.device.type, enabled=False):  # exp and the ratio in float32
            k, q, vf = k.float(), q.float(), v.float()
            qp, kp = self.feature_map(q), self.feature_map(k)  # (B, N, m)
            denom = qp @ kp.sum(dim=1, keepdim=True).transpose(1, 2)  # (B, N, 1)
            y = (qp @ (kp.transpose(1, 2) @ vf)) / (denom + 1e-8)
        return v + self.proj_drop(self.proj(y.to(v.dtype)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TransformerT2TLayer(nn.Module):
    """Transformer T2T layer (T2T-ViT_t): softmax attention scaled by ``in_dim ** -0.5`` as published."""

    def __init__(self, in_dim: int, dim: int = 64, mlp_ratio: float = 1.0) -> None:
        super().__init__()
        self.dim, self.num_heads = dim, 1
        self.scale = in_dim ** -0.5
        self.norm1 = nn.LayerNorm(in_dim)
        self.qkv = nn.Linear(in_dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), dim)
        self.fused_attn = use_fused_attn()  # timm's switch, as in its Attention (explicit matmuls if off)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        if self.fused_attn:
            y = F.scaled_dot_product_attention(q, k, v, scale=self.scale)
        else:
            y = ((q * self.scale) @ k.transpose(-2, -1)).softmax(dim=-1) @ v
        x = v + self.proj(y)
        return x + self.mlp(self.norm2(x))


class TokensToToken(nn.Module):

    def __init__(self, in_chans: int, embed_dim: int, layouts: Sequence[TokenLayout],
                 soft_split: Sequence[Sequence[int]] = PUBLISHED_SOFT_SPLIT, token_dim: int = 64,
                 tokens_type: str = "performer", mlp_ratio: float = 1.0, kernel_ratio: float = 0.5,
                 drop: float = 0.1) -> None:
        super().__init__()
        if len(soft_split) != 3 or len(layouts) != 3:
            raise ValueError("T2T needs three soft splits (kernel, stride, padding) and three layouts")
        splits = [SoftSplit(*kps, layout) for kps, layout in zip(soft_split, layouts, strict=True)]
        self.soft_splits = nn.ModuleList(splits)
        in_dims = [in_chans * soft_split[0][0] ** 2, token_dim * soft_split[1][0] ** 2]
        if tokens_type == "performer":
            layers = [PerformerT2TLayer(d, token_dim, mlp_ratio, kernel_ratio, drop) for d in in_dims]
        elif tokens_type == "transformer":
            layers = [TransformerT2TLayer(d, token_dim, mlp_ratio) for d in in_dims]
        else:
            raise ValueError(f"tokens_type must be 'performer' or 'transformer', got '{tokens_type}'")
        self.layers = nn.ModuleList(layers)
        self.project = nn.Linear(token_dim * soft_split[2][0] ** 2, embed_dim)
        self.stride = math.prod(s for _, s, _ in soft_split)

    def out_grid(self, height: int, width: int) -> tuple[int, int]:
        for split in self.soft_splits:
            height, width = split.out_grid(height, width)
        return height, width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for split, layer in zip(self.soft_splits[:-1], self.layers, strict=True):
            h, w = split.out_grid(*x.shape[-2:])
            x = layer(split(x))  # (B, h*w, token_dim)
            x = x.transpose(1, 2).reshape(x.shape[0], -1, h, w)  # re-structurise to a map
        return self.project(self.soft_splits[-1](x))


class T2TViT(PlainBackbone):
    """T2T-ViT: the tokens-to-token module, then a class-token ViT with a fixed sinusoidal position table."""

    residual_scales = ("blocks.*.attn", "blocks.*.mlp")  # the ViT blocks (the T2T layers keep theirs)
    final_norms = ("norm",)
    config_options = ("in_chans", "drop_path_rate", "tokens_type", "soft_split")

    def __init__(
        self,
        img_size: int = 224,
        in_chans: int = 3,
        num_classes: int = 1000,
        embed_dim: int = 384,
        depth: int = 14,
        num_heads: int = 6,
        mlp_ratio: float = 3.0,
        qkv_bias: bool = False,
        tokens_type: str = "performer",
        token_dim: int = 64,
        token_mlp_ratio: float = 1.0,
        kernel_ratio: float = 0.5,
        t2t_drop_rate: float = 0.1,
        soft_split: Sequence[Sequence[int]] = PUBLISHED_SOFT_SPLIT,
        drop_rate: float = 0.0,
        attn_drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
        pyramid_scales: Sequence[float] | None = None,
    ) -> None:
        super().__init__()
        self.num_classes, self.embed_dim, self.num_heads = num_classes, embed_dim, num_heads
        self.num_features = embed_dim
        self.num_prefix_tokens = 1
        self.tokens_type = tokens_type
        # One layout per grid: the two T2T layers' grids (no prefix) and the backbone's (class token first).
        self.t2t_layouts = [TokenLayout(num_prefix_tokens=0), TokenLayout(num_prefix_tokens=0)]
        self.token_layout = TokenLayout(num_prefix_tokens=1)
        # T2T layers: the published hard-coded dropout applies to the Performer only
        self.tokens_to_token = TokensToToken(
            in_chans, embed_dim, [*self.t2t_layouts, self.token_layout], soft_split, token_dim, tokens_type,
            token_mlp_ratio, kernel_ratio, t2t_drop_rate)
        self.stride = self.tokens_to_token.stride
        grid = self.tokens_to_token.out_grid(img_size, img_size)

        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        # Fixed table held as a frozen Parameter, as published: the README's counts include it.
        self.pos_embed = nn.Parameter(sinusoid_table(grid[0] * grid[1] + 1, embed_dim), requires_grad=False)
        self.pos_drop = nn.Dropout(drop_rate)
        dpr = [drop_path_rate * i / max(depth - 1, 1) for i in range(depth)]  # linspace, meta-device safe
        self.blocks = nn.Sequential(*[
            Block(embed_dim, num_heads, mlp_ratio, qkv_bias=qkv_bias, proj_drop=drop_rate,
                  attn_drop=attn_drop_rate, drop_path=dpr[i], norm_layer=nn.LayerNorm)
            for i in range(depth)])
        self.norm = nn.LayerNorm(embed_dim)
        self.head = nn.Linear(embed_dim, num_classes) if num_classes > 0 else nn.Identity()

        trunc_normal_(self.cls_token, std=0.02)
        self.apply(vit_init)
        self.pyramid = None
        self.feature_channels, self.feature_strides = [], []
        if pyramid_scales is not None:
            self.pyramid = SimpleFeaturePyramid(embed_dim, self.stride, tuple(pyramid_scales))
            self.feature_channels, self.feature_strides = self.pyramid.channels, self.pyramid.strides

    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        return {"cls_token", "pos_embed"}

    def norm_context(self, name: str) -> NormContext:
        parts = name.split(".")
        num_t2t = len(self.tokens_to_token.layers)
        if name.startswith("tokens_to_token.layers."):
            i = int(parts[2])
            block, num_heads, layout = i, self.tokens_to_token.layers[i].num_heads, self.t2t_layouts[i]
        elif name.startswith("blocks."):
            j = int(parts[1])
            block, num_heads, layout = num_t2t + j, self.blocks[j].attn.num_heads, self.token_layout
        else:  # final norm, pyramid: nearest stage is the backbone
            block, num_heads, layout = None, self.num_heads, self.token_layout
        return {"block": block, "num_heads": num_heads, "layout": layout,
                "num_prefix_tokens": layout.num_prefix_tokens}

    def _pos_embed(self, num_tokens: int, x: torch.Tensor) -> torch.Tensor:
        if num_tokens == self.pos_embed.shape[1]:
            return self.pos_embed
        # Another input size: the table a model built for this size holds (fixed, not interpolated).
        return sinusoid_table(num_tokens, self.embed_dim, x.device, x.dtype)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        x = self.tokens_to_token(x)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        x = self.pos_drop(x + self._pos_embed(x.shape[1], x))
        x = self.blocks(x)
        return self.norm(x)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        x = x[:, 0]
        return x if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))


# T2T-ViT main.py's drop path, 0.1 for every size (the micro member has none)
T2T = {"drop_path_rate": 0.1}

for _name, _settings, _doc in [
    ("t2t_vit_micro", dict(img_size=16, soft_split=MICRO_SOFT_SPLIT, token_dim=32, embed_dim=96, depth=4,
                           num_heads=4, mlp_ratio=2.0),
     "The CPU member: 16 px, soft splits (3,1,1), (3,2,1), (3,1,1) -> 16x16, 8x8, 8x8 tokens (stride 2)."),
    ("t2t_vit_7", dict(T2T, embed_dim=256, depth=7, num_heads=4, mlp_ratio=2.0), "T2T-ViT-7."),
    ("t2t_vit_10", dict(T2T, embed_dim=256, depth=10, num_heads=4, mlp_ratio=2.0), "T2T-ViT-10."),
    ("t2t_vit_12", dict(T2T, embed_dim=256, depth=12, num_heads=4, mlp_ratio=2.0), "T2T-ViT-12."),
    ("t2t_vit_14", dict(T2T, embed_dim=384, depth=14, num_heads=6, mlp_ratio=3.0), "T2T-ViT-14."),
    ("t2t_vit_19", dict(T2T, embed_dim=448, depth=19, num_heads=7, mlp_ratio=3.0), "T2T-ViT-19."),
    ("t2t_vit_24", dict(T2T, embed_dim=512, depth=24, num_heads=8, mlp_ratio=3.0), "T2T-ViT-24."),
]:
    register_size(_name, T2TViT, _settings, _doc)
