"""Run records -> table cells: mean and 95 % interval over seeds, a marker per run that is not a result
(``diverged@<step>``, ``failed: ...``, ``running``, ``missing``), deltas against the baseline row with their
intervals (:mod:`normexp.tables.stats`), cross-backbone aggregates, and a ``best_of`` row's chosen value.
Rows that are the very same runs point to the first of them (``Row.same_as``)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..metrics.robustness import (
    CORRUPTIONS,
    Normaliser,
    benchmark_mean,
    corruption_errors,
    relative_corruption_errors,
)
from . import stats
from .plan import SOURCE_DIVERGED, PlannedRun, TablePlan
from .spec import Metric, Point, TableSpec, get_path


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


# ---------------------------------------------------------------- metrics computed across two runs
def _robustness(summary: dict[str, Any]) -> tuple[dict[str, float], float | None] | None:
    """A record's mean error per benchmark corruption and its clean error (%), if it has all of them."""
    results = get_path(summary, "metrics.robustness") or {}
    errors = {c: _number(results.get(f"err/{c}")) for c in CORRUPTIONS}
    if any(v is None for v in errors.values()):
        return None
    return errors, _number(results.get("clean_err"))  # type: ignore[return-value]


def _defined(value: float) -> float | None:
    return None if math.isnan(value) else value


def mce_vs_baseline(summary: dict[str, Any], baseline: dict[str, Any]) -> float | None:
    """mCE (%) with the baseline run's errors as the normaliser (Hendrycks & Dietterich 2019, Sec. 4)."""
    own, ref = _robustness(summary), _robustness(baseline)
    if own is None or ref is None:
        return None
    normaliser = Normaliser("baseline row", ref[0], ref[1])
    return _defined(100 * benchmark_mean(corruption_errors(own[0], normaliser)))


def relative_mce_vs_baseline(summary: dict[str, Any], baseline: dict[str, Any]) -> float | None:
    """Relative mCE (%): each corruption's error above the clean error, over the baseline's."""
    own, ref = _robustness(summary), _robustness(baseline)
    if own is None or ref is None or own[1] is None or ref[1] is None:
        return None
    normaliser = Normaliser("baseline row", ref[0], ref[1])
    return _defined(100 * benchmark_mean(relative_corruption_errors(own[0], own[1], normaliser)))


DERIVED: dict[str, Callable[[dict[str, Any], dict[str, Any]], float | None]] = {
    "mce_vs_baseline": mce_vs_baseline,
    "relative_mce_vs_baseline": relative_mce_vs_baseline,
}
DERIVED_NOTES = {
    "mce_vs_baseline": "mCE normalised by the baseline row's errors (same seed)",
    "relative_mce_vs_baseline": "relative mCE normalised by the baseline row's errors (same seed)",
}


# ---------------------------------------------------------------- cells
@dataclass
class Cell:
    values: list[float] = field(default_factory=list)
    markers: list[str] = field(default_factory=list)
    paper: Any = None
    delta: float | None = None
    paper_delta: float | None = None
    derived: bool = False  # a value was computed across runs (``Metric.derive``), not read from a record
    seeds: list[int] = field(default_factory=list)  # the seed of each value
    delta_interval: stats.Interval | None = None  # ``delta`` and its interval (paired or Welch)
    diverged: list[int] = field(default_factory=list)  # seeds whose run (or its pre-training) diverged
    paths: set[str] = field(default_factory=set)  # the metric's value paths that supplied ``values``

    @property
    def by_seed(self) -> dict[Any, float]:
        return stats.by_seed(self.seeds, self.values)

    @property
    def interval(self) -> stats.Interval | None:
        return stats.t_interval(self.values)

    def outcomes(self, higher_is_better: bool) -> dict[Any, float]:
        """``by_seed`` with each diverged seed as the worst value there is: divergence is a result, the worst
        one, so a diverged run ranks last and loses to any run that did not (ties one that did)."""
        worst = -math.inf if higher_is_better else math.inf
        return {**self.by_seed, **dict.fromkeys(self.diverged, worst)}

    @property
    def within_noise(self) -> bool | None:
        return stats.within_noise(self.delta_interval)

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def mean(self) -> float | None:
        return stats.mean(self.values) if self.values else None

    @property
    def std(self) -> float | None:
        return stats.std(self.values) if len(self.values) > 1 else None


