"""``normexp export``: a finished classification run as timm and the Hugging Face Hub read a model.

    normexp export outputs/classification/vit_micro-dyt-digits-s0-1a2b3c4d     # -> <run>/export
    normexp export run:<run_id> --to my_model --onnx --fold

Writes timm's ``save_for_hf`` layout (timm ``models/_hub.py``): ``model.safetensors`` (the state dict of the
weights the run reports: the EMA's when ``trainer.ema.reported``, else the trained model's, as the record's
``metrics.reported.weights`` says), ``config.json`` (``architecture``, ``num_classes``, ``num_features``,
``model_args``, and ``pretrained_cfg`` with the input size, mean / std, crop and interpolation the run's data
used) and ``README.md``, a model card from the run record (metrics with seed and scale, the resolved config,
the data, the commit, the versions, the papers of the normalizer). A ViT with plain LayerNorm loads into
timm's own architecture (``config.json`` names it: no normexp needed); every other model is
``normexp_<backbone>``, which ``import normexp.models`` registers in timm
(:mod:`normexp.models.timm_registry`).
Either way ``timm.create_model("local-dir:<dir>", pretrained=True)`` gives the run's logits, which the export
checks before writing.

``--onnx`` adds ``model.onnx`` (batch size free), checked against eager PyTorch with onnxruntime.
``--fold`` exports the inference variant with the norms' per-channel affine folded into the Linear layers that
read them (FlashNorm, arXiv 2407.09577; :mod:`normexp.models.fold`): ``model_args.fold`` builds it.

Bad input (no such run, no checkpoint, a run without a classifier, a ``--to`` that holds other files) is one
``error:`` line, exit code 2, nothing written or deleted.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import nn

from .engine.checkpoint import load_checkpoint, load_model_state, reported_weights
from .errors import UserError, one_line
from .models import backbone_arguments, timm_name
from .models.fold import fold_norm_affines
from .models.registry import _MODELS, model_classes
from .models.timm_registry import build_for_timm
from .tracking.records import read_config, read_summary
from .tracking.run_dir import resolve_source

FILES = ("model.safetensors", "config.json", "README.md", "model.onnx")  # what an export directory holds
ONNX_TOLERANCE = 1e-4  # max |onnxruntime - eager| on the check batch
FOLD_TOLERANCE = 1e-5  # max |folded - unfolded| logits
CHECK_BATCH = 4
LICENSE = "mit"  # normexp's (pyproject.toml); the weights are the user's run

# BibTeX by normalizer: what the model card cites
LAYER_NORM = """@article{ba2016layer,
  title = {Layer Normalization},
  author = {Ba, Jimmy Lei and Kiros, Jamie Ryan and Hinton, Geoffrey E.},
  journal = {arXiv preprint arXiv:1607.06450},
  year = {2016}
}"""
DYT = """@inproceedings{zhu2025transformers,
  title = {Transformers without Normalization},
  author = {Zhu, Jiachen and Chen, Xinlei and He, Kaiming and LeCun, Yann and Liu, Zhuang},
  booktitle = {CVPR},
  year = {2025},
  note = {arXiv:2503.10622}
}"""
DERF = """@article{chen2025stronger,
  title = {Stronger Normalization-Free Transformers},
  author = {Chen, Mingzhi and Lu, Taiming and Zhu, Jiachen and Sun, Mingjie and Liu, Zhuang},
  journal = {arXiv preprint arXiv:2512.10938},
  year = {2025}
}"""
DTN = """@inproceedings{shao2022dynamic,
  title = {Dynamic Token Normalization Improves Vision Transformers},
  author = {Shao, Wenqi and Ge, Yixiao and Zhang, Zhaoyang and Xu, Xuyuan and Wang, Xiaogang and
            Shan, Ying and Luo, Ping},
  booktitle = {ICLR},
  year = {2022},
  note = {arXiv:2112.02624}
}"""
FLASHNORM = """@article{graef2024flashnorm,
  title = {FlashNorm: Fast Normalization for Transformers},
  author = {Graef, Nils and others},
  journal = {arXiv preprint arXiv:2407.09577},
  year = {2024}
}"""
CITATIONS = {"ln": (LAYER_NORM,), "dyt": (DYT,), "derf": (DERF, DYT), "pointwise": (DERF, DYT), "dtn": (DTN,)}


def run_directory(source: str) -> Path:
    """The run directory ``source`` names (a path or ``run:<run_id>``), checked to hold a run record."""
    directory = resolve_source(source)
    if not (directory / "summary.json").is_file():
        raise UserError(f"no run at '{source}': give a run directory (one with summary.json) or run:<run_id>")
    return directory


def check_target(target: Path) -> None:
    """``--to`` is new, empty, or a previous export (its files only, config.json naming a run): else one
    line, nothing touched."""
    if not target.exists():
        return
    if not target.is_dir():
        raise UserError(f"--to '{target}' is a file: give a directory")
    present = {p.name for p in target.iterdir()}
    try:
        previous = present <= set(FILES) and "normexp" in json.loads((target / "config.json").read_text())
    except (OSError, ValueError, TypeError):  # no config.json, or not one of ours
        previous = False
    if present and not previous:
        raise UserError(f"--to '{target}' holds other files ({', '.join(sorted(present)[:3])}): give a new "
                        "or empty directory, or a previous export to replace")


def preprocessing(data: dict[str, Any], in_chans: int, img_size: int) -> dict[str, Any]:
    """timm's data config of what the run's evaluation fed the model: the data config's mean / std, centre
    crop and interpolation, or (the digits) the train split's standardisation of the images upscaled
    bilinearly to ``img_size``, uncropped (``normexp.data.digits``)."""
    if "mean" in data:
        mean, std = tuple(data["mean"]), tuple(data["std"])
        crop_pct, interpolation = data.get("crop_pct", 1.0), data.get("interpolation", "bicubic")
    else:
        from .data.digits import digits_arrays, standardisation

        pixel_mean, pixel_std = standardisation(digits_arrays(data["img_size"], data["val_fraction"],
                                                              data["split_seed"]))
        mean, std, crop_pct, interpolation = (pixel_mean,) * 3, (pixel_std,) * 3, 1.0, "bilinear"
    return {"input_size": (in_chans, img_size, img_size), "mean": mean, "std": std, "crop_pct": crop_pct,
            "interpolation": interpolation, "crop_mode": "center"}


def classifier_name(model: nn.Module) -> str:
    """The module name of ``model``'s classifier; a model without one (num_classes 0, no head) is refused."""
    get = getattr(model, "get_classifier", None)
    head = get() if get is not None else None
    name = next((n for n, m in model.named_modules() if m is head and n), None)
    if not isinstance(head, nn.Linear) or name is None:
        raise UserError(f"{type(model).__name__} has no linear classifier to export: export a classification "
                        "run (fine-tune this one first: task=classification task.pretrained=<run>)")
    return name


