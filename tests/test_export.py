"""``normexp export``: a run's weights out through timm (``local-dir:`` and a ``normexp_*`` name with a file),
into timm's own ViT for a plain-LN run, as ONNX and folded."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import onnxruntime
import pytest
import timm
import torch
import yaml
from timm.models.vision_transformer import VisionTransformer

from normexp.export import export_run, main
from normexp.models import backbone_arguments
from normexp.models.fold import fold_norm_affines
from normexp.models.timm_registry import build_for_timm

DYT = {"name": "dyt", "alpha0": 0.5, "squash": "tanh", "learnable_alpha": True, "kernels": "auto",
       "placement": {"keep": []}}


def trained_model(run: Path) -> torch.nn.Module:
    """The run's model as its checkpoint holds it (no EMA in these runs)."""
    config = yaml.safe_load((run / "config.yaml").read_text())
    name, kwargs = backbone_arguments(config["backbone"])
    model = build_for_timm(name, norm=config["norm"], **kwargs).eval()
    model.load_state_dict(torch.load(run / "checkpoint.pth", weights_only=True)["model"])
    return model


@pytest.fixture(scope="module")
def dyt_run(completed, tmp_path_factory) -> Path:
    """The completed run's record holding a DyT model (random weights, its affine away from (1, 0) so that
    folding has work): export reads the record and the checkpoint, not the training."""
    run = tmp_path_factory.mktemp("dyt") / "run"
    shutil.copytree(completed, run, ignore=shutil.ignore_patterns("export"))
    config = yaml.safe_load((run / "config.yaml").read_text())
    config["norm"] = DYT
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    name, kwargs = backbone_arguments(config["backbone"])
    torch.manual_seed(0)
    model = build_for_timm(name, norm=DYT, **kwargs)
    for module in model.modules():
        if type(module).__name__ == "DyT":
            torch.nn.init.normal_(module.weight, 1.0, 0.3)
            torch.nn.init.normal_(module.bias, 0.0, 0.3)
    state = torch.load(run / "checkpoint.pth", weights_only=True)
    torch.save({**state, "model": model.state_dict(), "config": config}, run / "checkpoint.pth")
    return run


def batch(n: int = 3) -> torch.Tensor:
    return torch.randn(n, 3, 8, 8, generator=torch.Generator().manual_seed(1))


def test_export_round_trips_through_timm(dyt_run, tmp_path):
    done = export_run(str(dyt_run), tmp_path / "out")
    out, x = tmp_path / "out", batch()
    config = json.loads((out / "config.json").read_text())
    assert config["architecture"] == done["architecture"] == "normexp_vit_micro"
    assert config["model_args"]["norm"]["name"] == "dyt" and config["normexp"]["weights"] == "raw"
    assert config["pretrained_cfg"]["input_size"] == [3, 8, 8] and config["pretrained_cfg"]["crop_pct"] == 1.0
    expected = trained_model(dyt_run)(x)
    by_dir = timm.create_model(f"local-dir:{out}", pretrained=True).eval()
    by_name = timm.create_model("normexp_vit_micro", pretrained=True, **config["model_args"],
                                pretrained_cfg_overlay={"file": str(out / "model.safetensors")}).eval()
    for model in (by_dir, by_name):
        torch.testing.assert_close(model(x), expected, rtol=0, atol=1e-6)
    card = (out / "README.md").read_text()
    assert card.startswith("---\ntags:") and "library_name: timm" in card and "license: mit" in card
    assert "arXiv:2503.10622" in card and "| final (epoch 1) | val/top1 | 12.5 | 0 |" in card
    assert "import normexp.models" in card  # the architecture is normexp's


