"""Bringing a model in: weights from timm and from files (``task.pretrained``), their LayerNorms converted to
point-wise layers with alpha calibrated, each layer's R^2 and the starting top-1 in the record."""

from __future__ import annotations

import hashlib
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import compose_cfg, quick_cfg
from safetensors.torch import save_file
from timm.models.vision_transformer import VisionTransformer

from normexp.errors import UserError
from normexp.models import build_backbone
from normexp.norms.dyt import DyT
from normexp.preflight import validate
from normexp.run import run
from normexp.tasks.classification import load_pretrained
from normexp.tasks.conversion import calibrate_and_compare, converted_layers

TIMM_NAME = "vit_tiny_patch16_224.augreg_in21k_ft_in1k"  # timm's twin of backbone=vit_tiny (DeiT-Ti)


def timm_vit(**size) -> VisionTransformer:
    """A timm ViT with random weights, standing in for a download."""
    torch.manual_seed(0)
    model = VisionTransformer(**size)
    with torch.no_grad():  # LayerNorms with an affine of their own, as trained ones have
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.add_(torch.randn_like(parameter) * 0.1)
    return model


MICRO = dict(img_size=16, patch_size=2, embed_dim=96, depth=6, num_heads=4, num_classes=10)  # vit_micro's


@pytest.fixture(scope="module")
def weight_files(tmp_path_factory) -> dict[str, Path]:
    """The same random micro ViT as .safetensors and as .pth (timm's own layout)."""
    root = tmp_path_factory.mktemp("weights")
    state = timm_vit(**MICRO).state_dict()
    save_file(state, root / "micro.safetensors")
    torch.save(state, root / "micro.pth")
    return {"safetensors": root / "micro.safetensors", "pth": root / "micro.pth"}


def converted(source: Path, *overrides: str) -> tuple[torch.nn.Module, dict, torch.nn.Module]:
    cfg = quick_cfg(f"task.pretrained={source}", *overrides)
    model = build_backbone(cfg.backbone, cfg.norm)
    report, source_model = load_pretrained(model, cfg)
    return model, report, source_model


