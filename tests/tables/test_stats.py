"""The statistics of the tables: t intervals, paired and Welch deltas, the within-noise mark, probability of
improvement, mean rank, pooled seed std -- against scipy and their definitions -- and every format of a
rendered table carrying the intervals and the mark."""

from __future__ import annotations

import csv
import io
import math
import statistics

import pytest
from scipy import stats as sps
from tables.test_render import SPEC, drawn_bars, fabricated_plan, md_rows

from normexp.tables import stats
from normexp.tables.aggregate import across_strata, aggregate
from normexp.tables.render import across_csv, to_csv, to_latex, to_markdown
from normexp.tables.spec import Scale, load_scale

SAMPLE = [81.2, 80.4, 82.9, 81.7, 80.8]


def test_the_t_interval_is_scipys():
    found = stats.t_interval(SAMPLE)
    low, high = sps.t.interval(0.95, len(SAMPLE) - 1, loc=statistics.fmean(SAMPLE), scale=sps.sem(SAMPLE))
    assert (found.low, found.high) == pytest.approx((low, high), abs=1e-12)
    assert found.estimate == pytest.approx(statistics.fmean(SAMPLE)) and found.n == 5 and found.df == 4
    ci = sps.ttest_1samp(SAMPLE, 0).confidence_interval()
    assert (found.low, found.high) == pytest.approx((ci.low, ci.high), abs=1e-12)


def test_one_run_has_no_interval():
    found = stats.t_interval([81.0])
    assert found.estimate == 81.0 and not found.has_interval and found.half_width is None
    assert stats.within_noise(found) is None and stats.t_interval([]) is None
    assert not stats.delta({0: 81.0}, {0: 80.0}).has_interval  # one pair
    assert not stats.delta({0: 81.0, 1: 83.0}, {2: 80.0}).has_interval  # a side with one run


def test_a_paired_delta_is_the_mean_and_interval_of_the_per_seed_differences():
    x = {0: 81.0, 1: 83.5, 2: 82.0, 3: 82.6}
    y = {0: 80.0, 1: 82.0, 2: 82.5, 3: 81.0}
    found = stats.delta(x, y)
    differences = stats.t_interval([x[s] - y[s] for s in x])
    assert found.kind == "paired" and found.n == 4 and found.df == 3
    assert (found.estimate, found.low, found.high) == pytest.approx(
        (differences.estimate, differences.low, differences.high), abs=1e-12)
    ci = sps.ttest_rel(list(x.values()), list(y.values())).confidence_interval()
    assert (found.low, found.high) == pytest.approx((ci.low, ci.high), abs=1e-12)
    # seeds in another order pair the same
    assert stats.delta(dict(reversed(x.items())), y).estimate == pytest.approx(found.estimate)


def test_rows_with_other_seeds_get_welchs_interval():
    x, y = {0: 81.0, 1: 83.5, 2: 82.0}, {0: 80.0, 1: 82.0, 5: 82.5, 6: 79.0}
    found = stats.delta(x, y)
    result = sps.ttest_ind(list(x.values()), list(y.values()), equal_var=False)
    ci = result.confidence_interval()
    assert found.kind == "Welch" and (found.low, found.high) == pytest.approx((ci.low, ci.high), abs=1e-12)
    assert found.df == pytest.approx(result.df)
    assert found.estimate == pytest.approx(statistics.fmean(x.values()) - statistics.fmean(y.values()))


@pytest.mark.parametrize("low, high, within", [(-1.0, 2.0, True), (0.0, 2.0, True), (-2.0, 0.0, True),
                                               (0.1, 2.0, False), (-2.0, -0.1, False)])
def test_within_noise_exactly_when_the_interval_contains_zero(low, high, within):
    assert stats.within_noise(stats.Interval((low + high) / 2, low, high, 3)) is within


def test_probability_of_improvement_is_its_definition():
    """P(X > Y) = mean over strata of the share of comparisons X wins (a tie: 1/2): runs of one seed where
    the seeds agree, every pair of runs where they differ (Agarwal et al. 2021, Sec. 4.3)."""
    paired = ({0: 1.0, 1: 2.0, 2: 3.0, 3: 4.0}, {0: 0.0, 1: 2.0, 2: 5.0, 3: 3.0})  # wins 1, tie, 0, 1
    unpaired = ({0: 5.0, 1: 6.0}, {0: 4.0, 1: 7.0, 2: 6.0})  # 5: 1, 0, 0; 6: 1, 0, 1/2
    assert stats.probability_of_improvement([paired]).estimate == pytest.approx(2.5 / 4)
    assert stats.probability_of_improvement([unpaired]).estimate == pytest.approx(2.5 / 6)
    both = stats.probability_of_improvement([paired, unpaired])
    assert both.estimate == pytest.approx((2.5 / 4 + 2.5 / 6) / 2) and both.kind == "bootstrap"
    assert both.low <= both.estimate <= both.high and both.low >= 0 and both.high <= 1
    assert both == stats.probability_of_improvement([paired, unpaired])  # the same on every render
    lower = stats.probability_of_improvement([paired, unpaired], higher_is_better=False)
    assert lower.estimate == pytest.approx(1 - both.estimate)  # where lower is better X wins the others
    assert not stats.probability_of_improvement([({0: 1.0}, {0: 0.0})]).has_interval  # one run: none