def plain_layer_norm(norm: dict[str, Any]) -> bool:
    """Whether the run's norm is timm ViT's own: LayerNorm, eps 1e-6, with its affine, in every slot."""
    keep = (norm.get("placement") or {}).get("keep")
    return norm.get("name") == "ln" and norm.get("eps") == 1e-6 and norm.get("affine", True) and not keep


def logits(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(batch)


def loaded_in_timm(architecture: str, model_args: dict[str, Any], state: dict[str, torch.Tensor],
                   pretrained_cfg: dict[str, Any]) -> nn.Module:
    """The model timm builds from ``config.json``'s ``architecture`` and ``model_args``, ``state`` loaded
    strictly: what ``timm.create_model("local-dir:...", pretrained=True)`` gives."""
    import timm

    model = timm.create_model(architecture, pretrained_cfg=pretrained_cfg, **model_args).eval()
    model.load_state_dict(state, strict=True)
    return model


def timm_twin_model(name: str, kwargs: dict[str, Any], norm: dict[str, Any], state: dict[str, torch.Tensor],
                    cfg: dict[str, Any], batch: torch.Tensor, expected: torch.Tensor) -> nn.Module | None:
    """The run's model in timm's own architecture (its family's ``timm_twin``), when its norms are timm's and
    timm's model gives the same logits; else None."""
    if not plain_layer_norm(norm):
        return None
    twin = model_classes(name)[0].timm_twin({**getattr(_MODELS[name], "settings", {}), **kwargs})
    if twin is None:
        return None
    try:
        model = loaded_in_timm(*twin, state, cfg)
    except (RuntimeError, TypeError, ValueError):  # keys or shapes timm's model does not have
        return None
    return model if torch.allclose(logits(model, batch), expected, rtol=0, atol=1e-6) else None


def metrics_table(summary: dict[str, Any], config: dict[str, Any]) -> str:
    """The record's final, best and reported evaluations as a Markdown table, with seed and scale."""
    scale = (config.get("table") or {}).get("scale") or \
        f"not a table run ({config['trainer']['epochs']} epochs, {config['data']['name']} at " \
        f"{config['data']['img_size']} px)"
    rows = ["| evaluation | metric | value | seed | scale |", "|---|---|---|---|---|"]
    for which, values in (summary.get("metrics") or {}).items():
        for key, value in values.items():
            if isinstance(value, (int, float)) and key != "epoch":
                rows.append(f"| {which} (epoch {values.get('epoch', '-')}) | {key} | {value:.6g} | "
                            f"{summary.get('seed')} | {scale} |")
    return "\n".join(rows)


def model_card(summary: dict[str, Any], config: dict[str, Any], architecture: str, weights: str,
               params: int, folded: dict[str, Any] | None, onnx_diff: float | None) -> str:
    """``README.md``: timm's model-card front matter (``generate_readme`` in timm ``models/_hub.py``) and the
    run record."""
    norm, data = config["norm"], config["data"]
    backbone = config["backbone"]["name"]
    tags = ["image-classification", "timm", "normexp", norm["name"], backbone]
    git = summary.get("git") or {}
    commit = f"{git.get('commit')}{' (uncommitted changes)' if git.get('dirty') else ''}"
    ours = architecture.startswith(timm_name(""))
    load = ["import timm", *(["import normexp.models  # registers normexp_* in timm's model registry"] if ours
                             else []),
            'model = timm.create_model("local-dir:<this directory>", pretrained=True)  # or "hf-hub:<repo>"',
            "model.eval()",
            "transform = timm.data.create_transform(**timm.data.resolve_model_data_config(model))"]
    details = [
        f"- **Model type:** image classification ({data['num_classes']} classes), `{backbone}` with "
        f"norm=`{norm['name']}`",
        f"- **Architecture:** `{architecture}` ({'normexp' if ours else 'timm'}'s own)",
        f"- **Params:** {params:,}",
        f"- **Weights:** {'the EMA' if weights == 'ema' else 'the trained model'}'s, as the run reports them "
        "(`metrics.reported`)",
        f"- **Dataset:** {data['name']}",
        f"- **Run:** `{summary.get('run_id')}` (`{summary.get('name')}`), {summary.get('status')}",
        f"- **Code:** normexp {summary.get('versions', {}).get('normexp', '')}, commit {commit}",
        "- **Versions:** " + ", ".join(f"{k} {v}" for k, v in (summary.get("versions") or {}).items()),
    ]
    if folded is not None:
        details.append(f"- **Folded for inference:** the affine of {len(folded['norms'])} norms folded into "
                       f"the Linear layers that read them (FlashNorm, arXiv 2407.09577): "
                       f"{folded['params_before']:,} -> {folded['params_after']:,} parameters, logits within "
                       f"{folded['max_abs_diff']:.2g}")
    if onnx_diff is not None:
        details.append(f"- **ONNX:** `model.onnx`, onnxruntime within {onnx_diff:.2g} of PyTorch on a batch")
    citations = list(CITATIONS.get(norm["name"], ())) + ([FLASHNORM] if folded is not None else [])
    lines = ["---", "tags:", *[f"- {t}" for t in tags], "pipeline_tag: image-classification",
             "library_name: timm", f"license: {LICENSE}", "datasets:", f"- {data['name']}", "---",
             f"# Model card for {summary.get('name')}", "",
             f"A `{backbone}` trained with the `{norm['name']}` normalizer by normexp, exported from its run "
             "record.", "", "## Model Details", *details, "", "## Model Usage", "```python", *load, "```", "",
             "## Metrics", metrics_table(summary, config), "", "## Config", "The run's resolved config:", "",
             "```yaml", yaml.safe_dump(config, sort_keys=False).rstrip(), "```"]
    if citations:
        lines += ["", "## Citation", *[f"```bibtex\n{c}\n```" for c in citations]]
    return "\n".join(lines) + "\n"


def plain_kernels(model: nn.Module) -> None:
    """Every norm layer on its plain (``autograd``) path: the fused kernels are custom autograd Functions
    (``normexp.norms.kernels``) that the exporter does not trace through."""
    for module in model.modules():
        if hasattr(module, "kernels"):
            module.kernels = "autograd"


def export_onnx(model: nn.Module, batch: torch.Tensor, path: Path) -> float:
    """``model`` as an ONNX graph with a free batch size at ``path``; the max |onnxruntime - eager| on
    ``batch``, refused above :data:`ONNX_TOLERANCE`."""
    import io
    import warnings
    from contextlib import redirect_stdout

    import onnxruntime

    model = copy.deepcopy(model)
    plain_kernels(model)
    # dynamo=True: torch.export's exporter, torch's default since 2.9 and the maintained one; the TorchScript
    # exporter (dynamo=False) also exports these models on torch 2.14, faster, but is deprecated and warns so
    with redirect_stdout(io.StringIO()), warnings.catch_warnings():  # its progress lines and tracer notes
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (batch,), str(path), dynamo=True, external_data=False, input_names=["input"],
                          output_names=["logits"], dynamic_shapes=({0: torch.export.Dim("batch")},))
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = torch.from_numpy(session.run(None, {"input": batch.numpy()})[0])
    diff = (got - logits(model, batch)).abs().max().item()
    if diff > ONNX_TOLERANCE:
        path.unlink()
        raise RuntimeError(f"the ONNX graph differs from PyTorch by {diff:.3g} (> {ONNX_TOLERANCE})")
    return diff


