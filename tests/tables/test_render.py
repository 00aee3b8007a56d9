"""A table rendered from fabricated run records: every cell -- means, stds, n, deltas, paper, markers."""

from __future__ import annotations

import csv
import io
import json
import re
from pathlib import Path

import pytest

from normexp.errors import UserError
from normexp.tables.aggregate import aggregate
from normexp.tables.plan import PlannedRun, Record, TablePlan
from normexp.tables.render import to_csv, to_latex, to_markdown, write_table
from normexp.tables.spec import Point, Scale, load_table

SPEC = """
title: A fabricated table
source: Somebody et al., Table 9
rows: [backbone.name, norm.name]
metrics:
  - {key: params, label: Params (M), value: params, scale: 1.0e-6, fmt: .1f}
  - {key: top1, label: Top-1, value: [metrics.final.ema/val/top1, metrics.final.val/top1], fmt: .2f,
     delta: true}
baseline:
  - set: {norm.name: ln}
blocks: ["backbone=vit_a,vit_b norm=ln,dyt"]
headers: {backbone.name: Model, norm.name: Norm}
labels:
  backbone.name: {vit_a: ViT-A, vit_b: ViT-B}
  norm.name: {ln: LN, dyt: DyT}
paper:
  - {backbone.name: vit_a, norm.name: ln, top1: 80.0}
  - {backbone.name: vit_a, norm.name: dyt, top1: 81.0}
  - {backbone.name: vit_b, norm.name: ln, top1: 70.0}
  - {backbone.name: vit_b, norm.name: dyt, top1: "61.0 → failed"}
"""

# (backbone, norm, seed) -> summary (None: no record)
RUNS = {
    ("vit_a", "ln", 0): {"status": "completed", "metrics": {"final": {"val/top1": 80.0}}},
    ("vit_a", "ln", 1): {"status": "completed", "metrics": {"final": {"val/top1": 81.0}}},
    ("vit_a", "ln", 2): {"status": "completed", "metrics": {"final": {"val/top1": 82.0}}},
    # the EMA's top-1 is preferred where the run has one
    ("vit_a", "dyt", 0): {"status": "completed",
                          "metrics": {"final": {"val/top1": 1.0, "ema/val/top1": 83.0}}},
    ("vit_a", "dyt", 1): {"status": "completed", "metrics": {"final": {"val/top1": 85.0}}},
    ("vit_a", "dyt", 2): {"status": "diverged", "diverged": {"step": 123, "epoch": 2},
                          "metrics": {"final": {"val/top1": 40.0}}},
    ("vit_b", "ln", 0): {"status": "completed", "metrics": {"final": {"val/top1": 70.5}}},
    ("vit_b", "ln", 1): {"status": "failed", "error": "RuntimeError: boom", "metrics": {}},
    ("vit_b", "ln", 2): None,
    ("vit_b", "dyt", 0): {"status": "diverged", "diverged": {"step": 5}, "metrics": {}},
    ("vit_b", "dyt", 1): {"status": "diverged", "diverged": {"step": 7}, "metrics": {}},
    ("vit_b", "dyt", 2): {"status": "diverged", "diverged": {"step": 9}, "metrics": {}},
}
PARAMS = {"vit_a": 5_712_345, "vit_b": 22_050_000}


def fabricated_plan(tmp_path: Path, spec_text: str = SPEC, runs_by_point: dict | None = None) -> TablePlan:
    spec_file = tmp_path / "fab.yaml"
    spec_file.write_text(spec_text)
    spec = load_table(str(spec_file))
    runs = []
    for i, ((backbone, norm, seed, *choice), summary) in enumerate((runs_by_point or RUNS).items()):
        record, run_dir = None, tmp_path / "runs" / f"r{i}"
        if summary is not None:
            run_dir.mkdir(parents=True)
            summary = {**summary, "params": PARAMS[backbone], "run_id": f"id{i}",
                       "git": {"commit": "abc123def456", "dirty": False},
                       "hardware": {"device": "cpu", "cpu_count": 2}, "finished_at": "2026-11-30T12:00:00"}
            (run_dir / "summary.json").write_text(json.dumps(summary))
            (run_dir / "metrics.jsonl").write_text(
                json.dumps({"step": 10, "epoch": 1, "train/loss": 2.0}) + "\n"
                + json.dumps({"step": 20, "epoch": 1, "train/loss": 1.5, "val/top1": 50.0}) + "\n")
            record = Record(run_dir, summary)
        point = Point(overrides=[], seed=seed, labels={"backbone.name": backbone, "norm.name": norm},
                      task="classification", backbone=backbone, choice=choice[0] if choice else None)
        runs.append(PlannedRun(f"id{i}", [], {"backbone": {"name": f"{backbone}_micro"}}, run_dir, [point],
                               record))
    scale = Scale("smoke", "a test scale", (0, 1, 2), {}, {})
    return TablePlan(spec, scale, (0, 1, 2), runs)