def test_mean_rank_and_its_stratified_bootstrap():
    strata = [{"ln": [80.0, 81.0], "dyt": [82.0, 83.0], "dtn": [77.0, 78.0]},
              {"ln": [70.0, 70.5], "dyt": [69.0, 69.5], "dtn": [71.0, 71.5]}]
    ranks = stats.mean_ranks(strata)
    assert {m: r.estimate for m, r in ranks.items()} == {"ln": 2.0, "dyt": 2.0, "dtn": 2.0}
    assert ranks["ln"].has_interval and ranks["ln"].low == ranks["ln"].high == 2.0  # no resample overlaps
    assert stats.mean_ranks(strata, higher_is_better=False)["dyt"].estimate == 2.0
    tied = stats.mean_ranks([{"a": [1.0, 2.0], "b": [1.5, 1.5]}])
    assert tied["a"].estimate == 1.5 and tied["a"].low == 1.0 and tied["a"].high == 2.0  # resampled apart


def test_pooled_seed_std():
    rows = [[1.0, 2.0, 3.0], [10.0, 14.0], [5.0]]
    std, df = stats.pooled_std(rows)
    assert df == 3 and std == pytest.approx(math.sqrt((2 * 1.0 + 1 * 8.0) / 3))
    assert stats.pooled_std([[1.0], [2.0]]) is None


# ---------------------------------------------------------------- rendered
RUNS = {  # vit_a: DyT - LN per seed 1, 2, 0 (within noise); vit_b: 5, 5.5, 5 (not)
    **{("vit_a", "ln", s): v for s, v in zip((0, 1, 2), (80.0, 81.0, 82.0), strict=True)},
    **{("vit_a", "dyt", s): v for s, v in zip((0, 1, 2), (81.0, 83.0, 82.0), strict=True)},
    **{("vit_b", "ln", s): v for s, v in zip((0, 1, 2), (70.0, 71.0, 72.0), strict=True)},
    **{("vit_b", "dyt", s): v for s, v in zip((0, 1, 2), (75.0, 76.5, 77.0), strict=True)},
}


def seeded(tmp_path, runs=RUNS):
    return aggregate(fabricated_plan(tmp_path, SPEC, {
        k: {"status": "completed", "metrics": {"final": {"val/top1": v}}} for k, v in runs.items()}))


def test_every_format_carries_the_interval_and_the_mark(tmp_path, monkeypatch):
    result = seeded(tmp_path)
    cells = {row.key: row.cells["top1"] for row in result.rows}
    assert cells["vit_a", "dyt"].within_noise is True and cells["vit_b", "dyt"].within_noise is False
    assert cells["vit_a", "dyt"].delta_interval.kind == "paired"

    md = to_markdown(result)
    rows = md_rows(md)
    assert rows["ViT-A LN"][5] == "81.00 ± 2.48 (3)"
    assert rows["ViT-A DyT"][7] == "+1.00 ± 2.48 ≈"  # differences 1, 2, 0: sd 1, t(2 df) / sqrt 3
    assert rows["ViT-B DyT"][7] == "+5.17 ± 0.72"
    assert md.count("≈") == 1 + md.count("≈:")  # the one cell, and the captions that explain it
    assert "95 % confidence interval" in md and "Student t" in md and "paired by seed" in md
    assert "Seed noise at this scale" in md and "Top-1 1.01 (8 df)" in md  # variances 1, 1, 1, 1.083

    by = {(r["backbone.name"], r["norm.name"], r["metric"]): r for r in csv.DictReader(io.StringIO(
        to_csv(result)))}
    assert float(by["vit_a", "ln", "top1"]["ci95"]) == pytest.approx(2.484138, abs=1e-6)
    assert by["vit_a", "dyt", "top1"]["within_noise"] == "≈"
    assert by["vit_b", "dyt", "top1"]["within_noise"] == ""
    assert by["vit_a", "dyt", "top1"]["delta_test"] == "paired"
    assert float(by["vit_b", "dyt", "top1"]["delta_ci95"]) == pytest.approx(0.717, abs=1e-3)

    tex = to_latex(result)
    assert "+1.00 $\\pm$ 2.48 $\\approx$ & +1.00" in tex and "+5.17 $\\pm$ 0.72 & ---" in tex
    assert "≈" not in tex

    texts = []
    from matplotlib.axes import Axes
    real = Axes.annotate
    monkeypatch.setattr(Axes, "annotate", lambda self, text, *a, **kw: texts.append(text) or real(
        self, text, *a, **kw))
    bars = drawn_bars(result, tmp_path, monkeypatch)
    assert [round(b["yerr"], 2) for b in bars] == [2.48, 2.48, 2.48, 2.59]  # the cells' t intervals
    assert [b["dashed"] for b in bars] == [False, True, False, False]  # ViT-A DyT: within noise
    assert texts.count("≈") == 1 and texts.count("n=3") == 4


