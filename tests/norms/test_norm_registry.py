"""Every normalizer is registered, builds through the factory from model context, and trains."""

from __future__ import annotations

import copy

import pytest
import torch

from normexp.norms import TokenLayout, list_norms, norm_layer_factory

ALL = ["ln", "rms", "dyt", "dtn", "bn", "in", "gn", "scale", "power", "derf", "sn", "pointwise", "none",
       "skipinit", "fixup", "sigma_reparam"]


def test_registry_lists_all():
    assert set(ALL) <= set(list_norms())


def _context(layout: TokenLayout) -> dict:
    # what a model hands every norm slot; the factory filters it per normalizer
    return {"data_format": "channels_last", "num_heads": 2, "layout": layout, "num_prefix_tokens": 0}


@pytest.mark.parametrize("name", ALL)
def test_builds_and_trains_on_tokens_and_maps(name):
    layout = TokenLayout(grid=(4, 4))
    layer = norm_layer_factory(name)(8, **_context(layout))
    for shape in [(2, 16, 8), (2, 4, 4, 8)]:
        x = torch.randn(shape, requires_grad=True)
        y = layer(x)
        assert y.shape == x.shape and torch.isfinite(y).all()
        y.square().sum().backward()
        assert torch.isfinite(x.grad).all()
        assert all(p.grad is not None for p in layer.parameters()), name
        layer.zero_grad()
    layer.eval()
    assert layer(torch.randn(2, 16, 8)).shape == (2, 16, 8)


@pytest.mark.parametrize("name", ALL)
def test_builds_channels_first(name):
    layer = norm_layer_factory(name)(8, data_format="channels_first", num_heads=2)
    x = torch.randn(2, 8, 3, 5)
    assert layer(x).shape == x.shape


def test_unknown_option_fails_at_configuration_time():
    with pytest.raises(ValueError, match="pool_size"):
        norm_layer_factory("dtn", pool=7)
    assert norm_layer_factory("dtn", pool_size=7, only_var=True)(8, num_heads=2).only_var


def test_layout_is_shared_and_survives_deepcopy():
    layout = TokenLayout(grid=(2, 2), num_prefix_tokens=1)
    build = norm_layer_factory("dtn")
    model = torch.nn.ModuleDict({k: build(8, num_heads=2, layout=layout) for k in "ab"})
    ema = copy.deepcopy(model)  # e.g. model EMA
    assert ema["a"].layout is ema["b"].layout and ema["a"].layout is not layout
    ema["a"].layout.set_grid(3, 3)
    assert ema["b"](torch.randn(1, 10, 8)).shape == (1, 10, 8)
    prefix, grid = layout.split(torch.randn(2, 5, 8))
    assert prefix.shape == (2, 1, 8) and grid.shape == (2, 4, 8)
