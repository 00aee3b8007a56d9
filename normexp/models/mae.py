"""Masked autoencoder (He et al. 2022, arXiv 2111.06377) around a normexp ViT: what facebookresearch/mae
``models_mae.py`` computes (random masking, sin-cos embeddings, the decoder, the masked MSE with
``norm_pix_loss``, MAE's init), written from the paper and that file's behaviour. Every norm slot of encoder
and decoder goes through the placement, as DyT's MAE patch does with ``convert_ln_to_dyt``; the encoder's
layout carries the visible tokens' grid positions (``TokenLayout.positions``).
"""

from __future__ import annotations

from functools import partial

import torch
from timm.models.vision_transformer import Block
from torch import nn

from ..norms.layout import TokenLayout
from .base import NormContext
from .positions import sincos_2d


# ---------------------------------------------------------------- patches and masks
def patchify(images: torch.Tensor, patch: int) -> torch.Tensor:
    """(N, C, H, W) -> (N, L, patch * patch * C), patches in raster order, pixels row-major, channels last."""
    n, c, h, w = images.shape
    x = images.reshape(n, c, h // patch, patch, w // patch, patch)
    return torch.einsum("nchpwq->nhwpqc", x).reshape(n, (h // patch) * (w // patch), patch * patch * c)


def unpatchify(patches: torch.Tensor, patch: int, grid: tuple[int, int]) -> torch.Tensor:
    """The inverse of :func:`patchify` for a ``grid`` of (rows, columns) patches."""
    n, _, d = patches.shape
    c = d // (patch * patch)
    x = patches.reshape(n, *grid, patch, patch, c)
    return torch.einsum("nhwpqc->nchpwq", x).reshape(n, c, grid[0] * patch, grid[1] * patch)


def random_masking(x: torch.Tensor, mask_ratio: float, noise: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """MAE's ``random_masking`` by sorting ``noise`` (N, L): (kept tokens, mask (1 = masked), ids_restore,
    ids_keep)."""
    n, length, d = x.shape
    keep = int(length * (1 - mask_ratio))
    if noise is None:
        noise = torch.rand(n, length, device=x.device)
    ids_shuffle = torch.argsort(noise, dim=1)  # ascending: small noise is kept
    ids_restore = torch.argsort(ids_shuffle, dim=1)
    ids_keep = ids_shuffle[:, :keep]
    kept = torch.gather(x, 1, ids_keep[..., None].expand(-1, -1, d))
    mask = torch.ones(n, length, device=x.device)
    mask[:, :keep] = 0
    return kept, torch.gather(mask, 1, ids_restore), ids_restore, ids_keep


def patch_targets(images: torch.Tensor, patch: int, norm_pix_loss: bool) -> torch.Tensor:
    """What the decoder predicts: the pixels of each patch, standardised per patch with ``norm_pix_loss``."""
    target = patchify(images, patch)
    if norm_pix_loss:
        mean, var = target.mean(dim=-1, keepdim=True), target.var(dim=-1, keepdim=True)
        target = (target - mean) / (var + 1.0e-6) ** 0.5
    return target


def masked_loss(prediction: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean squared error per patch, averaged over the masked patches only."""
    per_patch = (prediction - target).pow(2).mean(dim=-1)
    return (per_patch * mask).sum() / mask.sum()


# ---------------------------------------------------------------- the model
class MaskedAutoencoder(nn.Module):
    """MAE around ``encoder`` (a normexp ViT built without a head)."""

    residual_scales = ("decoder_blocks.*.attn", "decoder_blocks.*.mlp")  # the encoder declares its own
    final_norms = ("decoder_norm",)

    def __init__(self, encoder: nn.Module, decoder_dim: int = 512, decoder_depth: int = 8,
                 decoder_heads: int = 16, mask_ratio: float = 0.75, norm_pix_loss: bool = True,
                 mlp_ratio: float = 4.0) -> None:
        super().__init__()
        if not 0 < mask_ratio < 1:
            raise ValueError(f"mask_ratio must be in (0, 1), got {mask_ratio}")
        needed = ("patch_embed", "cls_token", "pos_embed", "blocks", "norm", "token_layout")
        if any(getattr(encoder, attr, None) is None for attr in needed):
            raise ValueError(f"{type(encoder).__name__} is no ViT with a class token (the MAE encoder needs "
                             f"{', '.join(needed)}): use a vit_* backbone")
        if decoder_dim % decoder_heads:
            raise ValueError(f"decoder_heads={decoder_heads} must divide decoder_dim={decoder_dim}")
        self.encoder, self.mask_ratio, self.norm_pix_loss = encoder, mask_ratio, norm_pix_loss
        self.decoder_heads = decoder_heads
        self.patch = encoder.patch_embed.patch_size[0]
        self.grid = tuple(encoder.patch_embed.grid_size)
        self.with_cls_position = not encoder.no_embed_class
        dim = encoder.embed_dim
        encoder.pos_embed.requires_grad_(False)  # fixed sin-cos, as MAE's
        self.decoder_embed = nn.Linear(dim, decoder_dim)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, decoder_dim))
        self.decoder_pos_embed = nn.Parameter(torch.zeros(1, 1 + self.grid[0] * self.grid[1], decoder_dim),
                                              requires_grad=False)
        norm_layer = partial(nn.LayerNorm, eps=1e-6)
        self.decoder_blocks = nn.ModuleList(
            Block(decoder_dim, decoder_heads, mlp_ratio, qkv_bias=True, norm_layer=norm_layer)
            for _ in range(decoder_depth))
        self.decoder_norm = norm_layer(decoder_dim)
        channels = encoder.patch_embed.proj.in_channels
        self.decoder_pred = nn.Linear(decoder_dim, self.patch * self.patch * channels)
        self.decoder_layout = TokenLayout(num_prefix_tokens=1)
        self.norm_keep = [f"encoder.{pattern}" for pattern in getattr(encoder, "norm_keep", ())]
        self.initialize_weights()

    @torch.no_grad()
    def initialize_weights(self) -> None:
        enc = self.encoder
        enc.pos_embed.copy_(sincos_2d(enc.embed_dim, self.grid, self.with_cls_position))
        self.decoder_pos_embed.copy_(sincos_2d(self.decoder_pos_embed.shape[-1], self.grid, True))
        weight = enc.patch_embed.proj.weight
        nn.init.xavier_uniform_(weight.view(weight.shape[0], -1))
        nn.init.normal_(enc.cls_token, std=0.02)
        nn.init.normal_(self.mask_token, std=0.02)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)

    # ------------------------------------------------------------ the contract of a model with norm slots
    def get_classifier(self) -> nn.Module:
        """The output layer (the pixel prediction): what a method's rule for a model's last layer takes."""
        return self.decoder_pred

    def norm_context(self, name: str) -> NormContext:
        """The encoder's slots: its context; the decoder's: outside any encoder block, on the full grid."""
        if name.startswith("encoder."):
            return self.encoder.norm_context(name.removeprefix("encoder."))
        return {"block": None, "num_heads": self.decoder_heads, "layout": self.decoder_layout,
                "num_prefix_tokens": 1, "pooled": False}

    def no_weight_decay(self) -> set[str]:
        """The frozen position embeddings (the class and mask tokens are decayed, as in MAE)."""
        return {"encoder.pos_embed", "decoder_pos_embed"}

    # ------------------------------------------------------------ forward
    def forward_encoder(self, images: torch.Tensor, noise: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(class token + visible tokens, encoded (N, 1 + keep, D); mask (N, L); ids_restore (N, L))."""
        enc = self.encoder
        x = enc.patch_embed(images)  # sets the layouts' grid (every token present)
        x = x.flatten(1, 2) if x.dim() == 4 else x
        pos = enc.pos_embed
        x = x + (pos[:, 1:] if self.with_cls_position else pos)
        x, mask, ids_restore, ids_keep = random_masking(x, self.mask_ratio, noise)
        cls = enc.cls_token + (pos[:, :1] if self.with_cls_position else 0)
        cls = cls.expand(x.shape[0], -1, -1)
        layouts = {id(layout): layout for layout in (enc.token_layout, getattr(enc, "grid_layout", None))
                   if layout is not None}
        for layout in layouts.values():
            layout.positions = ids_keep
        try:
            late = getattr(enc, "dtn_blocks", None)
            if late is None:
                x = enc.blocks(enc.norm_pre(torch.cat([cls, x], dim=1)))
            else:  # the class token joins before block `late`, as in the classifier
                x = enc.blocks[late:](torch.cat([cls, enc.blocks[:late](enc.norm_pre(x))], dim=1))
            x = enc.norm(x)
        finally:
            for layout in layouts.values():
                layout.positions = None
        return x, mask, ids_restore

    def forward_decoder(self, x: torch.Tensor, ids_restore: torch.Tensor) -> torch.Tensor:
        x = self.decoder_embed(x)
        n, length = ids_restore.shape
        tokens = torch.cat([x[:, 1:], self.mask_token.expand(n, length - x.shape[1] + 1, -1)], dim=1)
        tokens = torch.gather(tokens, 1, ids_restore[..., None].expand(-1, -1, x.shape[2]))  # unshuffle
        x = torch.cat([x[:, :1], tokens], dim=1) + self.decoder_pos_embed
        self.decoder_layout.set_grid(*self.grid)
        for block in self.decoder_blocks:
            x = block(x)
        return self.decoder_pred(self.decoder_norm(x))[:, 1:]

    def forward(self, images: torch.Tensor, noise: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(loss, predicted patches, mask); ``noise`` (N, L) fixes the masks (else drawn uniformly)."""
        latent, mask, ids_restore = self.forward_encoder(images, noise)
        prediction = self.forward_decoder(latent, ids_restore)
        return masked_loss(prediction, patch_targets(images, self.patch, self.norm_pix_loss), mask), \
            prediction, mask

    def reconstruct(self, images: torch.Tensor, prediction: torch.Tensor) -> torch.Tensor:
        """Images from predicted patches (undoing ``norm_pix_loss`` with each patch's own statistics)."""
        if self.norm_pix_loss:
            target = patchify(images, self.patch)
            mean, var = target.mean(dim=-1, keepdim=True), target.var(dim=-1, keepdim=True)
            prediction = prediction * (var + 1.0e-6) ** 0.5 + mean
        return unpatchify(prediction, self.patch, self.grid)