def md_rows(text: str) -> dict[str, list[str]]:
    lines = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| ---")]
    return {" ".join(cells[:2]): cells for cells in
            ([c.strip() for c in line.strip("|").split(" | ")] for line in lines[1:])}


def test_every_cell_of_the_long_table(tmp_path):
    md = to_markdown(aggregate(fabricated_plan(tmp_path)))
    header_line = next(line for line in md.splitlines() if line.startswith("| Model"))
    header = [c.strip() for c in header_line.strip("|").split(" | ")]
    assert header == ["Model", "Norm", "run as", "Params (M)", "paper", "Top-1", "paper", "Δ Top-1",
                      "Δ paper"]
    rows = md_rows(md)
    assert rows["ViT-A LN"][2:] == ["vit_a_micro", "5.7 ± 0.0 (3)", "n/a", "81.00 ± 2.48 (3)", "80.00", "—",
                                    "—"]
    assert rows["ViT-A DyT"][2:] == ["vit_a_micro", "5.7 ± 0.0 (2); diverged@123", "n/a",
                                     "84.00 ± 12.71 (2); diverged@123", "81.00", "+3.00 ± 5.98 ≈ (Welch)",
                                     "+1.00"]
    assert rows["ViT-B LN"][2:] == ["vit_b_micro", "22.1 (1 run); failed: RuntimeError: boom; missing",
                                    "n/a", "70.50 (1 run); failed: RuntimeError: boom; missing", "70.00", "—",
                                    "—"]
    assert rows["ViT-B DyT"][5:] == ["diverged@5; diverged@7; diverged@9", "61.0 → failed", "—", "—"]
    assert "Somebody et al., Table 9" in md and "scale `smoke`" in md and "abc123def4" in md
    assert "cpu, 2 CPU cores" in md


def test_the_caption_says_whose_weights_each_row_reads(tmp_path):
    """Tables read metrics.reported: each run's final metrics of the weights its recipe's paper reports."""
    spec = SPEC.replace("[metrics.final.ema/val/top1, metrics.final.val/top1]", "metrics.reported.top1")

    def reported(weights, top1):
        return {"status": "completed", "metrics": {"reported": {"weights": weights, "top1": top1}}}

    runs = {("vit_a", "ln", 0): reported("ema", 80.0), ("vit_a", "dyt", 0): reported("ema", 81.0),
            ("vit_b", "ln", 0): reported("raw", 70.0), ("vit_b", "dyt", 0): reported("raw", 71.0)}
    md = to_markdown(aggregate(fabricated_plan(tmp_path, spec, runs)))
    assert "Our metrics are the EMA model's for ViT-A LN, ViT-A DyT; the trained model's for ViT-B LN, " \
        "ViT-B DyT." in md
    assert md_rows(md)["ViT-A DyT"][5] == "81.00 (1 run)"
    same = {k: reported("raw", v["metrics"]["reported"]["top1"]) for k, v in runs.items()}
    (tmp_path / "raw").mkdir()
    (tmp_path / "old").mkdir()
    assert "Our metrics are the trained model's in every row." in \
        to_markdown(aggregate(fabricated_plan(tmp_path / "raw", spec, same)))
    assert "Our metrics are" not in to_markdown(aggregate(fabricated_plan(tmp_path / "old")))


def test_csv_holds_the_unformatted_numbers(tmp_path):
    rows = list(csv.DictReader(io.StringIO(to_csv(aggregate(fabricated_plan(tmp_path))))))
    by = {(r["backbone.name"], r["norm.name"], r["metric"]): r for r in rows}
    a_dyt = by["vit_a", "dyt", "top1"]
    assert float(a_dyt["mean"]) == 84.0 and float(a_dyt["std"]) == pytest.approx(2 ** 0.5, abs=1e-6)
    assert a_dyt["n"] == "2" and a_dyt["markers"] == "diverged@123"
    assert float(a_dyt["delta"]) == 3.0 and float(a_dyt["paper_delta"]) == 1.0 and a_dyt["paper"] == "81.0"
    assert by["vit_b", "dyt", "top1"]["mean"] == "" and by["vit_b", "dyt", "top1"]["n"] == "0"
    assert float(by["vit_a", "ln", "params"]["mean"]) == pytest.approx(5.712345)