def run_model(directory: Path, summary: dict[str, Any], config: dict[str, Any]) -> tuple[nn.Module, str]:
    """The run's model with the weights its record reports (the EMA's when its metric is the EMA's), and which
    weights they are; a run that is not a completed classification run is refused."""
    if summary.get("status") != "completed":
        raise UserError(f"run '{directory}' is {summary.get('status')}: export a completed run")
    task = config["task"]
    if task["name"] != "classification" or task.get("linear_probe"):
        probe = " (a linear probe)" if task.get("linear_probe") else ""
        raise UserError(f"run '{directory}' is a {task['name']} run{probe}: its model has no trained "
                        "classifier to export; fine-tune it first (task=classification "
                        "task.pretrained=<run>) and export that run")
    name, kwargs = backbone_arguments(config["backbone"])
    model = build_for_timm(name, norm=config["norm"], **kwargs).eval()
    classifier_name(model)
    reported = ((summary.get("metrics") or {}).get("reported") or {}).get("weights")
    ema = None if reported is None else reported == "ema"
    weights, which = reported_weights(load_checkpoint(directory), ema)
    load_model_state(model, weights, str(directory))
    return model, which


def fold_checked(model: nn.Module, batch: torch.Tensor, expected: torch.Tensor) -> dict[str, Any]:
    """Fold ``model``'s norms' affine in place, checked to keep the logits within :data:`FOLD_TOLERANCE`."""
    before = sum(p.numel() for p in model.parameters())
    try:
        norms = fold_norm_affines(model)
    except ValueError as e:
        raise UserError(f"--fold: {e}; fold a ViT with norm_position=pre") from e
    diff = (logits(model, batch) - expected).abs().max().item()
    if diff > FOLD_TOLERANCE:
        raise RuntimeError(f"folding changed the logits by {diff:.3g} (> {FOLD_TOLERANCE})")
    after = sum(p.numel() for p in model.parameters())
    return {"norms": norms, "params_before": before, "params_after": after, "max_abs_diff": diff}


