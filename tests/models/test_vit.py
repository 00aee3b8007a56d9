"""ViT sizes, the DTN paper's head-count variants and its late-class-token layout."""

from __future__ import annotations

import pytest
import torch
from conftest import compose_cfg
from torch import nn

from normexp.models import build_backbone, create_model
from normexp.norms import norm_layer_factory, replace_norms
from normexp.norms.dtn import DTN


def millions(model: nn.Module) -> float:
    return round(sum(p.numel() for p in model.parameters()) / 1e6, 1)


@pytest.mark.parametrize("name,dtn_blocks,paper", [
    ("vit_tiny", None, 5.7), ("vit_small", None, 22.1), ("vit_base", None, 86.6),
    ("vit_tiny_star", 10, 5.7), ("vit_small_star", 10, 27.8), ("vit_base_star", 10, 86.5),
])
def test_parameter_counts_match_the_papers(name, dtn_blocks, paper):
    """DeiT's counts for the DeiT sizes, the DTN paper's for the starred ones (224 px, 1000 classes)."""
    model = create_model(name, num_classes=1000, img_size=224, dtn_blocks=dtn_blocks)
    print(f"{name}: ours {millions(model)}M, paper {paper}M")
    assert millions(model) == paper


@pytest.mark.parametrize("name", ["vit_tiny_star", "vit_small_star", "vit_base_star"])
def test_dtn_adds_exactly_6h_per_replaced_layer(name):
    ln = create_model(name, num_classes=1000, img_size=224, dtn_blocks=10)
    dtn = create_model(name, num_classes=1000, img_size=224, dtn_blocks=10)
    replaced = replace_norms(dtn, norm_layer_factory("dtn"))
    heads = ln.blocks[0].attn.num_heads
    assert len(replaced) == 20  # norm1 and norm2 of blocks 0-9
    extra = sum(p.numel() for p in dtn.parameters()) - sum(p.numel() for p in ln.parameters())
    assert extra == 6 * heads * len(replaced)


def test_dtn_blocks_layout_puts_dtn_first_and_the_class_token_late():
    cfg = compose_cfg("norm=dtn", "backbone.dtn_blocks=4")
    model = build_backbone(cfg.backbone, cfg.norm)
    kinds = [type(b.norm1).__name__ for b in model.blocks]
    assert kinds == ["DTN"] * 4 + ["LayerNorm"] * 2 and isinstance(model.norm, nn.LayerNorm)
    assert model.pos_embed.shape[1] == 64  # grid tokens only: the class token joins at block 4
    seen = []
    for block in model.blocks:
        block.register_forward_hook(lambda m, args, out: seen.append(args[0].shape[1]))
    model(torch.randn(2, 3, 16, 16)).sum().backward()
    assert seen == [64] * 4 + [65] * 2


def test_dtn_in_every_block_gives_the_class_token_ln_statistics():
    cfg = compose_cfg("norm=dtn")
    model = build_backbone(cfg.backbone, cfg.norm)
    assert all(isinstance(b.norm1, DTN) and isinstance(b.norm2, DTN) for b in model.blocks)
    assert isinstance(model.norm, DTN)
    out = model(torch.randn(2, 3, 16, 16))
    assert out.shape == (2, 10) and torch.isfinite(out).all()


def test_the_grid_follows_the_input_size():
    model = create_model("vit_micro", num_classes=10, dynamic_img_size=True)
    replace_norms(model, norm_layer_factory("dtn"))
    model(torch.randn(1, 3, 16, 16))
    assert model.token_layout.grid == (8, 8)
    model(torch.randn(1, 3, 24, 20))
    assert model.token_layout.grid == (12, 10)


@pytest.mark.parametrize("name,count", [("vit_tiny", 1.254), ("vit_small", 4.599), ("vit_base", 17.564)])
def test_gmacs_match_the_published_counts(name, count):
    """params.md 1: MACs of convolutions, linears and attention matmuls at 224 px."""
    from normexp.models.stats import count_gmacs

    model = create_model(name, num_classes=1000, img_size=224)
    assert round(count_gmacs(model, (3, 224, 224)), 3) == count
    assert model.blocks[0].attn.fused_attn  # restored after counting