def test_a_best_of_table_shows_each_rows_best_completed_lr_and_every_lr_tried(tmp_path):
    """DyT Table 9's cells: the best of a per-method lr search, a diverged lr reported and never chosen."""
    spec = SPEC.replace("blocks:", "best_of: {key: trainer.lr_factor, metric: top1}\nblocks:").replace(
        "headers: {", "headers: {trainer.lr_factor: lr x, ")

    def top1(value):
        return {"status": "completed", "metrics": {"final": {"val/top1": value}}}

    diverged = {"status": "diverged", "diverged": {"step": 40}, "metrics": {"final": {"val/top1": 99.0}}}
    runs = {("vit_a", "ln", 0, 0.5): top1(70.0), ("vit_a", "ln", 1, 0.5): top1(72.0),
            ("vit_a", "ln", 0, 1.0): top1(75.0), ("vit_a", "ln", 1, 1.0): top1(73.0),
            ("vit_a", "dyt", 0, 0.5): top1(76.0), ("vit_a", "dyt", 0, 1.0): diverged,
            ("vit_b", "ln", 0, 1.0): diverged,
            ("vit_b", "dyt", 0, 1.0): {"status": "completed", "metrics": {}}}
    result = aggregate(fabricated_plan(tmp_path, spec, runs))
    md = to_markdown(result)
    header = next(line for line in md.splitlines() if line.startswith("| Model"))
    assert header.startswith("| Model | Norm | run as | lr x | lr x swept: Top-1 | Params (M) |")
    rows = md_rows(md)
    assert rows["ViT-A LN"][3:5] == ["1.0", "0.5: 71.00 ± 12.71 (2); 1.0: 74.00 ± 12.71 (2)"]
    assert rows["ViT-A LN"][7] == "74.00 ± 12.71 (2)"  # the better lr's two seeds, not all four runs
    assert rows["ViT-A DyT"][3:5] == ["0.5", "0.5: 76.00 (1 run); 1.0: diverged@40"]
    assert rows["ViT-A DyT"][7] == "76.00 (1 run)" and rows["ViT-A DyT"][9] == "+2.00"  # against LN's best
    assert rows["ViT-B LN"][3:5] == ["—", "1.0: diverged@40"] and rows["ViT-B LN"][7] == "diverged@40"
    assert rows["ViT-B DyT"][3:5] == ["1.0", "1.0: —"]  # its one lr, though it has no Top-1 to rank by
    # with two seeds, a value one of whose seeds diverged is not chosen over one whose seeds all completed
    runs.update({("vit_a", "dyt", 1, 0.5): diverged, ("vit_a", "dyt", 0, 2.0): top1(70.0),
                 ("vit_a", "dyt", 1, 2.0): top1(71.0)})
    (tmp_path / "two").mkdir()
    two = md_rows(to_markdown(aggregate(fabricated_plan(tmp_path / "two", spec, runs))))
    assert two["ViT-A DyT"][3] == "2.0" and two["ViT-A DyT"][7] == "70.50 ± 6.35 (2)"
    assert "the best of its runs' `trainer.lr_factor` values by Top-1" in md
    by = {(r["backbone.name"], r["norm.name"], r["metric"]): r
          for r in csv.DictReader(io.StringIO(to_csv(result)))}
    assert by["vit_a", "dyt", "top1"]["trainer.lr_factor"] == "0.5"


@pytest.mark.parametrize("best_of, says", [
    ("{key: trainer.lr_factor, metric: top5}", "best_of needs 'key'"),
    ("{key: norm.name, metric: top1}", "best_of.key is not a row key"),
    ("{key: trainer.lr_factor, metric: top1, pick: first}", "best_of: unknown key(s) ['pick']")])
def test_a_best_of_that_cannot_work_is_one_line(tmp_path, best_of, says):
    spec_file = tmp_path / "bad.yaml"
    spec_file.write_text(SPEC.replace("blocks:", f"best_of: {best_of}\nblocks:"))
    with pytest.raises(UserError, match=re.escape(says)):
        load_table(str(spec_file))


