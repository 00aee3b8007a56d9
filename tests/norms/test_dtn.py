"""DTN against its definition (arXiv 2112.02624; the official module, wqshao126/DTN
models/normkit/norms/dtn.py) and a slow per-token loop reference; the fused path against autograd through
the same equations."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import compose_cfg, count_params
from scipy import stats
from torch import nn
from torch.func import functional_call

from normexp.models import build_backbone
from normexp.norms import TokenLayout
from normexp.norms.dtn import DTN

EPS = 1e-5


# --------------------------------------------------------------------------- slow reference
def _rms_prescale(tok: list[float], heads: int, eps: float) -> list[float]:
    d = len(tok) // heads
    out = []
    for h in range(heads):
        part = tok[h * d:(h + 1) * d]
        rms = math.sqrt(sum(v * v for v in part) / d + eps)
        out += [v / rms for v in part]
    return out


def _adaptive_bins(size: int, out: int) -> list[range]:
    # adaptive average pooling bins: [floor(i*size/out), ceil((i+1)*size/out))
    return [range(i * size // out, -(-(i + 1) * size // out)) for i in range(out)]


def _nearest(dst: int, out: int, src: int) -> int:
    # PyTorch's "nearest" rule: floor(dst * (src / out)) with a float32 scale
    return min(int(np.floor(np.float32(dst) * np.float32(np.float32(src) / np.float32(out)))), src - 1)


def reference_dtn(x: torch.Tensor, grid: tuple[int, int], prefix: int, m: DTN) -> torch.Tensor:
    """The paper's / official code's equations, one sample and one token at a time, in float64."""
    heads, eps, c = m.num_heads, m.eps, m.dim
    d = c // heads
    gh, gw = grid
    weight, bias = m.weight.double().tolist(), m.bias.double().tolist()
    a = m.pos_proj.weight.double().tolist()
    pb = m.pos_proj.bias.double().tolist()
    lam_v = [1 / (1 + math.exp(-v)) for v in m.var_norm_weight.double().tolist()]
    lam_m = None if m.only_var else [1 / (1 + math.exp(-v)) for v in m.mean_norm_weight.double().tolist()]
    ps = m.pool_size
    hp, wp = (gh, gw) if ps is None else (min(gh, ps), min(gw, ps))
    rows, cols = _adaptive_bins(gh, hp), _adaptive_bins(gw, wp)

    # P^h[p][q] = softmax over sources p of a0*dx + a1*dy + a2*(dx^2+dy^2) + b, dx = col(q) - col(p)
    tp = hp * wp
    P = []
    for h in range(heads):
        ph = [[0.0] * tp for _ in range(tp)]
        for q in range(tp):
            logits = []
            for p in range(tp):
                dx, dy = q % wp - p % wp, q // wp - p // wp
                logits.append(a[h][0] * dx + a[h][1] * dy + a[h][2] * (dx * dx + dy * dy) + pb[h])
            top = max(logits)
            ex = [math.exp(v - top) for v in logits]
            for p in range(tp):
                ph[p][q] = ex[p] / sum(ex)
        P.append(ph)

    out = torch.empty(x.shape, dtype=torch.float64)
    for i in range(x.shape[0]):
        toks = [_rms_prescale(x[i, t].double().tolist(), heads, eps) for t in range(x.shape[1])]
        grid_toks = toks[prefix:]
        # pooled tokens z[p][ch]
        z = []
        for r in range(hp):
            for cc in range(wp):
                cells = [grid_toks[rr * gw + c2] for rr in rows[r] for c2 in cols[cc]]
                z.append([sum(cell[ch] for cell in cells) / len(cells) for ch in range(c)])
        mu_in = [[sum(P[ch // d][p][q] * z[p][ch] for p in range(tp)) for ch in range(c)] for q in range(tp)]
        m2_in = [[sum(P[ch // d][p][q] * z[p][ch] ** 2 for p in range(tp)) for ch in range(c)]
                 for q in range(tp)]
        for t, tok in enumerate(toks):
            mu_ln = sum(tok) / c
            var_ln = sum((v - mu_ln) ** 2 for v in tok) / (c - 1)  # unbiased, as torch.var in the code
            for ch in range(c):
                if t < prefix:  # prefix tokens: LN statistics only
                    mu, var = mu_ln, var_ln
                else:
                    g = t - prefix
                    q = _nearest(g // gw, gh, hp) * wp + _nearest(g % gw, gw, wp)
                    mi, vi = mu_in[q][ch], max(m2_in[q][ch] - mu_in[q][ch] ** 2, 0.0)
                    h = ch // d
                    mu = mu_ln if lam_m is None else lam_m[h] * mu_ln + (1 - lam_m[h]) * mi
                    var = lam_v[h] * var_ln + (1 - lam_v[h]) * vi
                out[i, t, ch] = weight[ch] * (tok[ch] - mu) / math.sqrt(var + eps) + bias[ch]
    return out


def randomize(m: DTN, seed: int = 0) -> DTN:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            offset = 1.0 if p is m.weight else 0.0
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.5 + offset)
    return m


def tokens(b: int, grid: tuple[int, int], prefix: int, c: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(b, prefix + grid[0] * grid[1], c, generator=gen, dtype=torch.float64) * 2 + 0.5


# --------------------------------------------------------------------------- loop reference
@pytest.mark.parametrize("separable", [True, False])
@pytest.mark.parametrize(
    "grid, prefix, pool_size, only_var",
    [((3, 4), 0, 14, False),  # plain grid
     ((3, 4), 2, 14, False),  # class + dist token: LN statistics for them
     ((6, 4), 1, 3, False),  # pooled: 6 -> 3 divides, 4 -> 3 does not
     ((5, 7), 0, 3, True),  # pooled, non-divisible both ways, dtn_var
     ((3, 3), 0, None, False)],  # pooling disabled
)
def test_matches_loop_reference(grid, prefix, pool_size, only_var, separable):
    c, heads = 8, 2
    layout = TokenLayout(grid=grid, num_prefix_tokens=prefix)
    m = randomize(DTN(c, num_heads=heads, layout=layout, pool_size=pool_size, only_var=only_var,
                      separable=separable)).double()
    x = tokens(2, grid, prefix, c)
    torch.testing.assert_close(m(x), reference_dtn(x, grid, prefix, m), rtol=1e-9, atol=1e-9)


def test_maps_match_loop_reference_in_both_formats():
    c, heads, grid = 8, 4, (3, 5)
    m = randomize(DTN(c, num_heads=heads, pool_size=2), seed=3).double()
    x = tokens(2, grid, 0, c, seed=1)
    ref = reference_dtn(x, grid, 0, m).view(2, *grid, c)
    torch.testing.assert_close(m(x.view(2, *grid, c)), ref, rtol=1e-9, atol=1e-9)
    cf = DTN(c, num_heads=heads, pool_size=2, data_format="channels_first").double()
    cf.load_state_dict(m.state_dict())
    out = cf(x.view(2, *grid, c).permute(0, 3, 1, 2).contiguous())
    torch.testing.assert_close(out, ref.permute(0, 3, 1, 2), rtol=1e-9, atol=1e-9)


# --------------------------------------------------------------------------- special cases
def _prescaled(x: torch.Tensor, heads: int) -> torch.Tensor:
    xh = x.view(*x.shape[:-1], heads, -1)
    return (xh / torch.sqrt(xh.pow(2).mean(-1, keepdim=True) + EPS)).view(x.shape)


def test_lambda_one_is_ln_of_the_prescaled_input():
    c, heads, grid = 16, 4, (4, 4)
    m = DTN(c, num_heads=heads, layout=TokenLayout(grid=grid, num_prefix_tokens=1))
    randomize(m)
    m.set_mixing_weights(mean=1.0, var=1.0)
    x = torch.randn(3, 17, c) * 3 + 1
    xs = _prescaled(x, heads)
    # LN with the official unbiased variance over the C channels
    ln = (xs - xs.mean(-1, keepdim=True)) / torch.sqrt(xs.var(-1, keepdim=True) + EPS)
    expected = ln * m.weight + m.bias
    torch.testing.assert_close(m(x), expected, rtol=1e-5, atol=1e-5)


def test_lambda_zero_with_uniform_p_is_instance_norm():
    c, heads, grid = 16, 4, (4, 5)
    m = DTN(c, num_heads=heads, layout=TokenLayout(grid=grid))
    m.set_mixing_weights(mean=0.0, var=0.0)
    with torch.no_grad():
        m.pos_proj.weight.zero_()  # constant logits -> uniform P
        m.pos_proj.bias.zero_()
    x = torch.randn(3, 20, c) * 2 - 1
    xs = _prescaled(x, heads)
    expected = F.instance_norm(xs.transpose(1, 2), eps=EPS).transpose(1, 2)  # per channel over tokens
    torch.testing.assert_close(m(x), expected, rtol=1e-5, atol=1e-5)


def test_separable_equals_dense_with_large_weights():
    m = DTN(24, num_heads=6, pool_size=None)
    with torch.no_grad():
        m.pos_proj.weight.normal_(0, 3.0)
        m.pos_proj.bias.normal_(0, 3.0)
    x = torch.randn(2, 7, 9, 24, dtype=torch.float64)
    m = m.double()
    dense = DTN(24, num_heads=6, pool_size=None, separable=False).double()
    dense.load_state_dict(m.state_dict())
    torch.testing.assert_close(m(x), dense(x), rtol=1e-10, atol=1e-10)
    py, px = m.position_factors((7, 9))
    kron = (py[:, :, None, :, None] * px[:, None, :, None, :]).reshape(6, 63, 63)
    torch.testing.assert_close(kron, m.position_matrix((7, 9)), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("pool_size, only_var", [(2, False), (None, False), (None, True), (2, True)])
def test_gradcheck_float64(pool_size, only_var):
    # the fused path's hand-written backward against finite differences
    layout = TokenLayout(grid=(3, 3), num_prefix_tokens=1)
    m = randomize(DTN(4, num_heads=2, layout=layout, pool_size=pool_size, only_var=only_var,
                      kernels="eager")).double()
    names = [n for n, _ in m.named_parameters()]
    x = tokens(2, (3, 3), 1, 4).requires_grad_()
    params = tuple(p.detach().clone().requires_grad_() for p in m.parameters())

    def f(x, *ps):
        return functional_call(m, dict(zip(names, ps, strict=True)), (x,))

    # fast mode checks random projections of the Jacobian (full columns are covered against autograd below)
    assert torch.autograd.gradcheck(f, (x, *params), eps=1e-6, atol=1e-5, fast_mode=True)
    m.separable = False
    assert torch.autograd.gradcheck(f, (x, *params), eps=1e-6, atol=1e-5, fast_mode=True)


def test_no_batch_dependence_and_train_equals_eval():
    m = randomize(DTN(16, num_heads=4, layout=TokenLayout(grid=(4, 4), num_prefix_tokens=1)))
    x = torch.randn(4, 17, 16)
    y = m(x)
    x2 = x.clone()
    x2[1:] = torch.randn(3, 17, 16) * 10
    torch.testing.assert_close(m(x2)[0], y[0])
    torch.testing.assert_close(m(x[:1])[0], y[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(m.eval()(x), y)


# --------------------------------------------------------------------------- parameters, init
@pytest.mark.parametrize("dim, heads", [(384, 6), (432, 9), (192, 4)])
def test_parameter_overhead_is_6h(dim, heads):
    ln = count_params(nn.LayerNorm(dim))
    assert count_params(DTN(dim, num_heads=heads)) - ln == 6 * heads
    assert count_params(DTN(dim, num_heads=heads, only_var=True)) - ln == 5 * heads


def test_initial_mixing_weights_are_half_and_state_dict_is_official():
    m = DTN(64, num_heads=4)
    lam_mu, lam_var = m.mixing_weights()
    assert torch.all(lam_mu == 0.5) and torch.all(lam_var == 0.5)
    assert set(m.state_dict()) == {"weight", "bias", "mean_norm_weight", "var_norm_weight",
                                   "pos_proj.weight", "pos_proj.bias"}
    assert torch.all(m.pos_proj.bias == 0)


def test_local_init_h9_each_head_peaks_at_its_offset():
    m = DTN(9 * 4, num_heads=9, pos_init="local")
    p = m.position_matrix((14, 14))  # [H, source, target]
    target = 7 * 14 + 7
    seen = set()
    for head in range(9):
        h1, h2 = head % 3, head // 3
        off_x, off_y = h2 - 1, h1 - 1  # Delta of this head; dx = col(target) - col(source)
        src = int(p[head, :, target].argmax())
        assert (7 - src // 14, 7 - src % 14) == (off_y, off_x)
        # 9 heads: offsets {-1, 0, 1}^2, each with peak weight 0.318 on a 14x14 grid
        assert p[head, src, target].item() == pytest.approx(0.318, abs=0.005)
        seen.add((off_x, off_y))
    assert seen == {(i, j) for i in (-1, 0, 1) for j in (-1, 0, 1)}
    torch.testing.assert_close(p.sum(1), torch.ones(9, 196))


def test_local_init_h6_keeps_extra_heads_random_and_global():
    torch.manual_seed(0)
    m = DTN(384, num_heads=6, pos_init="local")
    w = m.pos_proj.weight
    assert torch.all(w[:4, 2] == -1) and w[4:].abs().max() < 0.15  # heads >= k^2 = 4: std-0.02 weights
    p = m.position_matrix((14, 14))
    assert p[:4].max() > 0.15 and p[4:].max() < 0.1  # local peaks vs broad (global) weighting


def test_locality_strength_scales_weights():
    a = DTN(36, num_heads=9, pos_init="local", locality_strength=2.0).pos_proj.weight
    b = DTN(36, num_heads=9, pos_init="local").pos_proj.weight
    torch.testing.assert_close(a, 2 * b)


@pytest.mark.parametrize("recipe", [["experiment=dtn_imagenet"],                          # vit_small_dtn
                                    ["experiment=dtn_pvt_imagenet", "backbone=pvt_tiny"]])  # stages 1-3
def test_position_weights_start_as_in_the_official_models(recipe):
    """wqshao126/DTN builds each DTN with its local init, then its models re-initialise every nn.Linear with
    timm's trunc_normal_(std=.02) (bounds +-2, i.e. 100 std) and zero bias, pos_proj included
    (models/vit_norm_mix.py VisionTransformer.__init__, models/pvt_norm.py _init_weights): the weights the
    code trains from are N(0, 0.02^2) draws. The recipes' DTN starts from that distribution; the local init
    (norm.pos_init=local) does not."""
    def position_weights(*overrides: str) -> tuple[torch.Tensor, torch.Tensor]:
        torch.manual_seed(0)
        cfg = compose_cfg(*recipe, *overrides)
        layers = [m for m in build_backbone(cfg.backbone, cfg.norm).modules() if isinstance(m, DTN)]
        assert layers
        return (torch.cat([m.pos_proj.weight.detach().flatten() for m in layers]),
                torch.cat([m.pos_proj.bias.detach() for m in layers]))

    weight, bias = position_weights()
    assert torch.all(bias == 0)
    assert stats.kstest(weight.numpy(), "norm", args=(0.0, 0.02)).pvalue > 0.01
    assert weight.std().item() == pytest.approx(0.02, rel=0.15) and weight.abs().max() < 0.1
    local, _ = position_weights("norm.pos_init=local")
    assert stats.kstest(local.numpy(), "norm", args=(0.0, 0.02)).pvalue < 1e-6


# --------------------------------------------------------------------------- shapes, grids, errors
def test_three_formats_agree():
    m = randomize(DTN(16, num_heads=4, layout=TokenLayout(grid=(5, 6))))
    cf = DTN(16, num_heads=4, data_format="channels_first")
    cf.load_state_dict(m.state_dict())
    maps = torch.randn(2, 5, 6, 16)
    y_tok = m(maps.view(2, 30, 16))
    torch.testing.assert_close(m(maps), y_tok.view(2, 5, 6, 16))
    torch.testing.assert_close(cf(maps.permute(0, 3, 1, 2)), y_tok.view(2, 5, 6, 16).permute(0, 3, 1, 2))


@pytest.mark.parametrize("grid", [(28, 28), (30, 17), (15, 14), (7, 9)])
def test_large_and_uneven_grids(grid):
    layout = TokenLayout(grid=grid, num_prefix_tokens=1)
    m = randomize(DTN(12, num_heads=3, layout=layout))
    dense = DTN(12, num_heads=3, layout=layout, separable=False)
    dense.load_state_dict(m.state_dict())
    x = torch.randn(2, 1 + grid[0] * grid[1], 12, requires_grad=True)
    y = m(x)
    assert y.shape == x.shape and torch.isfinite(y).all()
    torch.testing.assert_close(y, dense(x), rtol=1e-5, atol=1e-5)
    y.sum().backward()
    assert torch.isfinite(x.grad).all()


def test_pooled_28x28_is_official_dtn_pool():
    # official dtn_pool at 28x28: AvgPool2d(2) to 14x14, stats with P on 14x14, repeat back to 28x28
    heads, d = 2, 4
    m = randomize(DTN(heads * d, num_heads=heads))
    x = torch.randn(2, 28, 28, heads * d)
    xs = _prescaled(x, heads)
    z = F.avg_pool2d(xs.permute(0, 3, 1, 2), 2).permute(0, 2, 3, 1).reshape(2, 196, heads, d)
    p = m.position_matrix((14, 14))
    mu = torch.einsum("hpq,bphd->bqhd", p, z)
    var = (torch.einsum("hpq,bphd->bqhd", p, z * z) - mu * mu).clamp_min(0)
    up = lambda t: t.reshape(2, 14, 14, heads * d).repeat_interleave(2, 1).repeat_interleave(2, 2)  # noqa: E731
    lam_mu, lam_var = (lam.repeat_interleave(d) for lam in m.mixing_weights())
    mu_ln, var_ln = xs.mean(-1, keepdim=True), xs.var(-1, keepdim=True)
    mu = lam_mu * mu_ln + (1 - lam_mu) * up(mu)
    var = lam_var * var_ln + (1 - lam_var) * up(var)
    expected = (xs - mu) / torch.sqrt(var + EPS) * m.weight + m.bias
    torch.testing.assert_close(m(x), expected, rtol=1e-4, atol=1e-4)


def test_grid_changes_at_run_time():
    layout = TokenLayout(num_prefix_tokens=1)
    m = DTN(8, num_heads=2, layout=layout)
    for grid in [(4, 4), (6, 3), (4, 4)]:
        layout.set_grid(*grid)
        assert m(torch.randn(2, 1 + grid[0] * grid[1], 8)).shape == (2, 1 + grid[0] * grid[1], 8)
    assert m.rel_indices.shape == (16, 16, 3)


def test_prefix_tokens_optional_in_the_same_layout():
    # official ViT: the class token joins at block 10, same grid -> N is H*W or prefix + H*W
    m = DTN(8, num_heads=2, layout=TokenLayout(grid=(3, 3), num_prefix_tokens=1))
    x = torch.randn(2, 10, 8)
    torch.testing.assert_close(m(x[:, 1:]), m(x)[:, 1:])


def test_clear_errors():
    with pytest.raises(RuntimeError, match="grid"):
        DTN(8, num_heads=2)(torch.randn(2, 16, 8))
    with pytest.raises(RuntimeError, match="grid"):
        DTN(8, num_heads=2, layout=TokenLayout())(torch.randn(2, 16, 8))
    with pytest.raises(ValueError, match="tokens do not match"):
        DTN(8, num_heads=2, layout=TokenLayout(grid=(4, 4)))(torch.randn(2, 18, 8))
    with pytest.raises(ValueError, match="must divide"):
        DTN(10, num_heads=4)
    with pytest.raises(ValueError, match="num_heads"):
        DTN(8)
    with pytest.raises(ValueError, match="channels_first"):
        DTN(8, num_heads=2, data_format="channels_first")(torch.randn(2, 8, 16))


def test_buffer_moves_and_half_precision_input():
    m = DTN(8, num_heads=2, layout=TokenLayout(grid=(3, 3)))
    m(torch.randn(1, 9, 8))
    m = m.double()
    assert m.rel_indices.dtype == torch.float64
    assert "rel_indices" not in m.state_dict()
    m = m.float()
    y = m(torch.randn(2, 9, 8, dtype=torch.bfloat16))
    assert y.dtype == torch.bfloat16 and torch.isfinite(y.float()).all()


# --------------------------------------------------------------------------- the fused path
FUSED_CASES = {  # (input shape, data format, grid, prefix, pool_size, only_var, separable)
    "tokens": ((2, 12, 12), "channels_last", (4, 3), 0, 14, False, True),
    "class_token": ((2, 13, 12), "channels_last", (4, 3), 1, 14, False, True),
    "tokens_token_stride_1": ((2, 12, 12), "channels_last", (3, 4), 0, 14, False, True),  # transposed input
    "two_prefix_only_var": ((2, 18, 12), "channels_last", (4, 4), 2, 14, True, True),
    "dense": ((2, 13, 12), "channels_last", (3, 4), 1, 14, False, False),
    "pooled_prefix": ((2, 31, 12), "channels_last", (6, 5), 1, 3, False, True),  # 6 -> 3, 5 -> 3
    "pooled_only_var_dense": ((2, 30, 12), "channels_last", (5, 6), 0, 4, True, False),
    "map_channels_last": ((2, 4, 5, 12), "channels_last", None, 0, 14, False, True),
    "map_channels_first_pooled": ((2, 12, 5, 7), "channels_first", None, 0, 3, False, True),
}


def fused_and_autograd(case: str, seed: int = 0) -> list[list[torch.Tensor]]:
    """Outputs and gradients (input, every parameter) of the fused path and of autograd, float64."""
    shape, fmt, grid, prefix, pool, only_var, separable = FUSED_CASES[case]
    layout = TokenLayout(grid=grid, num_prefix_tokens=prefix) if grid else None
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen, dtype=torch.float64) * 2 + 0.5
    g = torch.randn(shape, generator=gen, dtype=torch.float64)
    if case.endswith("stride_1"):  # as a residual stream that began as a transposed patch embedding
        x = x.transpose(1, 2).contiguous().transpose(1, 2)
    ref = randomize(DTN(12, num_heads=3, layout=layout, data_format=fmt, pool_size=pool, only_var=only_var,
                        separable=separable), seed).double()
    results = []
    for kernels in ("eager", "autograd"):
        m = DTN(12, num_heads=3, layout=layout, data_format=fmt, pool_size=pool, only_var=only_var,
                separable=separable, kernels=kernels).double()
        m.load_state_dict(ref.state_dict())
        xi = x.clone().requires_grad_()
        y = m(xi)
        y.backward(g)
        results.append([y, xi.grad, *(p.grad for p in m.parameters())])
    return results


@pytest.mark.parametrize("case", FUSED_CASES)
def test_fused_path_matches_autograd_float64(case):
    # the fused Functions' hand-written backward against autograd through the same equations
    fused, plain = fused_and_autograd(case)
    assert fused[0].is_contiguous()  # in the input's own format, whatever the input's strides
    for a, b in zip(fused, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_fused_path_matches_loop_reference():
    grid, prefix = (6, 4), 1
    m = randomize(DTN(8, num_heads=2, layout=TokenLayout(grid=grid, num_prefix_tokens=prefix), pool_size=3,
                      kernels="eager")).double()
    x = tokens(2, grid, prefix, 8)
    torch.testing.assert_close(m(x), reference_dtn(x, grid, prefix, m), rtol=1e-9, atol=1e-9)


def test_fused_output_of_channels_first_map_is_contiguous_and_takes_in_place_adds():
    """A ResNet block adds its shortcut in place (``out += identity``) to the norm's output: the fused
    path's gradients then equal the plain path's."""
    x, shortcut = torch.randn(2, 12, 5, 7, dtype=torch.float64), torch.randn(2, 12, 5, 7, dtype=torch.float64)
    grads = []
    for kernels in ("eager", "autograd"):
        m = randomize(DTN(12, num_heads=3, data_format="channels_first", kernels=kernels)).double()
        x_in = x.clone().requires_grad_()
        y = m(x_in)
        assert y.is_contiguous() and y.shape == (2, 12, 5, 7)
        y += shortcut
        (y * y).sum().backward()
        grads.append([x_in.grad, *(p.grad for p in m.parameters())])
    for fused, plain in zip(*grads, strict=True):
        torch.testing.assert_close(fused, plain)


def test_auto_uses_autograd_for_small_inputs():
    m = DTN(8, num_heads=2, layout=TokenLayout(grid=(3, 3)))
    y = m(torch.randn(2, 9, 8, requires_grad=True))
    assert "Mix" not in type(y.grad_fn).__name__
    with pytest.raises(ValueError, match="kernels"):
        DTN(8, num_heads=2, kernels="fast")


@pytest.mark.slow
@pytest.mark.parametrize("case", ["class_token", "map_channels_first_pooled"])
def test_compiled_kernels_match_autograd(case):
    # the same kernels compiled by torch.compile (float64: only the order of operations differs)
    shape, fmt, grid, prefix, pool, only_var, separable = FUSED_CASES[case]
    layout = TokenLayout(grid=grid, num_prefix_tokens=prefix) if grid else None
    x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    results = []
    for kernels in ("compiled", "autograd"):
        m = randomize(DTN(12, num_heads=3, layout=layout, data_format=fmt, pool_size=pool, only_var=only_var,
                          separable=separable, kernels=kernels)).double()
        x.grad = None
        y = m(x)
        y.backward(torch.ones_like(y))
        results.append([y, x.grad, *(p.grad for p in m.parameters())])
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


@pytest.mark.slow
def test_torch_compile():
    layout = TokenLayout(grid=(4, 4), num_prefix_tokens=1)
    m = randomize(DTN(8, num_heads=2, layout=layout))
    x = torch.randn(2, 17, 8, requires_grad=True)
    y = torch.compile(m)(x)
    y.sum().backward()
    grad = x.grad.clone()
    x.grad = None
    m(x).sum().backward()
    torch.testing.assert_close(y, m(x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, x.grad, rtol=1e-5, atol=1e-5)
