"""Mean attention distance: hand-computed values on a 3x3 grid, weights read from the models equal to the
weights the models use, and clear notes where the distance does not apply."""

from __future__ import annotations

import math

import pytest
import torch
from timm.layers import use_fused_attn

from normexp.analysis.attention import AttentionRecorder, cell_centres, mean_distances, uniform_distance
from normexp.models import build_backbone

P = 4  # patch size in px: a 3x3 grid of 4 px patches covers a 12 px image
GRID, IMAGE = (3, 3), (12, 12)


def distance(attn: torch.Tensor, prefix: int = 0) -> float:
    sums, counts = mean_distances(attn[None, None], GRID, GRID, IMAGE, prefix, prefix)
    return float(sums.sum() / counts.sum())


def test_cell_centres_are_patch_centres_in_pixels():
    assert cell_centres(GRID, IMAGE).tolist()[:4] == [[2.0, 2.0], [2.0, 6.0], [2.0, 10.0], [6.0, 2.0]]


def test_uniform_attention_on_a_3x3_grid_matches_the_hand_computed_mean():
    # by hand, in patch units: a corner query sees 0 + 1 + 2 + 1 + sqrt2 + sqrt5 + 2 + sqrt5 + sqrt8, an edge
    # query 1 + 0 + 1 + sqrt2 + 1 + sqrt2 + sqrt5 + 2 + sqrt5, the centre 4 + 4 sqrt2; 4 corners + 4 edges + 1
    corner = 6 + 3 * math.sqrt(2) + 2 * math.sqrt(5)
    edge = 5 + 2 * math.sqrt(2) + 2 * math.sqrt(5)
    centre = 4 + 4 * math.sqrt(2)
    by_hand = (4 * corner + 4 * edge + centre) / 81 * P
    assert by_hand == pytest.approx((48 + 24 * math.sqrt(2) + 16 * math.sqrt(5)) / 81 * P)
    assert distance(torch.full((9, 9), 1 / 9)) == pytest.approx(by_hand, rel=1e-12)
    assert uniform_distance(GRID, IMAGE) == pytest.approx(by_hand, rel=1e-12)


def test_attention_to_self_only_is_zero_and_to_one_neighbour_is_one_patch():
    assert distance(torch.eye(9)) == 0.0
    neighbour = torch.zeros(9, 9)
    for q in range(9):
        row, col = divmod(q, 3)
        neighbour[q, row * 3 + (col + 1 if col < 2 else col - 1)] = 1.0  # right neighbour (last column: left)
    assert distance(neighbour) == pytest.approx(P, rel=1e-12)
    below = torch.zeros(9, 9)
    for q in range(9):
        row, col = divmod(q, 3)
        below[q, (row + 1 if row < 2 else row - 1) * 3 + col] = 1.0
    assert distance(below) == pytest.approx(P, rel=1e-12)


def test_class_token_is_left_out_and_grid_weights_renormalised():
    attn = torch.zeros(10, 10)  # token 0: the class token
    attn[:, 0] = 0.5            # every query gives the class token half its weight ...
    attn[1:, 1:] = torch.eye(9) * 0.25
    for q in range(9):  # ... a quarter to itself (above) and a quarter to a neighbour
        row, col = divmod(q, 3)
        attn[1 + q, 1 + row * 3 + (col + 1 if col < 2 else col - 1)] = 0.25
    attn[0, 1:] = 0.5 / 9       # the class token's own row is no query of the grid
    assert torch.allclose(attn.sum(-1), torch.ones(10))
    assert distance(attn, prefix=1) == pytest.approx(P / 2, rel=1e-12)  # (0 + P) / 2 after renormalising


