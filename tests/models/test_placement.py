"""Where the norm sits (backbone.norm_position, qk_norm, layer_scale, normformer): each block against its
formula written out by hand, timm's blocks where ours stand in for them, every position and the per-head
slots with every normalizer, the slots in the placement rules, MAE and the DTN code's ViTs, run identity."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import compose_cfg, forward_backward, quick_cfg
from omegaconf import OmegaConf
from timm.layers import Attention
from timm.models.vision_transformer import Block, ResPostBlock
from torch import nn

from normexp.errors import UserError
from normexp.models import build_backbone, create_model
from normexp.models.blocks import NORM_POSITIONS, HeadNormAttention, ResPostNormBlock
from normexp.norms import get_norm_class, list_norms
from normexp.norms.dtn import DTN
from normexp.norms.layout import FoldedHeads
from normexp.norms.placement import norm_slots
from normexp.tracking.provenance import config_hash


# ---------------------------------------------------------------- each position against its formula
def ln(x: torch.Tensor, m: nn.LayerNorm) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), m.weight, m.bias, m.eps)


def attention(x: torch.Tensor, a: nn.Module, qkv_norms: bool = False) -> torch.Tensor:
    """Multi-head self-attention from the module's weights; ``qkv_norms``: LN of each head's q, k, v."""
    b, n, c = x.shape
    h = a.num_heads
    qkv = F.linear(x, a.qkv.weight, a.qkv.bias).split(c, dim=-1)
    q, k, v = (t.reshape(b, n, h, c // h).transpose(1, 2) for t in qkv)
    if qkv_norms:
        q, k, v = ln(q, a.q_norm), ln(k, a.k_norm), ln(v, a.v_norm)
    weights = (q @ k.transpose(-2, -1) / (c // h) ** 0.5).softmax(dim=-1)
    return F.linear((weights @ v).transpose(1, 2).reshape(b, n, c), a.proj.weight, a.proj.bias)


def mlp(x: torch.Tensor, m: nn.Module) -> torch.Tensor:
    return F.linear(F.gelu(F.linear(x, m.fc1.weight, m.fc1.bias)), m.fc2.weight, m.fc2.bias)


def by_hand(blk: nn.Module, x: torch.Tensor, position: str) -> torch.Tensor:
    """The block of ``position`` written out (g1, g2: the LayerScale gains, 1 without)."""
    g1, g2 = (getattr(getattr(blk, n), "gamma", 1.0) for n in ("ls1", "ls2"))
    if position == "pre":  # Xiong et al. 2020
        x = x + g1 * attention(ln(x, blk.norm1), blk.attn)
        return x + g2 * mlp(ln(x, blk.norm2), blk.mlp)
    if position == "post":  # Vaswani et al. 2017
        x = ln(x + g1 * attention(x, blk.attn), blk.norm1)
        return ln(x + g2 * mlp(x, blk.mlp), blk.norm2)
    if position == "peri":  # Peri-LN
        x = x + g1 * ln(attention(ln(x, blk.norm1), blk.attn), blk.norm1_out)
        return x + g2 * ln(mlp(ln(x, blk.norm2), blk.mlp), blk.norm2_out)
    if position == "res_post":  # Swin-v2
        x = x + g1 * ln(attention(x, blk.attn), blk.norm1)
        return x + g2 * ln(mlp(x, blk.mlp), blk.norm2)
    z = ln(x + g1 * attention(x, blk.attn, qkv_norms=True), blk.norm2)  # HybridNorm
    return z + g2 * mlp(z, blk.mlp)


@pytest.mark.parametrize("layer_scale", [None, 0.5])
@pytest.mark.parametrize("position", NORM_POSITIONS)
def test_each_position_is_its_formula(position, layer_scale):
    """A ``post`` block (and every other) equals the block written by hand with the same weights."""
    torch.manual_seed(0)
    model = create_model("vit_micro", num_classes=10, norm_position=position, layer_scale=layer_scale).eval()
    with torch.no_grad():  # every affine and gain away from its initial value
        for name, p in model.named_parameters():
            if ".norm" in name or name.endswith(".gamma"):
                p.normal_(1.0 if name.endswith(("weight", "gamma")) else 0.0, 0.3)
    blk = model.blocks[0]
    x = torch.randn(2, 65, 96)
    torch.testing.assert_close(blk(x), by_hand(blk, x, position), rtol=1e-5, atol=1e-5)


def normformer_by_hand(blk: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """NormFormer's Pre-LN block (arXiv 2110.09456, Sec. 2): x + LN(Concat(g_i h_i) W_O), then
    x + LN(GELU(LN(x) W_1)) W_2 (LN: the block's norms, each with its own affine)."""
    a, b, n, c = blk.attn, *x.shape
    h = a.num_heads
    qkv = F.linear(ln(x, blk.norm1), a.qkv.weight, a.qkv.bias).split(c, dim=-1)
    q, k, v = (t.reshape(b, n, h, c // h).transpose(1, 2) for t in qkv)
    heads = (q @ k.transpose(-2, -1) / (c // h) ** 0.5).softmax(dim=-1) @ v  # (b, h, n, c / h)
    heads = heads * a.head_gain.view(1, h, 1, 1)
    x = x + ln(F.linear(heads.transpose(1, 2).reshape(b, n, c), a.proj.weight, a.proj.bias), a.out_norm)
    m = blk.mlp
    hidden = ln(F.gelu(F.linear(ln(x, blk.norm2), m.fc1.weight, m.fc1.bias)), m.norm)
    return x + F.linear(hidden, m.fc2.weight, m.fc2.bias)


@pytest.mark.parametrize("fused", [True, False])
def test_normformer_is_its_formula(fused):
    """Head gains before the output projection, a norm after it, a norm after the MLP's GELU: with every gain
    and affine away from its initial value (at 1, gains before or after the projection cannot be told
    apart)."""
    torch.manual_seed(0)
    model = create_model("vit_micro", num_classes=10, normformer=True).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".norm" in name or name.endswith(("out_norm.weight", "out_norm.bias", "head_gain")):
                p.normal_(0.0 if name.endswith("bias") else 1.0, 0.5)
    blk = model.blocks[0]
    blk.attn.fused_attn = fused
    assert blk.attn.head_gain.shape == (4,) and isinstance(blk.attn.norm, nn.Identity)
    x = torch.randn(2, 65, 96)
    torch.testing.assert_close(blk(x), normformer_by_hand(blk, x), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="normformer .* needs norm_position=pre"):
        create_model("vit_micro", num_classes=10, normformer=True, norm_position="post")


def test_res_post_is_timms_res_post_block():
    """Without LayerScale the block is timm's ResPostBlock; with it, the function timm's init_values gives
    at initialisation (timm starts the norms' weight there, ours a LayerScale after the norm)."""
    torch.manual_seed(0)
    for init_values in (None, 1e-2):
        ours = ResPostNormBlock(96, 4, qkv_bias=True, init_values=init_values).eval()
        timms = ResPostBlock(96, 4, qkv_bias=True, init_values=init_values).eval()
        missing, _ = timms.load_state_dict(ours.state_dict(), strict=False)
        assert not missing
        if init_values is not None:
            timms.init_weights()  # the norms' weight back at init_values
        x = torch.randn(2, 17, 96)
        torch.testing.assert_close(ours(x), timms(x))


def test_pre_is_timms_block_and_qk_norm_timms_attention():
    """pre builds timm's Block; the per-head slots of qk_norm compute timm's q / k norms, fused or not."""
    model = create_model("vit_micro", num_classes=10, qk_norm=True).eval()
    blk = model.blocks[0]
    assert type(blk) is Block and isinstance(blk.attn, HeadNormAttention)
    with torch.no_grad():
        for norm in (blk.attn.q_norm, blk.attn.k_norm):
            norm.weight.normal_(1.0, 0.3)
            norm.bias.normal_(0.0, 0.3)
    timms = Attention(96, 4, qkv_bias=True, qk_norm=True, norm_layer=type(blk.attn.q_norm)).eval()
    timms.load_state_dict(blk.attn.state_dict())
    x = torch.randn(2, 65, 96)
    torch.testing.assert_close(blk.attn(x), timms(x))
    blk.attn.fused_attn = False
    torch.testing.assert_close(blk.attn(x), timms(x))
    default = create_model("vit_micro", num_classes=10)
    assert type(default.blocks[0].attn) is Attention  # off: timm's attention, untouched


# ---------------------------------------------------------------- every position x every normalizer
SLOTS = {  # block 0's slots per position (module order)
    "pre": ["norm1", "norm2"], "post": ["norm1", "norm2"], "res_post": ["norm1", "norm2"],
    "peri": ["norm1", "norm1_out", "norm2", "norm2_out"],
    "hybrid": ["attn.q_norm", "attn.k_norm", "attn.v_norm", "norm2"],
}


def build(position: str, norm: str, *overrides: str, **backbone: object) -> nn.Module:
    """vit_micro at 16 px with ``norm``, ``overrides``, and the ``backbone`` settings put in after composing
    (one composition per normalizer: composing is most of a case's time)."""
    cfg = compose_cfg(f"norm={norm}", "data.img_size=16", *overrides)
    settings = {**OmegaConf.to_container(cfg.backbone, resolve=True), "norm_position": position, **backbone}
    return build_backbone(settings, cfg.norm)


def test_the_slots_of_each_position_and_switch():
    for position, expected in SLOTS.items():
        slots = norm_slots(create_model("vit_micro", num_classes=10, norm_position=position))
        assert [s.removeprefix("blocks.0.") for s in slots if s.startswith("blocks.0.")] == expected
        assert slots[-1] == "norm"  # the final norm stays (see normexp/models/vit.py)
    model = create_model("vit_micro", num_classes=10, qk_norm=True, layer_scale=1e-5, normformer=True)
    blk = "blocks.0."
    slots = ("norm1", "attn.q_norm", "attn.k_norm", "attn.out_norm", "norm2", "mlp.norm")
    assert {blk + s for s in slots} <= set(norm_slots(model))
    assert model.get_submodule(blk + "mlp.norm").normalized_shape == (384,)  # NormFormer's, after GELU
    gammas = {n: p for n, p in model.named_parameters() if n.endswith("gamma")}
    assert len(gammas) == 12 and all((g == 1e-5).all() for g in gammas.values())
    context = model.norm_context(blk + "attn.q_norm")
    assert context["num_heads"] == 1 and isinstance(context["layout"], FoldedHeads)
    assert context["layout"].layout is model.token_layout and context["layout"].num_heads == 4
    assert model.norm_context(blk + "attn.out_norm")["num_heads"] == 4  # full width, after the projection


# The matrix costs ~0.1 s a case: the fast tier runs it all but the normalizers whose default build runs
# another's code (as test_every_backbone: pointwise is Derf's layer, none is skipinit without gates).
SAME_CODE_AS = {"pointwise", "none"}


def matrix(*keys: str) -> list:
    return [pytest.param(key, norm, marks=[pytest.mark.slow] if norm in SAME_CODE_AS else [])
            for key in keys for norm in list_norms()]


@pytest.mark.parametrize(("position", "norm"), matrix(*NORM_POSITIONS))
def test_every_position_takes_every_normalizer_and_trains_a_step(position, norm):
    torch.manual_seed(0)
    model = build(position, norm)
    for slot in SLOTS[position]:
        assert type(model.get_submodule(f"blocks.0.{slot}")) is get_norm_class(norm), slot
    forward_backward(model, 16)


@pytest.mark.parametrize(("position", "norm"), matrix("pre"))
def test_qk_norm_takes_every_normalizer_and_trains_a_step(position, norm):
    """No normalizer is refused in the per-head slots: each sees one head's tokens on the grid."""
    torch.manual_seed(0)
    model = build(position, norm, qk_norm=True, layer_scale=0.1)
    assert type(model.blocks[0].attn.q_norm) is get_norm_class(norm)
    forward_backward(model, 16)


def test_dtn_in_a_per_head_slot_sees_each_heads_tokens_on_the_grid():
    model = build("hybrid", "dtn")
    layer = model.blocks[0].attn.q_norm
    assert isinstance(layer, DTN) and layer.num_heads == 1 and layer.dim == 24
    seen = []
    layer.register_forward_hook(lambda m, args, out: seen.append(args[0].shape))
    model(torch.randn(2, 3, 16, 16))
    assert seen == [(2 * 4, 65, 24)]  # (B * heads, class token + 8 x 8 grid, head_dim)


def test_placement_rules_see_the_added_slots():
    """keep patterns and first_blocks read the added slots' names and block indices like any other."""
    cfg = compose_cfg("norm=dyt", "data.img_size=16", "backbone.norm_position=hybrid",
                      "norm.placement.keep=[blocks.*.attn.v_norm]", "+norm.placement.first_blocks=2")
    model = build_backbone(cfg.backbone, cfg.norm)
    assert type(model.blocks[0].attn.q_norm).__name__ == "DyT"
    assert isinstance(model.blocks[0].attn.v_norm, nn.LayerNorm)
    assert isinstance(model.blocks[2].attn.q_norm, nn.LayerNorm) and isinstance(model.norm, nn.LayerNorm)
    peri = build("peri", "dtn", "backbone=vit_micro_star")  # the DTN code's layout: LN from block 5 on
    assert isinstance(peri.blocks[0].norm1_out, DTN) and isinstance(peri.blocks[5].norm1_out, nn.LayerNorm)
    forward_backward(peri, 16)


def test_mae_encodes_with_any_position_and_per_head_dtn_over_the_visible_tokens():
    from normexp.tasks.mae import build_mae

    model = build_mae(quick_cfg("task=mae", "norm=dtn", "backbone.norm_position=hybrid"))
    layer = model.encoder.blocks[0].attn.k_norm
    seen = {}
    layer.register_forward_hook(lambda m, args, _: seen.update(x=args[0].shape, at=m.layout.positions.shape))
    loss, _, _ = model(torch.randn(2, 3, 8, 8))
    loss.backward()
    assert torch.isfinite(loss) and seen == {"x": (2 * 4, 5, 24), "at": (2 * 4, 4)}  # 4 of 16 patches seen


def test_an_unknown_position_is_one_line():
    cfg = compose_cfg("backbone.norm_position=sandwich")
    with pytest.raises(UserError, match="norm_position must be one of pre, post, peri, res_post, hybrid"):
        build_backbone(cfg.backbone, cfg.norm)


def test_the_default_placement_keeps_the_identity_of_earlier_runs():
    """The placement keys at their defaults (plain Pre-LN ViT) are not part of a run's identity: a run made
    before they existed is the same run; any other value is another run."""
    config = OmegaConf.to_container(compose_cfg("norm=dyt"), resolve=True)
    before = {**config, "backbone": {k: v for k, v in config["backbone"].items()
                                     if k not in ("norm_position", "qk_norm", "layer_scale", "normformer")}}
    assert config_hash(config) == config_hash(before)
    for key, value in (("norm_position", "post"), ("qk_norm", True), ("layer_scale", 1e-5)):
        other = {**config, "backbone": {**config["backbone"], key: value}}
        assert config_hash(other) != config_hash(config)
