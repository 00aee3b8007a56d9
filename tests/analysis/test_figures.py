"""Figure specs: every one plans at every scale, shares its smoke runs with the tables, renders from run
records (a run without a result is said, not drawn), and refuses bad input with one line."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from conftest import ROOT

from normexp.analysis import figures
from normexp.analysis.figures import list_figures, load_figure, make_plan, render
from normexp.models import build_backbone
from normexp.tables.cli import make_plan as table_plan
from normexp.tables.spec import list_scales

# at smoke scale each figure's runs are runs of these tables: made once, shared
SHARED = {"dyt_io": ("dyt_imagenet", "dyt_dit"), "dyt_alpha": ("dyt_imagenet",), "dtn_tokens": ("dtn_norms",),
          "dtn_attention": ("dtn_norms",), "pointwise_activations": ("pointwise",)}


def test_the_four_paper_figures_exist():
    assert set(SHARED) <= set(list_figures())


@pytest.mark.parametrize("scale", [s for s in list_scales() if s != "smoke"])  # smoke: in the test below
def test_every_figure_plans_at_every_scale(scale, tmp_path):
    for name in list_figures():
        plan = make_plan(load_figure(name), scale, None, [], root=tmp_path)
        assert plan.runs and all(r.status == "missing" for r in plan.runs)


@pytest.mark.parametrize("figure", sorted(SHARED))
def test_smoke_figure_runs_are_the_tables_runs(figure, tmp_path):
    theirs = {r.run_id for table in SHARED[figure]
              for r in table_plan(table, "smoke", None, [], root=tmp_path).runs}
    mine = {r.run_id for r in make_plan(load_figure(figure), "smoke", None, [], root=tmp_path).runs}
    assert mine and mine <= theirs


def fabricate(plan, root: Path, diverged: str | None = None) -> None:
    """Records of the planned runs as training leaves them (untrained weights: the analysis reads a model, not
    its accuracy); the run labelled ``diverged`` ends diverged."""
    for run in plan.runs:
        run_dir = run.dir
        run_dir.mkdir(parents=True)
        (run_dir / "config.yaml").write_text(yaml.safe_dump(run.config))
        status = "diverged" if run.config["norm"]["name"] == diverged else "completed"
        summary = {"status": status, "run_id": run.run_id, "metrics": {"final": {"val/top1": 50.0}}}
        if status == "diverged":
            summary["error"] = "diverged at step 7 (epoch 1): loss nan"
        (run_dir / "summary.json").write_text(json.dumps(summary))
        torch.manual_seed(0)
        model = build_backbone(run.config["backbone"], run.config["norm"])
        torch.save({"model": model.state_dict(), "epoch": 8}, run_dir / "checkpoint.pth")


@pytest.mark.parametrize("figure", ["dtn_attention", "dtn_tokens", "dyt_io", "dyt_alpha",
                                    "pointwise_activations"])
def test_figure_renders_from_records_and_says_which_runs_are_missing(figure, tmp_path, capsys):
    spec = dataclasses.replace(load_figure(figure), images=2, points=200)
    fabricate(make_plan(spec, "smoke", None, [], root=tmp_path), tmp_path, diverged="in")
    plan = make_plan(spec, "smoke", None, [], root=tmp_path)
    assert all(r.status in ("completed", "diverged") for r in plan.runs)
    out = tmp_path / "results" / "figures"
    status = render(spec, plan, out)
    record = json.loads((out / f"{figure}.json").read_text())
    assert (out / f"{figure}.png").stat().st_size > 10_000
    labels = [r["label"] for r in record["runs"]]
    assert labels == {"dtn_attention": ["LN", "IN", "DTN"], "dtn_tokens": ["LN", "IN", "DTN"],
                      "dyt_io": ["ViT-B / LN", "ViT-B / DyT", "DiT-XL/2 / LN", "DiT-XL/2 / DyT"],
                      "dyt_alpha": ["ViT-B / DyT", "ConvNeXt-B / DyT"],
                      "pointwise_activations": ["LN / —", "DyT / —", "point-wise / erf", "point-wise / tanh",
                                                "point-wise / arctan"]}[figure]
    if "IN" in labels:  # the diverged IN run is named, not drawn, and the exit status says so
        assert status == 1 and "IN: diverged" in capsys.readouterr().err
        in_dir = Path(next(r["dir"] for r in record["runs"] if r["label"] == "IN"))
        assert [r.get("problem") for r in record["runs"]] == [None, f"IN: diverged ({in_dir.name})", None]
    else:
        assert status == 0
    numbers = record["numbers"]
    if figure == "dtn_attention":  # vit_micro_star: 6 blocks x 4 heads per shown run
        assert len(numbers) == 2 * 6 * 4 and (out / f"{figure}.csv").is_file()
    if figure == "dyt_io":  # blocks.{0,2,3,5}.norm1 of each vit_micro, blocks.{0..3}.norm1 of each dit_micro
        assert [n["slot"] for n in numbers] == ([f"blocks.{i}.norm1" for i in (0, 2, 3, 5)] * 2
                                                + [f"blocks.{i}.norm1" for i in range(4)] * 2)
        assert "(dit_micro noised at uniformly drawn diffusion steps" in record["caption"]
        assert (out / f"{figure}_points.csv").is_file()
    if figure == "pointwise_activations":  # a saturated fraction for the point-wise layers only
        assert {n["run"] for n in numbers if n["saturated_fraction"] is None} == {"LN / —"}
        assert (out / f"{figure}.csv").is_file()
    readme = (out.parent / "README.md").read_text()
    assert f"[{figure}](figures/{figure}.png)" in readme and figures.FIGURES_BEGIN in readme
    assert not [p for p in out.iterdir() if p.is_dir()]  # no temporary directory left


def test_the_stability_grid_shows_each_runs_outcome_diverged_ones_included(tmp_path):
    """DyT Fig. 10: one cell per alpha0 x lr per model and normalizer, a diverged run drawn with its step."""
    shipped = yaml.safe_load((Path(figures.FIGURE_DIR) / "dyt_stability.yaml").read_text())
    shipped["blocks"] = [  # the shipped grid, smaller: two sizes, two alpha0, two lrs (planning costs time)
        "experiment=dyt_imagenet backbone=vit_small,vit_base norm=dyt norm.alpha0=0.5,2.0 "
        "trainer.lr_factor=1.0,4.0 +table.lr_factor=${trainer.lr_factor}",
        "experiment=dyt_imagenet backbone=vit_small,vit_base norm=ln trainer.lr_factor=1.0,4.0 "
        "+table.lr_factor=${trainer.lr_factor}"]
    (tmp_path / "dyt_stability.yaml").write_text(yaml.safe_dump(shipped))
    spec = load_figure(str(tmp_path / "dyt_stability.yaml"))
    plan = make_plan(spec, "smoke", None, [], root=tmp_path)
    for i, run in enumerate(plan.runs):  # records only: the figure loads no model
        run_dir = run.dir
        run_dir.mkdir(parents=True)
        (run_dir / "config.yaml").write_text(yaml.safe_dump(run.config))
        factor = run.config["trainer"]["lr_factor"]
        summary = {"status": "completed", "run_id": run.run_id, "metrics": {"final": {"val/top1": 60.0 + i}}}
        if factor == 4.0:
            summary = {"status": "diverged", "run_id": run.run_id, "diverged": {"step": 100 + i}}
        (run_dir / "summary.json").write_text(json.dumps(summary))
    plan = make_plan(spec, "smoke", None, [], root=tmp_path)
    out = tmp_path / "results" / "figures"
    assert render(spec, plan, out) == 0
    cells = json.loads((out / "dyt_stability.json").read_text())["numbers"]
    assert len(cells) == 2 * (2 * 2 + 2)  # two sizes x (DyT: 2 alpha0 x 2 lr; LN: 2 lr)
    models, norms = ("ViT-S", "ViT-B"), ("LN", "DyT")
    assert {c["panel"] for c in cells} == {f"{m} / {n}" for m in models for n in norms}
    diverged = [c for c in cells if c["table.lr_factor"] == 4.0]
    assert diverged and all(c["status"] == "diverged" and c["top1"] is None and c["diverged_step"] >= 100
                            for c in diverged)
    assert all(c["top1"] >= 60 for c in cells if c["table.lr_factor"] != 4.0)
    assert {c["norm.alpha0"] for c in cells if c["panel"].endswith("LN")} == {None}
    assert (out / "dyt_stability.png").stat().st_size > 10_000


def test_unknown_figure_is_one_line_and_exit_2(capsys):
    with pytest.raises(SystemExit) as exit_info:
        figures.main(["run", "dyt_curves", "--dry-run"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: no figure 'dyt_curves'") and "dtn_attention" in err[0]


SPEC = """
title: A tiny figure
source: none
mirrors: nothing
analysis: attention
rows: [norm.name]
blocks:
  - norm=ln,dyt
images: 4
"""
SCALE = """
description: one epoch of the digits demo
seeds: [0]
overrides:
  classification: [trainer.epochs=1, trainer.warmup_epochs=0, trainer.progress=false, logger=none]
"""


@pytest.mark.slow
def test_figure_run_trains_what_is_missing_then_skips_it(tmp_path):
    spec, scale = tmp_path / "tiny_fig.yaml", tmp_path / "cpu1.yaml"
    spec.write_text(SPEC)
    scale.write_text(SCALE)
    env = {**os.environ, "NORMEXP_OUTPUT_DIR": str(tmp_path / "out"), "WANDB_SILENT": "true"}
    args = [sys.executable, "-m", "normexp", "figure", "run", str(spec), "--scale", str(scale), "--out",
            str(tmp_path / "results" / "figures")]
    first = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "hydra/sweeper=table" in first.stdout
    assert (tmp_path / "results" / "figures" / "tiny_fig.png").is_file()
    again = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0 and "2 done (skipped), 0 to run" in again.stdout
