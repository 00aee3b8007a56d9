"""DiT, the class-conditional diffusion Transformer (Peebles & Xie 2023, arXiv 2212.09748), as
facebookresearch/DiT ``models.py`` builds and initialises it; parameter names are DiT's, so its released
checkpoints load. Its norm slots are affine-free (adaLN supplies shift and scale), so DyT there is the bare
``tanh(alpha x)`` of DyT's DiT patch.

``zero_init``: ``"all"`` (DiT's adaLN-Zero), ``"blocks"`` (Derf's ``DiT/models.py``: the final layer's
dropped) or ``"none"`` (DyT App. A, ``dynamic-tanh.patch``); a normalizer suggests its paper's recipe
(``norm.model_defaults``). Sizes ``dit_s2`` ... ``dit_xl8``; ``dit_micro`` is the CPU member.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from timm.layers import Mlp, PatchEmbed
from timm.models.vision_transformer import Attention
from torch import nn

from ..norms.layout import TokenLayout
from .base import DIFFUSION, NormContext
from .positions import sincos_2d
from .registry import register_size

ZERO_INITS = ("all", "blocks", "none")


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """adaLN: ``x * (1 + scale) + shift``, one (shift, scale) per sample broadcast over its tokens."""
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


def timestep_frequencies(t: torch.Tensor, dim: int = 256, max_period: float = 10_000.0) -> torch.Tensor:
    """[cos(t f_i), sin(t f_i)] (DiT's ``timestep_embedding``); ``t`` may be fractional."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t[:, None].float() * freqs[None]
    embedding = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    return torch.cat([embedding, torch.zeros_like(embedding[:, :1])], dim=-1) if dim % 2 else embedding


class TimestepEmbedder(nn.Module):
    """Sinusoidal frequencies of the step through Linear - SiLU - Linear."""

    def __init__(self, hidden: int, frequencies: int = 256) -> None:
        super().__init__()
        self.frequencies = frequencies
        self.mlp = nn.Sequential(nn.Linear(frequencies, hidden), nn.SiLU(), nn.Linear(hidden, hidden))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return self.mlp(timestep_frequencies(t, self.frequencies))


class LabelEmbedder(nn.Module):
    """Class embedding with a null class (index ``num_classes``) replacing labels with probability
    ``dropout``."""

    def __init__(self, num_classes: int, hidden: int, dropout: float) -> None:
        super().__init__()
        self.num_classes, self.dropout = num_classes, dropout
        self.embedding_table = nn.Embedding(num_classes + (dropout > 0), hidden)

    def forward(self, labels: torch.Tensor) -> torch.Tensor:
        if self.training and self.dropout > 0:
            drop = torch.rand(labels.shape[0], device=labels.device) < self.dropout
            labels = torch.where(drop, self.num_classes, labels)
        return self.embedding_table(labels)


class DiTBlock(nn.Module):
    """Pre-norm attention and MLP with adaLN-Zero shift, scale and gate from the conditioning."""

    def __init__(self, hidden: int, heads: int, mlp_ratio: float) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.attn = Attention(hidden, num_heads=heads, qkv_bias=True)
        self.norm2 = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.mlp = Mlp(hidden, int(hidden * mlp_ratio), act_layer=lambda: nn.GELU(approximate="tanh"))
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 6 * hidden))

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift1, scale1, gate1, shift2, scale2, gate2 = self.adaLN_modulation(c).chunk(6, dim=1)
        x = x + gate1.unsqueeze(1) * self.attn(modulate(self.norm1(x), shift1, scale1))
        return x + gate2.unsqueeze(1) * self.mlp(modulate(self.norm2(x), shift2, scale2))


class FinalLayer(nn.Module):
    """Modulated norm, then each token to its patch's outputs."""

    def __init__(self, hidden: int, patch: int, out_channels: int) -> None:
        super().__init__()
        self.norm_final = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(hidden, patch * patch * out_channels)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 2 * hidden))

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=1)
        return self.linear(modulate(self.norm_final(x), shift, scale))