def export_run(source: str, to: str | Path | None = None, onnx: bool = False, fold: bool = False
               ) -> dict[str, Any]:
    """Export the run ``source`` (a directory or ``run:<run_id>``) to ``to`` (default ``<run>/export``);
    returns what was written and checked."""
    import safetensors.torch
    from timm.models._hub import save_config_for_hf

    directory = run_directory(source)
    summary, config = read_summary(directory), read_config(directory)
    target = Path(to) if to is not None else directory / "export"
    check_target(target)
    model, which = run_model(directory, summary, config)
    name, kwargs = backbone_arguments(config["backbone"])
    in_chans, img_size = kwargs.get("in_chans", 3), kwargs.get("img_size", config["data"]["img_size"])
    batch = torch.randn(CHECK_BATCH, in_chans, img_size, img_size, generator=torch.Generator().manual_seed(0))
    expected = logits(model, batch)
    folded = fold_checked(model, batch, expected) if fold else None
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    head = classifier_name(model)
    cfg = {"classifier": head, "num_classes": model.get_submodule(head).out_features, "license": LICENSE,
           "description": f"normexp run {summary['run_id']} ({summary.get('name')})"}
    exported = None if fold else timm_twin_model(name, kwargs, config["norm"], state, cfg, batch, expected)
    if exported is None:
        model_args = {**kwargs, "norm": config["norm"], **({"fold": True} if fold else {})}
        exported = loaded_in_timm(timm_name(name), model_args, state, cfg)
        diff = (logits(exported, batch) - expected).abs().max().item()
        if diff > FOLD_TOLERANCE:
            raise RuntimeError(f"timm's {timm_name(name)} gives other logits than the run's ({diff:.3g})")
    architecture = exported.pretrained_cfg["architecture"]

    target.mkdir(parents=True, exist_ok=True)
    safetensors.torch.save_file(state, str(target / "model.safetensors"), metadata={"format": "pt"})
    record = {"run_id": summary["run_id"], "weights": which, "folded": fold}
    save_config_for_hf(exported, str(target / "config.json"), model_config={"normexp": record},
                       data_config=preprocessing(config["data"], in_chans, img_size))
    onnx_diff = export_onnx(exported, batch, target / "model.onnx") if onnx else None
    if not onnx and (target / "model.onnx").exists():  # a previous export's graph of other weights
        (target / "model.onnx").unlink()
    params = sum(p.numel() for p in exported.parameters())
    card = model_card(summary, config, architecture, which, params, folded, onnx_diff)
    (target / "README.md").write_text(card)
    return {"to": target, "architecture": architecture, "weights": which, "params": params, "folded": folded,
            "onnx_max_abs_diff": onnx_diff}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="normexp export", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", help="a run directory, or run:<run_id> (found under the output root)")
    parser.add_argument("--to", help="the export directory (default: <run>/export)")
    parser.add_argument("--onnx", action="store_true", help="also model.onnx, checked with onnxruntime")
    parser.add_argument("--fold", action="store_true",
                        help="fold the norms' affine into the Linear layers that read them (inference)")
    args = parser.parse_args(argv)
    try:
        done = export_run(args.run, args.to, onnx=args.onnx, fold=args.fold)
    except UserError as e:
        print(f"error: {one_line(e)}", file=sys.stderr)
        sys.exit(2)
    print(f"exported {done['weights']} weights as {done['architecture']} ({done['params']:,} params) to "
          f"{done['to']}")
    if done["folded"] is not None:
        f = done["folded"]
        print(f"folded {len(f['norms'])} norms' affine: {f['params_before']:,} -> {f['params_after']:,} "
              f"params, logits max |diff| {f['max_abs_diff']:.3g}")
    if done["onnx_max_abs_diff"] is not None:
        print(f"model.onnx: onnxruntime max |diff| {done['onnx_max_abs_diff']:.3g} against PyTorch")


if __name__ == "__main__":
    main()