@dataclass
class Row:
    labels: dict[str, Any]
    points: list[tuple[Point, PlannedRun]]
    cells: dict[str, Cell] = field(default_factory=dict)
    same_as: Row | None = field(default=None, repr=False)  # an earlier row served by exactly these runs
    sweep: dict[Any, Cell] = field(default_factory=dict)  # best_of: each value's cell of the chosen metric
    choice: Any = None  # best_of: the value the cells show (None: no value has a result)

    @property
    def shown(self) -> list[tuple[Point, PlannedRun]]:
        """The runs the row's cells are made of: its chosen value's in a best_of table, else all."""
        if not self.sweep or self.choice is None:
            return self.points
        return [(p, r) for p, r in self.points if p.choice == self.choice]

    @property
    def key(self) -> tuple[str, ...]:
        return tuple(str(v) for v in self.labels.values())

    @property
    def run_ids(self) -> tuple[str, ...]:
        return tuple(run.run_id for _, run in sorted(self.points, key=lambda pr: pr[0].seed))

    @property
    def norm(self) -> str | None:
        name = self.labels.get("norm.name")
        return str(name) if name is not None else get_path(self.points[0][1].config, "norm.name")

    @property
    def run_as(self) -> list[str]:
        """What actually ran for this row (the backbone of its runs' configs), e.g. a ``*_micro`` member."""
        return sorted({str(get_path(run.config, "backbone.name")) for _, run in self.points})


@dataclass
class TableResult:
    spec: TableSpec
    plan: TablePlan
    rows: list[Row]

    @property
    def seed_std(self) -> dict[str, tuple[float, int] | None]:
        """Per metric: the seed-to-seed std pooled over the rows (each set of runs once) and its df."""
        rows = [r for r in self.rows if r.same_as is None]
        return {m.key: stats.pooled_std([r.cells[m.key].values for r in rows]) for m in self.spec.metrics}

    @property
    def derived_used(self) -> list[str]:
        return sorted({m.derive for m in self.spec.metrics for r in self.rows
                       if m.derive and r.cells[m.key].derived})


def marker(run: PlannedRun) -> str | None:
    """What a run that is not a completed result shows instead of a value."""
    if run.source_diverged and run.record is None:
        return f"pre-training {run.source_diverged}"
    if run.record is None:
        return "missing"
    summary = run.record.summary
    if run.status == "completed":
        return None
    if run.status == "diverged":  # at its step; a record that does not know it (old non-finite metrics): why
        step = get_path(summary, "diverged.step")
        return f"diverged@{step}" if step is not None else f"diverged: {summary.get('error', '')}".strip()
    if run.status == "failed":
        return f"failed: {summary.get('error', '')}".strip()
    return run.status


def metric_value(metric: Metric, summary: dict[str, Any]) -> float | None:
    found = metric_source(metric, summary)
    return None if found is None else found[0]


def metric_source(metric: Metric, summary: dict[str, Any]) -> tuple[float, str] | None:
    """The metric's value in ``summary`` and the path that held it (the first of ``metric.value`` present)."""
    for path in metric.value:
        value = _number(get_path(summary, path))
        if value is not None:
            return value * metric.scale, path
    return None