class DiT(nn.Module):
    """``forward(x, t, y)``: noisy inputs (B, C, H, W), steps (B,), labels (B,) -> (B, 2C or C, H, W).
    ``input_size``: H = W of what it denoises (DiT's name: the latent size, 32 for 256 px images)."""

    serves = frozenset({DIFFUSION})
    residual_scales = ("blocks.*.attn", "blocks.*.mlp")  # before adaLN's gates

    config_options = ("hidden_size", "depth", "num_heads", "patch_size", "mlp_ratio", "class_dropout",
                      "learn_sigma")

    def __init__(self, input_size: int = 32, patch_size: int = 2, in_chans: int = 4, hidden_size: int = 1152,
                 depth: int = 28, num_heads: int = 16, mlp_ratio: float = 4.0, class_dropout: float = 0.1,
                 num_classes: int = 1000, learn_sigma: bool = True, zero_init: str = "all") -> None:
        super().__init__()
        if zero_init not in ZERO_INITS:
            raise ValueError(f"zero_init must be one of {ZERO_INITS}, got '{zero_init}'")
        if input_size % patch_size:
            raise ValueError(f"the input size {input_size} is not a multiple of the patch {patch_size}")
        self.in_chans, self.patch, self.num_classes = in_chans, patch_size, num_classes
        self.out_chans = in_chans * 2 if learn_sigma else in_chans
        self.learn_sigma, self.zero_init = learn_sigma, zero_init
        self.branches_start_closed = zero_init in ("all", "blocks")  # adaLN-Zero: see norms/normfree.py
        self.x_embedder = PatchEmbed(input_size, patch_size, in_chans, hidden_size, bias=True)
        self.grid = self.x_embedder.grid_size
        self.t_embedder = TimestepEmbedder(hidden_size)
        self.y_embedder = LabelEmbedder(num_classes, hidden_size, class_dropout)
        # fixed, and a parameter as in DiT's models.py (its count includes it; released checkpoints load)
        self.pos_embed = nn.Parameter(torch.zeros(1, self.grid[0] * self.grid[1], hidden_size),
                                      requires_grad=False)
        self.blocks = nn.ModuleList(DiTBlock(hidden_size, num_heads, mlp_ratio) for _ in range(depth))
        self.final_layer = FinalLayer(hidden_size, patch_size, self.out_chans)
        self.token_layout = TokenLayout(grid=tuple(self.grid), num_prefix_tokens=0)
        self.initialize_weights()

    def initialize_weights(self) -> None:
        """DiT's ``initialize_weights``, with the zero-init of ``self.zero_init``."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        if self.pos_embed.device.type != "meta":
            self.pos_embed.copy_(sincos_2d(self.pos_embed.shape[-1], self.grid, cls_token=False))
        proj = self.x_embedder.proj
        nn.init.xavier_uniform_(proj.weight.view(proj.weight.shape[0], -1))  # as a linear layer
        nn.init.zeros_(proj.bias)
        nn.init.normal_(self.y_embedder.embedding_table.weight, std=0.02)
        nn.init.normal_(self.t_embedder.mlp[0].weight, std=0.02)
        nn.init.normal_(self.t_embedder.mlp[2].weight, std=0.02)
        zeroed = []
        if self.zero_init in ("all", "blocks"):
            zeroed += [block.adaLN_modulation[-1] for block in self.blocks]
        if self.zero_init == "all":
            zeroed += [self.final_layer.adaLN_modulation[-1], self.final_layer.linear]
        for layer in zeroed:
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    def norm_context(self, name: str) -> NormContext:
        block = int(name.split(".")[1]) if name.startswith("blocks.") else None
        return {"block": block, "num_heads": self.blocks[0].attn.num_heads, "layout": self.token_layout,
                "num_prefix_tokens": 0, "pooled": False}

    def unpatchify(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, p*p*C) patch outputs -> (B, C, H, W)."""
        (h, w), p = self.grid, self.patch
        x = x.reshape(x.shape[0], h, w, p, p, self.out_chans)
        return x.permute(0, 5, 1, 3, 2, 4).reshape(x.shape[0], self.out_chans, h * p, w * p)

    def forward(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = self.x_embedder(x) + self.pos_embed
        c = self.t_embedder(t) + self.y_embedder(y)
        for block in self.blocks:
            x = block(x, c)
        return self.unpatchify(self.final_layer(x, c))

    def no_weight_decay(self) -> set[str]:
        return set()


SIZES: dict[str, dict[str, Any]] = {
    "s": {"hidden_size": 384, "depth": 12, "num_heads": 6},
    "b": {"hidden_size": 768, "depth": 12, "num_heads": 12},
    "l": {"hidden_size": 1024, "depth": 24, "num_heads": 16},
    "xl": {"hidden_size": 1152, "depth": 28, "num_heads": 16},
}


for _size in SIZES:
    for _patch in (2, 4, 8):
        register_size(f"dit_{_size}{_patch}", DiT, {**SIZES[_size], "patch_size": _patch},
                      f"DiT-{_size.upper()}/{_patch} (Peebles & Xie 2023, Table 1).")
register_size("dit_micro", DiT, {"hidden_size": 96, "depth": 4, "num_heads": 4, "patch_size": 2},
              "The CPU member: DiT's architecture at 96 wide, 4 blocks, 4 heads, 2 px patches.")
