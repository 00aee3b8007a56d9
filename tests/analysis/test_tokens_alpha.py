"""Token magnitudes per head, DyT's alpha and input std as read by the analysis and by the per-epoch probe,
and the shared normalizer colours."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

from normexp.analysis.core import StdRecorder
from normexp.analysis.slots import grid_tokens, hooked_slots
from normexp.analysis.tokens import TokenRecorder, default_token_slot, head_magnitudes
from normexp.engine.alpha_probe import ALPHA_KEY, PROBE_IMAGES, STD_KEY, alpha_probe, probe_batch
from normexp.models import build_backbone
from normexp.norms import norm_layer_factory
from normexp.norms.layout import TokenLayout
from normexp.plotting import NORM_COLORS, norm_color


def test_token_magnitudes_equal_the_per_head_norms_computed_directly():
    torch.manual_seed(0)
    model = build_backbone({"name": "vit_micro", "img_size": 16, "num_classes": 10}, {"name": "ln"}).eval()
    x = torch.randn(3, 3, 16, 16, generator=torch.Generator().manual_seed(2))
    seen = {}
    slot = default_token_slot(model, ["patch_embed.norm", "blocks.0.norm1", "blocks.0.norm2"])
    assert slot == "blocks.0.norm1"
    recorder = TokenRecorder(model, slot, image=1)
    handle = model.get_submodule(slot).register_forward_hook(lambda _m, a, o: seen.update(x=a[0], y=o))
    with torch.no_grad(), hooked_slots(model, [slot], recorder):
        model(x)
    handle.remove()
    maps = recorder.maps
    assert maps.heads == 4 and maps.grid == (8, 8)
    for got, t in ((maps.input, seen["x"]), (maps.output, seen["y"])):
        direct = t[1, 1:].view(64, 4, 24).norm(dim=-1)  # image 1, grid tokens (after the class token)
        assert torch.allclose(torch.from_numpy(got), direct.T.reshape(4, 8, 8), atol=1e-6)
    # LN scales every token to the same norm over all its channels: the heads' norms, squared, sum to C
    assert torch.allclose(torch.from_numpy(maps.output).square().sum(0), torch.full((8, 8), 96.0), rtol=1e-3)


def test_maps_of_both_layouts_become_the_same_grid_tokens():
    t = torch.arange(2 * 6 * 3 * 4, dtype=torch.float32).view(2, 6, 3, 4)  # (B, C, H, W)
    first = grid_tokens(t, "channels_first")
    last = grid_tokens(t.permute(0, 2, 3, 1), "channels_last")
    tokens = grid_tokens(torch.cat([torch.zeros(2, 1, 6), t.flatten(2).transpose(1, 2)], 1), "channels_last",
                         TokenLayout(grid=(3, 4), num_prefix_tokens=1))
    for got in (first, last, tokens):
        assert got.shape == (3, 4) and torch.equal(got.grid, t.flatten(2).transpose(1, 2))
    assert tokens.prefix.shape == (2, 1, 6)
    assert torch.equal(head_magnitudes(first.grid, 2), first.grid.view(2, 12, 2, 3).norm(dim=-1))


class DyTNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(12, 8)
        self.norm = norm_layer_factory("dyt", alpha0=0.5, kernels="autograd")(8)
        self.drop = nn.Dropout(0.5)
        self.head = nn.Linear(8, 3)
        with torch.no_grad():
            self.norm.alpha.fill_(0.37)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(self.norm(self.inp(x.flatten(1)))))


def test_alpha_and_input_std_read_for_a_dyt_layer_equal_its_parameter_and_the_hooked_std():
    torch.manual_seed(0)
    model = DyTNet().eval()
    x = torch.randn(5, 3, 2, 2, generator=torch.Generator().manual_seed(3)) * 4
    stds, seen = StdRecorder(), {}
    handle = model.norm.register_forward_hook(lambda _m, a, _o: seen.update(x=a[0]))
    with torch.no_grad(), hooked_slots(model, ["norm"], stds):
        model(x[:2])
        model(x[2:])  # two batches: the std is over both
    handle.remove()
    direct = torch.cat([model.inp(x[:2].flatten(1)), model.inp(x[2:].flatten(1))]).detach()
    assert torch.equal(seen["x"], direct[2:])
    assert abs(stds.std("norm") - float(direct.double().std())) < 1e-9

    # the per-epoch probe: same alpha, the std of the probe batch's input, mode restored, no RNG drawn
    dataset = TensorDataset(x.repeat(8, 1, 1, 1), torch.zeros(40, dtype=torch.long))
    loader = torch.utils.data.DataLoader(dataset, batch_size=4)
    model.train()
    rng = torch.get_rng_state()
    row = alpha_probe(model, loader)
    assert torch.equal(torch.get_rng_state(), rng) and model.training
    batch = probe_batch(dataset)
    assert len(batch) == PROBE_IMAGES
    assert row[ALPHA_KEY + "norm"] == model.norm.alpha.detach().item() == torch.tensor(0.37).item()
    expected = model.inp(batch.flatten(1)).detach().std()
    assert abs(row[STD_KEY + "norm"] - float(expected)) < 1e-6
    assert alpha_probe(nn.Sequential(nn.Flatten(), nn.Linear(12, 3)), loader) == {}  # no DyT, no row


def test_every_normalizer_has_its_own_fixed_colour_and_others_a_stable_one():
    from normexp.norms import list_norms

    assert set(list_norms()) <= set(NORM_COLORS)
    assert len(set(NORM_COLORS.values())) == len(NORM_COLORS)
    assert norm_color("DyT") == norm_color("dyt") == NORM_COLORS["dyt"]
    assert norm_color("my_norm") == norm_color("my_norm") and norm_color("my_norm").startswith("#")