def recorder_run(backbone: str, norm: str = "ln",
                 images: int = 2) -> tuple[torch.nn.Module, AttentionRecorder, dict[str, tuple]]:
    """Random-init model in eval; the recorder's weights and, from a hook on each readable attention, its
    input and the output it produced (with its default, fused path where it has one)."""
    torch.manual_seed(0)
    model = build_backbone({"name": backbone, "img_size": 16, "num_classes": 10}, {"name": norm}).eval()
    x = torch.randn(images, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    recorder = AttentionRecorder(model, (16, 16), keep_weights=True)
    seen: dict[str, tuple] = {}
    handles = [m.register_forward_hook(lambda _m, args, out, _n=n: seen.__setitem__(_n, (args, out)))
               for n, m in recorder.modules]
    with torch.no_grad():
        model(x)  # the model as it runs: fused attention where timm fuses it
        fused = {n: out for n, (_args, out) in seen.items()}
        with recorder.hooked():
            model(x)
    for h in handles:
        h.remove()
    return model, recorder, {n: (seen[n][0], fused[n]) for n in seen}


def test_vit_weights_read_are_the_weights_the_model_uses():
    model, recorder, seen = recorder_run("vit_micro")
    assert [n for n, _ in recorder.modules] == [f"blocks.{i}.attn" for i in range(6)]
    for name, (args, fused_out) in seen.items():
        attn = model.get_submodule(name)
        x = args[0]
        b, n, c = x.shape
        v = attn.qkv(x).reshape(b, n, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4)[2]
        weights = recorder.weights[name]
        assert weights.shape == (b, attn.num_heads, 65, 65)
        assert torch.allclose(weights.sum(-1), torch.ones(b, attn.num_heads, 65), atol=1e-5)
        rebuilt = attn.proj((weights @ v).transpose(1, 2).reshape(b, n, c))
        assert torch.allclose(rebuilt, fused_out, atol=1e-5), name
    assert all(m.fused_attn == use_fused_attn() for _, m in recorder.modules)  # switched back after reading
    result = recorder.finish()
    assert [layer.query_prefix for layer in result.layers] == [1] * 6
    assert any("class / distillation tokens are left out" in note for note in result.notes)


def test_pvt_spatial_reduction_keys_sit_on_the_reduced_grid():
    model, recorder, seen = recorder_run("pvt_micro")
    result = recorder.finish()
    grids = {layer.name: (layer.query_grid, layer.key_grid, layer.query_prefix) for layer in result.layers}
    # pvt_micro: stage grids 16, 8, 4, 2 (+ class token in stage 4); sr ratios 4, 2, 1, 1
    assert grids == {"block1.0.attn": ((16, 16), (4, 4), 0), "block2.0.attn": ((8, 8), (4, 4), 0),
                     "block3.0.attn": ((4, 4), (4, 4), 0), "block4.0.attn": ((2, 2), (2, 2), 1)}
    name = "block1.0.attn"
    attn = model.get_submodule(name)
    (x, grid), fused_out = seen[name]
    b, n, c = x.shape
    kv_in = attn.norm(attn.sr(x.transpose(1, 2).reshape(b, c, *grid)).flatten(2).transpose(1, 2))
    v = attn.kv(kv_in).reshape(b, -1, 2, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4)[1]
    rebuilt = attn.proj((recorder.weights[name] @ v).transpose(1, 2).reshape(b, n, c))
    assert torch.allclose(rebuilt, fused_out, atol=1e-5)
    for layer in result.layers:
        assert all(0 < d < 16 * math.sqrt(2) for d in layer.per_head)


@pytest.mark.parametrize("backbone", ["t2t_vit_micro", "pvt_v2_micro"])
def test_other_global_attention_families_are_computed(backbone):
    _model, recorder, _seen = recorder_run(backbone)
    result = recorder.finish()
    assert result.layers and all(len(layer.per_head) > 0 for layer in result.layers)
    if backbone == "t2t_vit_micro":  # the backbone's 4 blocks; the T2T layers are said to be left out
        assert [layer.name for layer in result.layers] == [f"blocks.{i}.attn" for i in range(4)]
        assert any("tokens_to_token.layers.0" in note for note in result.notes)


@pytest.mark.parametrize(("backbone", "norm", "says"), [
    ("swin_micro", "ln", "windowed attention"),
    ("convnext_micro", "ln", "has no attention layers"),
    ("levit_micro", "bn", "has no explicit attention weights to read"),
])
def test_families_without_global_attention_get_a_note(backbone, norm, says):
    _model, recorder, _seen = recorder_run(backbone, norm)
    result = recorder.finish()
    assert any(says in note for note in result.notes), result.notes
    if backbone != "swin_micro":
        assert result.layers == []
    else:  # its last two stages have one window covering the whole grid: global there, and computed
        assert [layer.query_grid for layer in result.layers] == [(4, 4), (4, 4), (2, 2)]