def test_one_run_per_cell_says_so_and_has_no_interval(tmp_path):
    result = seeded(tmp_path, {k: v for k, v in RUNS.items() if k[2] == 0})
    md = to_markdown(result)
    rows = md_rows(md)
    assert rows["ViT-A LN"][5] == "80.00 (1 run)" and rows["ViT-A DyT"][7] == "+1.00"
    assert "±" not in rows["ViT-B DyT"][7] and "≈" not in "".join(rows["ViT-B DyT"])
    assert "Seed noise at this scale: not measured" in md
    by = {(r["backbone.name"], r["norm.name"], r["metric"]): r for r in csv.DictReader(io.StringIO(
        to_csv(result)))}
    assert by["vit_a", "dyt", "top1"]["ci95"] == "" and by["vit_a", "dyt", "top1"]["delta_ci95"] == ""
    assert by["vit_a", "dyt", "top1"]["within_noise"] == ""


def test_across_backbones_mean_rank_and_probability_of_improvement(tmp_path):
    result = seeded(tmp_path)
    (across,) = across_strata(result)
    ln, dyt = across.methods
    assert ln.baseline and ln.improvement is None and dyt.compared == 2 and across.strata == 2
    assert dyt.rank.estimate == 1.0 and ln.rank.estimate == 2.0
    # vit_a: DyT beats LN on seeds 0 and 1, ties on 2 -> 5/6; vit_b: every seed -> 1
    assert dyt.improvement.estimate == pytest.approx((2.5 / 3 + 1) / 2) and dyt.improvement.has_interval
    md = to_markdown(result)
    assert "## Across Model" in md and "Agarwal et al. 2021" in md and "stratified bootstrap" in md
    line = next(line for line in md.splitlines() if line.startswith("| DyT | 1.00"))
    assert f"{dyt.improvement.estimate:.2f} [{dyt.improvement.low:.2f}, {dyt.improvement.high:.2f}]" in line
    assert f"| LN | 2.00 [{ln.rank.low:.2f}, {ln.rank.high:.2f}] (2) | baseline |" in md
    assert "tab:normexp-fab-across" in to_latex(result)
    rows = list(csv.DictReader(io.StringIO(across_csv(result, [across]))))
    assert [r["norm.name"] for r in rows] == ["ln", "dyt"] and float(rows[1]["p_improvement"]) == \
        pytest.approx(dyt.improvement.estimate)


def test_smoke_says_it_is_a_wiring_check(tmp_path):
    assert "a wiring check: not evidence" in load_scale("smoke").caption
    plan = fabricated_plan(tmp_path)
    plan.scale = Scale("smoke", "a test scale", (0,), {}, {}, caption="A wiring check: not evidence.")
    assert "\n\nA wiring check: not evidence.\n\n" in to_markdown(aggregate(plan))


def test_a_method_that_diverged_on_a_backbone_ranks_last_there_and_loses(tmp_path):
    """Divergence is a result: DyT diverging on every seed of ViT-B is not left out of the summary (which
    read P(beats LN) = 0.83 from ViT-A alone) but ranks last there and loses each seed's comparison."""
    runs = {k: {"status": "completed", "metrics": {"final": {"val/top1": v}}} for k, v in RUNS.items()}
    runs |= {("vit_b", "dyt", s): {"status": "diverged", "diverged": {"step": 5 + s}, "metrics": {}}
             for s in (0, 1, 2)}
    result = aggregate(fabricated_plan(tmp_path, SPEC, runs))
    (across,) = across_strata(result)
    ln, dyt = across.methods
    assert dyt.compared == 2 and dyt.strata == 2 and dyt.diverged == 3 and ln.diverged == 0
    assert dyt.improvement.estimate == pytest.approx((2.5 / 3 + 0) / 2)
    assert dyt.rank.estimate == pytest.approx(1.5) and ln.rank.estimate == pytest.approx(1.5)
    md = to_markdown(result)
    assert f"| DyT | 1.50 [{dyt.rank.low:.2f}, {dyt.rank.high:.2f}] (2; 3 diverged) |" in md
    assert "A diverged run is a result, the worst: it ranks last in its Model" in md
    rows = list(csv.DictReader(io.StringIO(across_csv(result, [across]))))
    assert [r["diverged_runs"] for r in rows] == ["0", "3"]
    (tmp_path / "all").mkdir()
    assert "diverged run is a result, the worst" not in to_markdown(seeded(tmp_path / "all"))
    # where no run of a backbone has the metric (every one diverged; a ViT's FID), that backbone ranks nothing
    runs |= {("vit_b", "ln", s): {"status": "diverged", "diverged": {"step": 5}, "metrics": {}}
             for s in (0, 1, 2)}
    (tmp_path / "none").mkdir()
    (across,) = across_strata(aggregate(fabricated_plan(tmp_path / "none", SPEC, runs)))
    assert across.strata == 1 and [m.strata for m in across.methods] == [1, 1]
