"""DiT (arXiv 2212.09748; facebookresearch/DiT models.py): sizes, state-dict names, adaLN-Zero, the three
initialisation recipes, and every normalizer in its affine-free norm slots."""

from __future__ import annotations

import pytest
import torch
from conftest import compose_cfg
from torch import nn

from normexp.errors import UserError
from normexp.models import build_model, create_model
from normexp.models.build import backbone_arguments
from normexp.models.dit import DiT, modulate, timestep_frequencies
from normexp.models.stats import count_params
from normexp.norms import get_norm_class, list_norms


def micro(**kwargs) -> DiT:
    return create_model("dit_micro", **{"input_size": 8, "in_chans": 3, "num_classes": 10, **kwargs})


@pytest.mark.parametrize(("name", "params"), [("dit_xl2", 675_129_632), ("dit_b4", 130_475_648),
                                              ("dit_l4", 458_053_760), ("dit_s2", 32_963_360)])
def test_published_sizes_count_dits_parameters(name, params):
    """DiT's training script prints 675,129,632 for DiT-XL/2 (its count includes the fixed pos_embed)."""
    with torch.device("meta"):
        model = create_model(name)
    assert count_params(model) == params
    assert count_params(model, trainable=True) == params - model.pos_embed.numel()


def test_state_dict_names_are_dits():
    keys = set(micro().state_dict())
    layers = ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2", "adaLN_modulation.1")
    block = {f"blocks.0.{k}.{p}" for k in layers for p in ("weight", "bias")}
    assert block | {"pos_embed", "x_embedder.proj.weight", "y_embedder.embedding_table.weight",
                    "t_embedder.mlp.0.weight", "t_embedder.mlp.2.bias", "final_layer.linear.weight",
                    "final_layer.adaLN_modulation.1.weight"} <= keys
    assert not any("norm" in k for k in keys)  # its LayerNorms have no affine
    assert micro().y_embedder.embedding_table.num_embeddings == 11  # the null class


def test_output_shape_learned_sigma_and_unpatchify_order():
    model = micro().eval()
    out = model(torch.randn(2, 3, 8, 8), torch.tensor([1, 999]), torch.tensor([0, 9]))
    assert out.shape == (2, 6, 8, 8)
    tokens = torch.arange(2 * 16 * 2 * 2 * 6).float().view(2, 16, 24)  # (B, T, p*p*C): row, column, channel
    image = model.unpatchify(tokens)
    # token (1, 2) of the 4x4 grid, its patch pixel (row 1, column 0), channel 5
    assert image[0, 5, 1 * 2 + 1, 2 * 2 + 0] == tokens[0, 1 * 4 + 2, (1 * 2 + 0) * 6 + 5]


def test_timestep_frequencies_are_dits_formula():
    t = torch.tensor([0.0, 10.0])
    emb = timestep_frequencies(t, dim=8, max_period=10_000)
    freqs = torch.tensor([10_000 ** (-i / 4) for i in range(4)])
    args = t[:, None] * freqs
    torch.testing.assert_close(emb, torch.cat([torch.cos(args), torch.sin(args)], 1))


@pytest.mark.parametrize("zero_init", ["all", "blocks", "none"])
def test_zero_init_recipes(zero_init):
    """adaLN-Zero: with the blocks' modulation at zero every block is the identity at initialisation (DiT's
    recipe, kept by Derf's); DyT's recipe removes it. The final layer outputs zero only under DiT's."""
    torch.manual_seed(0)
    model = micro(zero_init=zero_init).eval()
    x, c = torch.randn(2, 16, 96), torch.randn(2, 96)
    identity = torch.equal(model.blocks[0](x, c), x)
    assert identity == (zero_init != "none")
    final = model.final_layer(x, c)
    assert (final.abs().max() == 0) == (zero_init == "all")


def test_the_label_dropout_uses_the_null_class_in_training_only():
    model = micro(class_dropout=0.5)
    labels = torch.zeros(2000, dtype=torch.long)
    torch.manual_seed(0)
    dropped = (model.y_embedder(labels) == model.y_embedder.embedding_table.weight[10]).all(1).float().mean()
    assert 0.45 < dropped < 0.55
    model.eval()
    assert not (model.y_embedder(labels) == model.y_embedder.embedding_table.weight[10]).all(1).any()


def test_modulate():
    x, shift, scale = torch.ones(2, 3, 4), torch.full((2, 4), 0.5), torch.full((2, 4), 1.0)
    torch.testing.assert_close(modulate(x, shift, scale), torch.full((2, 3, 4), 2.5))


PAPERS = {"ln", "dyt", "derf", "dtn"}  # DiT's, DyT's, Derf's and ours in the fast tier; the others slow


@pytest.mark.parametrize("norm", [n if n in PAPERS else pytest.param(n, marks=pytest.mark.slow)
                                  for n in list_norms()])
def test_every_norm_fills_every_affine_free_slot_and_trains(norm):
    """Every slot takes the normalizer, without a learnable affine (DiT's slots have none): DyT there is
    tanh(alpha x) -- alpha its only parameter, as DyT's DiT patch makes it."""
    torch.manual_seed(0)
    cfg = compose_cfg("backbone=dit_micro", f"norm={norm}", "data.img_size=8")
    name, kwargs = backbone_arguments(cfg.backbone)
    if norm in ("skipinit", "fixup"):  # they close the branches adaLN-Zero's gates already close
        with pytest.raises(UserError, match="backbone.zero_init=none"):
            build_model(lambda: create_model(name, **kwargs), cfg.norm, name)
        kwargs["zero_init"] = "none"
    model = build_model(lambda: create_model(name, **kwargs), cfg.norm, name)
    slots = [n for n, m in model.named_modules() if isinstance(m, get_norm_class(norm))]
    assert len(slots) == 2 * 4 + 1 and not any(type(m) is nn.LayerNorm for m in model.modules())
    for slot in slots:
        layer = model.get_submodule(slot)
        own = {n for n, _ in layer.named_parameters()}
        assert not own & {"weight", "bias"}, (slot, own)
        assert not {"weight", "bias"} & set(layer.state_dict())
    if norm == "dyt":
        assert {n for n, _ in model.get_submodule(slots[0]).named_parameters()} == {"alpha"}
    out = model(torch.randn(4, 3, 8, 8), torch.randint(0, 1000, (4,)), torch.randint(0, 10, (4,)))
    out.square().mean().backward()
    assert all(p.grad is not None for n, p in model.named_parameters()
               if p.requires_grad and ("adaLN" not in n or "blocks" in n))


def test_the_normalizer_suggests_its_papers_zero_init():
    assert compose_cfg("backbone=dit_micro", "norm=ln").backbone.zero_init == "all"
    assert compose_cfg("backbone=dit_micro", "norm=dyt").backbone.zero_init == "none"
    assert compose_cfg("backbone=dit_micro", "norm=derf").backbone.zero_init == "blocks"
    assert compose_cfg("backbone=dit_micro", "norm=dyt", "backbone.zero_init=all").backbone.zero_init == "all"
