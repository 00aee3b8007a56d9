"""The pictures of a table and of a stability figure read right by their structure (issue 51): every row
drawn, no bar under the legend, no error bar without an interval, no paper tick for another metric, a colour
bar and a marked run at chance."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.figure  # noqa: E402
import pytest  # noqa: E402
from tables.test_render import SPEC, fabricated_plan  # noqa: E402

from normexp.analysis.render import plot_stability  # noqa: E402
from normexp.tables.aggregate import aggregate  # noqa: E402
from normexp.tables.render import plot_bars  # noqa: E402

# ViT-A and ViT-B at LN are one set of runs (shared rows); DyT's rows one run each (n = 1); the top-1 of ViT-B
# DyT falls back to a second value path, another metric than the paper's
RUNS = {
    ("vit_a", "ln", 0): {"status": "completed", "metrics": {"final": {"ema/val/top1": 70.0}}},
    ("vit_a", "ln", 1): {"status": "completed", "metrics": {"final": {"ema/val/top1": 72.0}}},
    ("vit_a", "dyt", 0): {"status": "completed", "metrics": {"final": {"ema/val/top1": 75.0}}},
    ("vit_b", "dyt", 0): {"status": "completed", "metrics": {"final": {"val/top1": 60.0}}},
}


@pytest.fixture
def captured(monkeypatch):
    """The figure a renderer saves, kept open for its artists to be read."""
    found = {}

    def keep(fig, path, **kw):
        fig.canvas.draw()
        found["fig"], found["renderer"] = fig, fig.canvas.get_renderer()  # before the figure is closed

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", keep)
    return found


def test_a_tables_picture_draws_every_row_and_only_the_intervals_and_ticks_it_has(tmp_path, captured):
    plan = fabricated_plan(tmp_path, SPEC, RUNS)
    for run in [r for r in plan.runs if r.points[0].labels["norm.name"] == "ln"]:  # ViT-B LN on ViT-A's runs
        run.points.append(type(run.points[0])(overrides=[], seed=run.points[0].seed, task="classification",
                                              labels={"backbone.name": "vit_b", "norm.name": "ln"}))
    result = aggregate(plan)
    assert [r.same_as is not None for r in result.rows] == [False, True, False, False]
    plot_bars(result, tmp_path / "bars.png")
    fig = captured["fig"]
    ax = fig.axes[0]
    bars = [p for p in ax.patches if p.get_fill()]
    texts = [t.get_text() for t in ax.texts] + [t.get_text() for t in ax.get_xticklabels()]
    assert len(bars) == 3  # three sets of runs: ViT-A LN (= ViT-B LN), ViT-A DyT, ViT-B DyT
    assert "ViT-A" in texts and "ViT-B" in texts and any(t.startswith(" = ViT-A") for t in texts)
    assert any(t.startswith("= ViT-B") for t in texts)  # the shared bar names the row it also is
    renderer = captured["renderer"]
    legend = ax.get_legend().get_window_extent(renderer)
    assert not any(b.get_window_extent(renderer).overlaps(legend) for b in bars)
    # one error bar: the LN cell of two runs; none on the n = 1 cells
    assert len(ax.containers) - len(bars) == 1
    # paper ticks: ViT-A's two (top-1 read from its first value path), none for ViT-B DyT (the fallback)
    ticks = [line for line in ax.get_lines() if line.get_linewidth() == 2]
    assert sorted(line.get_ydata()[0] for line in ticks) == [80.0, 81.0]


def test_a_stability_heat_map_has_a_colour_bar_marks_chance_and_collapses_panels_of_the_same_runs(
        tmp_path, captured):
    cells = [{"panel": f"{size} / DyT", "lr": lr, "alpha0": 0.5, "status": status, "diverged_step": step,
              "top1": top1, "run_id": f"r{lr}"}
             for size in ("ViT-S", "ViT-B")
             for lr, status, step, top1 in ((1, "completed", None, 50.0), (2, "completed", None, 10.2),
                                            (4, "diverged", 7, None))]
    plot_stability(cells, tmp_path / "s.png", "lr", "alpha0", names={"lr": "lr x recipe"}, chance=10.0)
    fig = captured["fig"]
    panels = [ax for ax in fig.axes if ax.get_title()]
    assert [ax.get_title() for ax in panels] == ["ViT-S = ViT-B / DyT"]  # one panel, both names
    assert len(fig.axes) == 2 and fig.axes[1].get_ylabel() == "top-1 (%)"  # the colour bar
    texts = [t.get_text() for t in panels[0].texts]
    assert texts == ["50.0", "10.2\nchance", "div@7"] and panels[0].get_xlabel() == "lr x recipe"
    chance = panels[0].patches[1]
    assert chance.get_hatch() == "//"