def test_pivot_layout_and_latex(tmp_path):
    spec = SPEC.replace("rows: [backbone.name, norm.name]", "rows: [backbone.name]\ncolumns: norm.name")
    spec = spec.replace("  - {key: params, label: Params (M), value: params, scale: 1.0e-6, fmt: .1f}\n", "")
    result = aggregate(fabricated_plan(tmp_path, spec))
    lines = [line for line in to_markdown(result).splitlines() if line.startswith("| ")]
    assert lines[0].split(" | ")[2:] == ["LN", "DyT |"]
    body = [[c.strip() for c in line.strip("|").split(" | ")] for line in lines[1:]]
    assert body[0] == ["ViT-A", "ours", "81.00 ± 2.48 (3)", "84.00 ± 12.71 (2); diverged@123"]
    assert body[1] == ["", "paper", "80.00", "81.00"]
    assert body[2] == ["", "Δ ours", "—", "+3.00 ± 5.98 ≈ (Welch)"]
    assert body[3] == ["", "Δ paper", "—", "+1.00"]
    assert body[4] == ["", "run as", "vit_a_micro", "vit_a_micro"]
    assert body[5][:3] == ["ViT-B", "ours", "70.50 (1 run); failed: RuntimeError: boom; missing"]
    tex = to_latex(result)
    assert "\\toprule" in tex and "\\bottomrule" in tex and "84.00 $\\pm$ 12.71 (2); diverged@123" in tex
    assert "Δ" not in tex and "$\\Delta$ ours" in tex


def test_written_files_and_results_index(tmp_path):
    out = tmp_path / "results" / "tables"
    plan = fabricated_plan(tmp_path)
    paths = write_table(aggregate(plan), out)
    assert sorted(p.name for p in paths) == ["fab.csv", "fab.md", "fab.png", "fab.tex", "fab_across.csv",
                                                 "fab_curves.png"]
    assert all(p.stat().st_size > 0 for p in paths)
    index = (tmp_path / "results" / "README.md").read_text()
    assert "[fab](tables/fab.md)" in index and "| smoke |" in index and "6 / 4 / 1 of 12" in index
    # a table of evaluations (no run logged a training loss): no curves, the old picture removed
    for log in tmp_path.rglob("metrics.jsonl"):
        log.write_text('{"epoch": 1, "test_set": "imagenet_a", "top1": 50.0}\n')
    assert "fab_curves.png" not in [p.name for p in write_table(aggregate(plan), out)]
    assert not (out / "fab_curves.png").exists()


def test_a_scale_other_than_smoke_has_a_folder_and_an_index_section_of_its_own(tmp_path):
    import dataclasses

    out = tmp_path / "results" / "tables"
    plan = fabricated_plan(tmp_path)
    write_table(aggregate(plan), out)
    plan.scale = dataclasses.replace(plan.scale, name="laptop")
    paths = write_table(aggregate(plan), out)
    assert {p.parent for p in paths} == {out / "laptop"} and (out / "fab.md").is_file()
    index = (tmp_path / "results" / "README.md").read_text()
    assert "## Paper tables at scale laptop" in index and "[fab](tables/laptop/fab.md)" in index
    assert "[fab](tables/fab.md)" in index  # the smoke section stays


def drawn_bars(result, tmp_path, monkeypatch) -> list[dict]:
    """Every bar ``plot_bars`` draws: its x, colour, hatch, legend label, error bar (None: none) and whether a
    dashed outline marks it within noise."""
    from matplotlib.axes import Axes

    from normexp.tables.render import plot_bars

    bars, real_bar, real_errorbar = [], Axes.bar, Axes.errorbar

    def bar(self, x, height, width, **kw):
        if kw.get("fill", True):
            bars.append({"x": x, "color": kw.get("color"), "hatch": kw.get("hatch"), "label": kw.get("label"),
                         "yerr": None, "dashed": False})
        else:  # the outline of the bar just drawn
            bars[-1]["dashed"] = kw.get("linestyle") == "--"
        return real_bar(self, x, height, width, **kw)

    def errorbar(self, x, y, yerr=None, **kw):
        next(b for b in bars if b["x"] == x)["yerr"] = yerr
        return real_errorbar(self, x, y, yerr=yerr, **kw)

    monkeypatch.setattr(Axes, "bar", bar)
    monkeypatch.setattr(Axes, "errorbar", errorbar)
    plot_bars(result, tmp_path / "bars.png")
    return bars