def test_a_layer_norm_vit_loads_into_timms_own_architecture(completed, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(completed, run, ignore=shutil.ignore_patterns("export"))
    done = export_run(str(run))  # to <run>/export
    config = json.loads((run / "export" / "config.json").read_text())
    assert config["architecture"] == done["architecture"] in timm.list_models()
    assert not config["architecture"].startswith("normexp_") and "norm" not in config["model_args"]
    model = timm.create_model(f"local-dir:{run / 'export'}", pretrained=True).eval()
    assert type(model) is VisionTransformer  # timm's class, not normexp's subclass
    torch.testing.assert_close(model(batch()), trained_model(run)(batch()), rtol=0, atol=1e-6)


@pytest.mark.slow  # torch.export's ONNX exporter takes 5-8 s for the 6-block micro ViT
def test_onnx_graph_matches_eager_at_any_batch_size(dyt_run, tmp_path):
    done = export_run(str(dyt_run), tmp_path, onnx=True)
    assert done["onnx_max_abs_diff"] <= 1e-4
    session = onnxruntime.InferenceSession(str(tmp_path / "model.onnx"), providers=["CPUExecutionProvider"])
    x = batch(5)  # not the export's batch of 4
    got = torch.from_numpy(session.run(None, {"input": x.numpy()})[0])
    torch.testing.assert_close(got, trained_model(dyt_run)(x).detach(), rtol=0, atol=1e-4)


def test_folding_drops_the_norms_affine_and_keeps_the_logits(dyt_run, tmp_path, capsys):
    main([str(dyt_run), "--to", str(tmp_path), "--fold"])
    said = capsys.readouterr().out
    assert "folded 13 norms' affine: 675,191 -> 672,695 params" in said  # 6 blocks x 2 + the final norm
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_args"]["fold"] is True and config["normexp"]["folded"] is True
    model = timm.create_model(f"local-dir:{tmp_path}", pretrained=True).eval()
    assert "blocks.0.norm1.weight" not in model.state_dict() and model.blocks[0].norm1.alpha.numel() == 1
    torch.testing.assert_close(model(batch()), trained_model(dyt_run)(batch()), rtol=0, atol=1e-5)


def test_the_weights_exported_are_those_the_record_reports(dyt_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(dyt_run, run)
    summary = json.loads((run / "summary.json").read_text())
    summary["metrics"]["reported"]["weights"] = "ema"  # a run whose reported metric is its EMA's
    (run / "summary.json").write_text(json.dumps(summary))
    state = torch.load(run / "checkpoint.pth", weights_only=True)
    ema = {k: v + 1 if k == "head.bias" else v for k, v in state["model"].items()}
    torch.save({**state, "ema": ema}, run / "checkpoint.pth")
    assert export_run(str(run), tmp_path / "out")["weights"] == "ema"
    model = timm.create_model(f"local-dir:{tmp_path / 'out'}", pretrained=True)
    torch.testing.assert_close(model.head.bias, ema["head.bias"], rtol=0, atol=0)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["normexp"]["weights"] == "ema"
    assert "**Weights:** the EMA's" in (tmp_path / "out" / "README.md").read_text()


def test_fold_refuses_a_model_whose_norms_sit_on_the_residual_stream():
    model = build_for_timm("vit_micro", norm=DYT, img_size=8, num_classes=10, norm_position="post")
    with pytest.raises(ValueError, match="declares no Linear layer reading its norms"):
        fold_norm_affines(model)


@pytest.mark.parametrize("case", ["no run", "other files in --to"])
def test_bad_input_is_one_line_and_nothing_is_lost(completed, tmp_path, capsys, case):
    kept = tmp_path / "out" / "notes.txt"
    kept.parent.mkdir()
    kept.write_text("mine")
    args = [str(tmp_path / "nope")] if case == "no run" else [str(completed), "--to", str(kept.parent)]
    with pytest.raises(SystemExit) as stop:
        main(args)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1
    assert ("no run at" if case == "no run" else "holds other files") in err
    assert kept.read_text() == "mine" and sorted(p.name for p in kept.parent.iterdir()) == ["notes.txt"]