def aggregate(plan: TablePlan) -> TableResult:
    spec = plan.spec
    rows: dict[tuple[str, ...], Row] = {}
    for point, run in plan.points:
        rows.setdefault(point.row_key, Row(dict(point.labels), [])).points.append((point, run))
    by_labels = {row.key: row for row in rows.values()}
    if spec.best_of:
        for row in rows.values():
            choose(spec, row)
    for row in rows.values():
        base_labels = spec.baseline_of(row.labels)
        base = by_labels.get(tuple(str(v) for v in base_labels.values())) if base_labels else None
        for metric in spec.metrics:
            row.cells[metric.key] = _cell(spec, metric, row, base)
    result = TableResult(spec, plan, list(rows.values()))
    first_with: dict[tuple[str, ...], Row] = {}
    for row in result.rows:  # paper rows a scale maps onto one config share their runs: say so, once
        original = first_with.setdefault(row.run_ids, row)
        row.same_as = original if original is not row else None
    for row in result.rows:  # deltas once every row's cells exist
        base_labels = spec.baseline_of(row.labels)
        base = by_labels.get(tuple(str(v) for v in base_labels.values())) if base_labels else None
        for metric in spec.metrics:
            cell = row.cells[metric.key]
            if not metric.delta or base is None or base is row:
                continue
            base_cell = base.cells[metric.key]
            if cell.values and base_cell.values:
                cell.delta_interval = stats.delta(cell.by_seed, base_cell.by_seed)
                cell.delta = cell.delta_interval.estimate if cell.delta_interval else None
            own, ref = _number(cell.paper), _number(base_cell.paper)
            if own is not None and ref is not None:
                cell.paper_delta = own - ref
    return result


def choose(spec: TableSpec, row: Row) -> None:
    """``row.sweep`` and ``row.choice``: the best value whose seeds all completed (first of equals); a row
    that tried one value and completed shows it without the metric ranked by (a ViT row where DiT's lr is
    picked by FID)."""
    best = spec.best_of
    metric = next(m for m in spec.metrics if m.key == best.metric)
    for value in dict.fromkeys(p.choice for p, _ in row.points):
        runs = Row(row.labels, [(p, r) for p, r in row.points if p.choice == value])
        row.sweep[value] = _cell(spec, metric, runs, None)
    # a value is a candidate when every seed of it completed (one diverged seed makes it a diverged value);
    # where none is, the values with any completed seed
    whole = [(v, c.mean) for v, c in row.sweep.items() if c.mean is not None and not c.markers]
    scored = whole or [(v, c.mean) for v, c in row.sweep.items() if c.mean is not None]
    for value, mean in scored:
        if row.choice is None or best.better(mean, row.sweep[row.choice].mean):
            row.choice = value
    (only, cell), *others = row.sweep.items()
    if row.choice is None and not others and set(cell.markers) <= {"n/a"}:
        row.choice = only


def _cell(spec: TableSpec, metric: Metric, row: Row, base: Row | None) -> Cell:
    cell = Cell(paper=spec.paper_value(row.labels, metric.key))
    base_runs = {p.seed: r for p, r in base.shown} if base is not None else {}
    for point, run in sorted(row.shown, key=lambda pr: pr[0].seed):
        mark = marker(run)
        if mark is not None:
            cell.markers.append(mark)
            if run.status in ("diverged", SOURCE_DIVERGED):
                cell.diverged.append(point.seed)
            continue
        summary = run.record.summary  # type: ignore[union-attr]
        found = metric_source(metric, summary)
        value, path = found if found is not None else (None, None)
        if value is None and metric.derive:
            base_run = base_runs.get(point.seed)
            if base_run is not None and base_run.status == "completed":
                value = DERIVED[metric.derive](summary, base_run.record.summary)  # type: ignore[union-attr]
                cell.derived = value is not None
        if value is None or not math.isfinite(value):
            cell.markers.append("n/a")
        else:
            cell.values.append(value)
            cell.seeds.append(point.seed)
            cell.paths.add(path or str(metric.derive))
    return cell


# ---------------------------------------------------------------- across backbones
STRATUM_KEY = "backbone.name"