def test_one_colour_per_normalizer_and_every_bar_in_the_legend(tmp_path, monkeypatch):
    """LeViT's row is BN where the others are LN (grand): BN has its colour and its legend entry, LN keeps
    its colour in every plot, and no group leaves an empty slot."""
    from normexp.plotting import norm_color

    plan = fabricated_plan(tmp_path)
    for run in plan.runs:  # ViT-B plays LeViT, whose baseline is BN
        point = run.points[0]
        if point.labels["backbone.name"] == "vit_b" and point.labels["norm.name"] == "ln":
            point.labels["norm.name"] = "bn"
    bars = drawn_bars(aggregate(plan), tmp_path, monkeypatch)
    assert [b["color"] for b in bars] == [norm_color(n) for n in ("ln", "dyt", "bn", "dyt")]
    assert [b["label"] for b in bars if b["label"]] == ["LN", "DyT", "bn"]  # every normalizer, once
    assert [round(b["x"], 3) for b in bars] == [-0.2, 0.2, 0.8, 1.2]  # each group's bars centred on it
    assert norm_color("ln") != norm_color("bn") and norm_color("dtn") == "#ff7f0e"  # the same everywhere


def test_rows_that_are_the_same_runs_are_said_once(tmp_path, monkeypatch):
    """Two paper models that a scale maps onto one member (DTN's ViT-S and ViT-S* at smoke) are one set of
    runs: the caption says so, the 'run as' cell and the CSV name the row they repeat, the plot draws them
    once under both names."""
    plan = fabricated_plan(tmp_path)
    first = {(r.points[0].labels["norm.name"], r.points[0].seed): r for r in plan.runs
             if r.points[0].labels["backbone.name"] == "vit_a"}
    for run in [r for r in plan.runs if r.points[0].labels["backbone.name"] == "vit_b"]:
        point = run.points[0]
        first[point.labels["norm.name"], point.seed].points.append(point)  # vit_b's points on vit_a's runs
    plan.runs = list(first.values())
    result = aggregate(plan)
    md = to_markdown(result)
    assert md.count("are the same runs") == 1 and "the rows of ViT-B repeat ViT-A's values" in md
    assert md_rows(md)["ViT-B DyT"][2] == "vit_a_micro (= ViT-A / DyT)"
    rows = csv.DictReader(io.StringIO(to_csv(result)))
    by = {(r["backbone.name"], r["norm.name"], r["metric"]): r["same_runs_as"] for r in rows}
    assert by["vit_b", "dyt", "top1"] == "ViT-A / DyT" and by["vit_a", "dyt", "top1"] == ""
    assert len(drawn_bars(result, tmp_path, monkeypatch)) == 2  # ViT-A = ViT-B: LN and DyT, once


def test_curves_panels_draw_the_rows_each_selects_as_a_papers_loss_figure(tmp_path, monkeypatch):
    import matplotlib.figure

    spec = SPEC.replace("paper:", "curves:\n  mirrors: Somebody Fig. 6\n  panels:\n"
                        "    - {title: (a) ViT-A, where: {backbone.name: vit_a}}\n"
                        "    - {title: (b) DyT, where: {norm.name: [dyt], backbone.name: [vit_a, vit_b]}}\n"
                        "paper:")
    drawn = {}

    def labelled_lines(fig, path, **kw):
        for ax in fig.axes:
            labels = (line.get_label() for line in ax.get_lines())
            drawn[ax.get_title()] = sorted(label for label in labels if not label.startswith("_"))
        drawn["suptitle"] = fig._suptitle.get_text()

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", labelled_lines)
    from normexp.tables.render import plot_curves

    plot_curves(aggregate(fabricated_plan(tmp_path, spec)), tmp_path / "c.png")
    # one training-loss panel per entry with only its rows, and no validation panel
    assert drawn["(a) ViT-A"] == ["ViT-A / DyT", "ViT-A / LN"]
    assert drawn["(b) DyT"] == ["ViT-A / DyT", "ViT-B / DyT"]
    assert len(drawn) == 3 and "Somebody Fig. 6" in drawn["suptitle"]
    bad = tmp_path / "bad.yaml"
    bad.write_text(spec.replace("where: {backbone.name: vit_a}", "where: {img: 3}"))
    with pytest.raises(UserError, match="curves panel needs 'where'"):
        load_table(str(bad))
