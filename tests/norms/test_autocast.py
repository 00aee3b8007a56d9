"""Normalizers under autocast: the output dtype is LayerNorm's for the same input (CUDA autocast runs
layer_norm in float32; CPU autocast keeps a bfloat16 input's dtype), gradients finite and in the input's
dtype, on every kernel path."""

from __future__ import annotations

import pytest
import torch

from normexp.norms import TokenLayout, list_norms, norm_layer_factory

DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]
CASES = {  # name -> (normalizer, hyper-parameters)
    "dyt": ("dyt", {}), "dyt_eager": ("dyt", {"kernels": "eager"}),
    "dtn": ("dtn", {}), "dtn_eager": ("dtn", {"kernels": "eager"}),
    "derf_eager": ("derf", {"kernels": "eager"}), "rms_eager": ("rms", {"kernels": "eager"}),
    "dyisru_eager": ("pointwise", {"fn": "dyisru", "kernels": "eager"}),
}


def build(norm: str, hparams: dict, device: str) -> torch.nn.Module:
    layout = TokenLayout(grid=(3, 3), num_prefix_tokens=1)
    return norm_layer_factory(norm, **hparams)(8, num_heads=2, layout=layout, num_prefix_tokens=1).to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32_input", "bf16_input"])
@pytest.mark.parametrize("case", CASES)
def test_output_dtype_is_layernorms_under_autocast(case, dtype, device):
    norm, hparams = CASES[case]
    layer, ln = build(norm, hparams, device), build("ln", {}, device)
    x = torch.randn(2, 10, 8, device=device, dtype=dtype, requires_grad=True)
    with torch.autocast(device, dtype=torch.bfloat16):
        y, expected = layer(x), ln(x).dtype
    y.float().square().sum().backward()
    assert y.dtype == expected
    assert x.grad.dtype == dtype and torch.isfinite(x.grad).all()
    assert all(torch.isfinite(p.grad).all() for p in layer.parameters() if p.grad is not None)


@pytest.mark.parametrize("norm", list_norms())
def test_bfloat16_model(norm):
    # a model cast to bfloat16 as a whole (parameters included): every normalizer runs, output in bfloat16
    layer = build(norm, {}, "cpu").to(torch.bfloat16)
    x = torch.randn(2, 10, 8, dtype=torch.bfloat16, requires_grad=True)
    y = layer(x)
    y.float().square().sum().backward()
    assert y.dtype == torch.bfloat16 and torch.isfinite(y.float()).all()
    assert torch.isfinite(x.grad.float()).all()