@dataclass
class Method:
    """One method (the labels a baseline rule sets, e.g. ``norm.name``) across the strata (backbones)."""

    labels: dict[str, Any]
    strata: int                              # how many strata it is ranked in
    rank: stats.Interval | None = None       # mean rank (1: best) and its stratified bootstrap interval
    improvement: stats.Interval | None = None  # probability of improvement over the stratum's baseline
    baseline: bool = False                   # it is the baseline of the strata it is in
    compared: int = 0                        # strata where it is compared with a baseline
    diverged: int = 0                        # its diverged runs in the strata it is ranked in (ranked last)


@dataclass
class Across:
    """A delta metric's mean ranks and probabilities of improvement over a table's strata."""

    metric: Metric
    stratum_keys: tuple[str, ...]
    strata: int
    methods: list[Method]


def across_strata(result: TableResult) -> list[Across]:
    """Per delta metric, each method's mean rank and probability of improvement over its stratum's baseline,
    for tables spanning two or more backbones (``[]`` otherwise)."""
    spec = result.spec
    strata: dict[tuple[tuple[str, str], ...], dict[tuple[tuple[str, str], ...], Row]] = {}
    method_labels: dict[tuple[tuple[str, str], ...], dict[str, Any]] = {}
    baselines: set[tuple[tuple[str, str], ...]] = set()
    base_of: dict[tuple[tuple[str, str], ...], tuple[tuple[str, str], ...]] = {}
    for row in result.rows:
        base_labels = spec.baseline_of(row.labels)
        if row.same_as is not None or base_labels is None:
            continue
        keys = [k for k in row.labels if k in spec.baseline_keys(row.labels)]
        method = tuple((k, str(row.labels[k])) for k in keys)
        stratum = tuple((k, str(v)) for k, v in row.labels.items() if k not in keys)
        strata.setdefault(stratum, {})[method] = row
        method_labels.setdefault(method, {k: row.labels[k] for k in keys})
        base = tuple((k, str(base_labels[k])) for k in keys)
        base_of.setdefault(stratum, base)
        if base == method:
            baselines.add(method)
    backbones = {dict(s).get(STRATUM_KEY) for s, methods in strata.items() if len(methods) > 1}
    if len(backbones - {None}) < 2:
        return []
    stratum_keys = tuple(k for k in spec.label_keys if any(k in dict(s) for s in strata))
    out = []
    for metric in (m for m in spec.metrics if m.delta):
        # a stratum where no run has the metric (a ViT's FID) ranks nothing, not only its diverged runs
        outcomes = [{m: r.cells[metric.key].outcomes(metric.higher_is_better) for m, r in methods.items()}
                    if any(r.cells[metric.key].values for r in methods.values()) else {}
                    for methods in strata.values()]
        ranked = [{m: list(o.values()) for m, o in s.items() if o} for s in outcomes]
        ranks = stats.mean_ranks([s for s in ranked if len(s) > 1], metric.higher_is_better)
        methods_out = []
        for method, labels in method_labels.items():
            pairs = []
            for stratum, methods, found in zip(strata, strata.values(), outcomes, strict=True):
                base = methods.get(base_of.get(stratum, ()))
                if method in methods and base is not None and base is not methods[method]:
                    own, ref = found.get(method), found.get(base_of[stratum])
                    if own and ref:
                        pairs.append((own, ref))
            rank = ranks.get(method)
            diverged = sum(len(strata[stratum][method].cells[metric.key].diverged)
                           for stratum, s in zip(strata, ranked, strict=True) if method in s and len(s) > 1)
            methods_out.append(Method(
                labels, sum(method in s for s in ranked if len(s) > 1), rank,
                stats.probability_of_improvement(pairs, metric.higher_is_better) if pairs else None,
                method in baselines, len(pairs), diverged))
        out.append(Across(metric, stratum_keys, sum(len(s) > 1 for s in ranked), methods_out))
    return out