@pytest.mark.parametrize("kind", ["safetensors", "pth"])
def test_a_weight_file_converts_to_dyt_keeping_each_layernorms_affine(weight_files, kind):
    path = weight_files[kind]
    model, report, _ = converted(path, "norm=dyt")
    state = torch.load(weight_files["pth"], weights_only=True)
    assert report["kind"] == "file" and report["file"] == str(path)
    assert report["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert report["converted"]["from"] == "ln" and report["converted"]["to"] == "dyt"
    assert "blocks.0.norm1.alpha" in report["fresh"] and report["dropped"] == []
    for name in ("blocks.0.norm1", "blocks.5.norm2", "norm"):
        layer = model.get_submodule(name)
        assert isinstance(layer, DyT)
        assert torch.equal(layer.weight, state[f"{name}.weight"])
        assert torch.equal(layer.bias, state[f"{name}.bias"])
    # quick_cfg's digits are 8 px: the 16 px position table was resampled by timm's checkpoint_filter_fn
    assert model.pos_embed.shape[1] == 1 + 4 * 4
    assert torch.equal(model.blocks[3].attn.qkv.weight, state["blocks.3.attn.qkv.weight"])


def test_with_a_tiny_alpha_the_converted_layer_is_layernorms_affine_map(weight_files):
    """DyT(x) = gamma tanh(alpha x) + beta -> gamma alpha x + beta: on normalised tokens, (DyT - beta) / alpha
    is LayerNorm's gamma x_hat, the affine carried over exactly."""
    alpha = 1e-4
    model, _, source = converted(weight_files["safetensors"], "norm=dyt", f"norm.alpha0={alpha}")
    tokens = torch.randn(4, 17, 96, dtype=torch.float64)
    x_hat = (tokens - tokens.mean(-1, keepdim=True)) / tokens.std(-1, unbiased=False, keepdim=True)
    for name, norm, layer in converted_layers(source, model):
        ln, dyt = norm.double(), layer.double()
        with torch.no_grad():
            linear = (dyt(x_hat) - dyt.bias) / alpha
            assert torch.allclose(linear, ln(x_hat) - ln.bias, rtol=1e-6, atol=1e-6), name


def test_r2_and_calibrated_alpha_equal_a_direct_computation(weight_files):
    model, _, source = converted(weight_files["safetensors"], "norm=derf", "norm.alpha_init=calibrate")
    torch.manual_seed(1)
    images = [torch.randn(6, 3, 8, 8) for _ in range(2)]
    seen: dict[str, list] = {}
    hooks = [norm.register_forward_hook(lambda m, a, y, n=name: seen.setdefault(n, []).append((a[0], y)))
             for name, norm, _ in converted_layers(source, model)]
    with torch.no_grad():
        for batch in images:
            source.eval()(batch)
    for hook in hooks:
        hook.remove()
    report = calibrate_and_compare(source, model, images)
    assert len(report["layers"]) == 2 * 6 + 1  # every block's two norms and the final one
    for entry in report["layers"]:
        x = torch.cat([a.flatten() for a, _ in seen[entry["layer"]]]).double().numpy()
        assert entry["input_std"] == pytest.approx(x.std(), rel=1e-9)
        assert entry["alpha"] == pytest.approx(math.sqrt(math.pi) / 2 / x.std(), rel=1e-5)  # 1 / erf'(0)
        layer = model.get_submodule(entry["layer"])
        with torch.no_grad():
            y = np.concatenate([out.flatten().double().numpy() for _, out in seen[entry["layer"]]])
            y_new = np.concatenate([layer(a).flatten().double().numpy() for a, _ in seen[entry["layer"]]])
        direct = 1 - ((y_new - y) ** 2).sum() / ((y - y.mean()) ** 2).sum()
        assert entry["r2"] == pytest.approx(direct, abs=1e-9)
    assert report["r2"] == pytest.approx(np.mean([e["r2"] for e in report["layers"]]))


def test_a_timm_name_loads_from_an_offline_cache(tmp_path, monkeypatch):
    """``timm:<name>`` reads what timm's pretrained=True reads: the Hub's file, here from a cache made as
    huggingface_hub lays it out, with the Hub switched off."""
    from huggingface_hub import constants

    repo = tmp_path / "hub" / f"models--timm--{TIMM_NAME}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    snapshot = repo / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    state = timm_vit(patch_size=16, embed_dim=192, depth=12, num_heads=3).state_dict()
    save_file(state, snapshot / "model.safetensors")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    cfg = compose_cfg("backbone=vit_tiny", "norm=dyt", f"task.pretrained=timm:{TIMM_NAME}")
    model = build_backbone(cfg.backbone, cfg.norm)
    report, _ = load_pretrained(model, cfg)
    assert report["kind"] == "timm" and report["hf_hub_id"] == f"timm/{TIMM_NAME}"
    assert report["file"] == str(snapshot / "model.safetensors")
    assert torch.equal(model.blocks[11].norm2.weight, state["blocks.11.norm2.weight"])
    assert {"head.weight", "head.bias"} <= set(report["fresh"])  # ImageNet's 1000 classes, the digits' 10
    # not in the cache, offline: one line that says how to get it
    shutil.rmtree(tmp_path / "hub")
    with pytest.raises(UserError, match="HF_HUB_OFFLINE=1") as error:
        load_pretrained(build_backbone(cfg.backbone, cfg.norm), cfg)
    assert "\n" not in str(error.value)


def test_foreign_weights_that_do_not_fit_or_cannot_calibrate_are_one_line(tmp_path, weight_files):
    other = tmp_path / "wide.safetensors"
    save_file(timm_vit(**{**MICRO, "embed_dim": 64}).state_dict(), other)
    with pytest.raises(UserError, match=r"does not match the backbone ViT: shape mismatch .*'cls_token") as e:
        validate(quick_cfg(f"task.pretrained={other}", "norm=dyt"))
    assert "\n" not in str(e.value)
    with pytest.raises(UserError, match="needs? .*task.pretrained|give task.pretrained"):
        validate(quick_cfg("norm=dyt", "norm.alpha_init=calibrate"))
    with pytest.raises(UserError, match="cubsign has slope 0 at 0"):
        validate(quick_cfg(f"task.pretrained={weight_files['pth']}", "norm=pointwise", "norm.fn=cubsign",
                           "norm.alpha_init=calibrate"))
    with pytest.raises(UserError, match="timm has no pretrained model 'vit_tiny_patch16_244'.*did you mean"):
        validate(compose_cfg("backbone=vit_tiny", "task.pretrained=timm:vit_tiny_patch16_244"))


def test_a_run_converted_from_an_ln_run_records_r2_and_its_starting_top1(completed, tmp_path):
    source = tmp_path / "source"
    shutil.copytree(completed, source)
    summary = run(quick_cfg(f"task.pretrained={source}", "task.keep_pretrained_norm=false", "norm=dyt",
                            "norm.alpha_init=calibrate"), tmp_path / "run")
    assert summary["status"] == "completed"
    pretrained = summary["pretrained"]
    assert pretrained["kind"] == "run" and pretrained["converted"]["to"] == "dyt"
    layers = pretrained["converted"]["layers"]
    assert [layer["layer"] for layer in layers][:2] == ["blocks.0.norm1", "blocks.0.norm2"]
    assert all(0 < layer["r2"] <= 1 and layer["alpha"] == pytest.approx(1 / layer["input_std"], rel=1e-5)
               for layer in layers)
    assert 0 <= pretrained["start"]["top1"] <= 100 and set(pretrained["start"]) == {"loss", "top1", "top5"}
