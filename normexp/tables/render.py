"""Render an aggregated table: Markdown, CSV (tidy), LaTeX (booktabs) and plots, each saying what produced it
(paper source, scale, seeds, date, commits, hardware). Cells read ``mean ± h (n)`` (h: half the 95 % t
interval), deltas ``+d ± h`` with ``≈`` where the interval contains 0; docs/tables-and-figures.md
(*Output*)."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import re
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ..plotting import HATCHES, member_styles, norm_color, shades
from .aggregate import DERIVED_NOTES, Across, Cell, Row, TableResult, across_strata, metric_value
from .spec import DEFAULT_SCALE, Metric, TableSpec, get_path
from .stats import CONFIDENCE, N_RESAMPLES, WITHIN_NOISE, Interval, t_half_width

LEVEL = f"{CONFIDENCE * 100:.0f} %"

RESULTS_DIR = Path("results")  # of the checkout the tables are made in (make runs from its root)
INDEX_BEGIN, INDEX_END = "<!-- tables:begin -->", "<!-- tables:end -->"


# ---------------------------------------------------------------- cell text
def fmt(value: float | None, spec: str, signed: bool = False) -> str:
    if value is None:
        return ""
    text = format(value, ("+" if signed else "") + spec)
    return "0" + text[2:] if text.startswith("+-0") else text  # no "-0.0" flicker in deltas


def ours(cell: Cell, metric: Metric) -> str:
    parts = []
    interval = cell.interval
    if interval is not None:
        half = interval.half_width
        parts.append(f"{fmt(interval.estimate, metric.fmt)} (1 run)" if half is None
                     else f"{fmt(interval.estimate, metric.fmt)} ± {fmt(half, metric.fmt)} ({cell.n})")
    shown = [m for m in cell.markers if m != "n/a"]
    parts += shown
    if not parts:
        return "—"  # the metric does not apply to these runs (e.g. mask AP of RetinaNet)
    return "; ".join(parts)


def paper(cell: Cell, metric: Metric) -> str:
    if cell.paper is None:
        return "n/a"
    return fmt(cell.paper, metric.fmt) if isinstance(cell.paper, (int, float)) else str(cell.paper)


def delta(value: float | None, metric: Metric) -> str:
    return fmt(value, metric.fmt, signed=True) if value is not None else "—"


def our_delta(cell: Cell, metric: Metric) -> str:
    """``+d ± h``, ``≈`` when the interval contains 0, ``(Welch)`` when the seeds differ; ``+d`` alone: no
    interval."""
    found = cell.delta_interval
    if found is None:
        return "—"
    text = delta(found.estimate, metric)
    if found.half_width is not None:
        text += f" ± {fmt(found.half_width, metric.fmt)}"
    if cell.within_noise:
        text += f" {WITHIN_NOISE}"
    return text + (" (Welch)" if found.kind == "Welch" and found.has_interval else "")


def sweep_columns(result: TableResult) -> tuple[list[str], Callable[[Row], list[str]]]:
    """A best_of table's two extra columns (the chosen value, every value's result) and a row's cells."""
    spec = result.spec
    if spec.best_of is None:
        return [], lambda _row: []
    key = spec.best_of.key
    metric = next(m for m in spec.metrics if m.key == spec.best_of.metric)

    def cells(row: Row) -> list[str]:
        chosen = "—" if row.choice is None else spec.display(key, row.choice)
        tried = "; ".join(f"{spec.display(key, v)}: {ours(c, metric)}" for v, c in row.sweep.items())
        return [chosen, tried]

    return [spec.header(key), f"{spec.header(key)} swept: {metric.label}"], cells


# ---------------------------------------------------------------- provenance
def provenance(result: TableResult) -> dict[str, Any]:
    records = [run.record for run in result.plan.runs if run.record is not None and run.record.damage is None]
    commits = sorted({(get_path(r.summary, "git.commit") or "unknown")[:10]
                      + ("+dirty" if get_path(r.summary, "git.dirty") else "") for r in records})
    hardware = sorted({describe_hardware(r.summary.get("hardware")) for r in records})
    finished = sorted(r.summary.get("finished_at") or "" for r in records if r.summary.get("finished_at"))
    return {
        "table": result.spec.id,
        "scale": result.plan.scale.name,
        "seeds": list(result.plan.seeds),
        "rendered_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "runs": {"total": len(result.plan.runs), "with_record": len(records),
                 **{s: sum(r.status == s for r in records) for s in ("completed", "diverged", "failed")}},
        "run_dates": [finished[0][:10], finished[-1][:10]] if finished else [],
        "commits": commits,
        "hardware": hardware,
    }


def describe_hardware(hw: dict[str, Any] | None) -> str:
    if not hw:
        return "unknown hardware"
    device = hw.get("device") or "cpu"
    if device == "cpu":
        return f"cpu, {hw.get('cpu_count')} CPU cores"
    return f"{device} x{hw.get('gpus', 1)}"


def caption(result: TableResult) -> list[str]:
    spec, scale = result.spec, result.plan.scale
    prov = provenance(result)
    lines = [f"**{spec.title}.** Paper: {spec.source or '— (a table neither paper has)'}."]
    dates = "–".join(dict.fromkeys(prov["run_dates"])) or "no runs yet"
    seeds = ", ".join(map(str, prov["seeds"]))
    commits, hardware = ", ".join(prov["commits"]) or "—", "; ".join(prov["hardware"]) or "—"
    lines.append(f"Ours: scale `{scale.name}` ({scale.description}); seeds {seeds}; runs {dates}; "
                 f"commit {commits}; {hardware}.")
    if scale.caption:
        lines.append(scale.caption)
    lines.append(f"Cells: mean ± the half-width of its {LEVEL} confidence interval over the completed seeds "
                 "(Student t, n − 1 df), then n; a cell of one run reads `1 run` and has no interval. "
                 "`diverged@<step>`: the training loss became non-finite at that step (a result); `failed`, "
                 "`missing`: no result.")
    if any(m.delta for m in spec.metrics):
        lines.append(DELTA_CAPTION)
    lines.append(seed_noise_line(result))
    if any(run.source_diverged for run in result.plan.runs):
        lines.append("`pre-training diverged@<step>`: the run this one starts from diverged at that step (a "
                     "result): there is nothing to start from, and nothing was launched.")
    if any(run.damaged for run in result.plan.runs):
        lines.append("`damaged`: a record that does not read back (`normexp table run` names what is wrong).")
    lines += shared_runs_notes(result)
    if spec.best_of:
        lines.append(f"Each row shows the best of its runs' `{spec.best_of.key}` values by "
                     f"{next(m.label for m in spec.metrics if m.key == spec.best_of.metric)} (a diverged "
                     "value is a result, never chosen); every value's result is in the swept column. The "
                     "choice is made on the evaluation set, as a paper's search is: it favours the swept "
                     "rows by the spread of their values.")
    if spec.paper_note:
        lines.append(f"Paper values: {spec.paper_note}")
    for name in result.derived_used:
        lines.append(f"Where a run has no such value, {DERIVED_NOTES[name]}.")
    weights = reported_weights_line(result)
    if weights:
        lines.append(weights)
    if spec.notes:
        lines.append(spec.notes.strip())
    return lines


DELTA_CAPTION = (
    f"Δ: ours minus the baseline row's, ± the half-width of its {LEVEL} interval: paired by seed (the "
    "mean and t interval of the per-seed differences) where both rows completed the same seeds -- a seed "
    "fixes the order and augmentation of the training data and the random state the weights and dropout are "
    "drawn from, and every run validates on the same images -- else Welch's t interval "
    f"(Welch–Satterthwaite df), marked (Welch). {WITHIN_NOISE}: within noise, the interval contains 0. A Δ "
    "without ± has one run on a side.")


def seed_noise_line(result: TableResult) -> str:
    """The seed-to-seed std at this scale, pooled over the rows, of the compared metrics (all if none is)."""
    metrics = [m for m in result.spec.metrics if m.delta] or list(result.spec.metrics)
    pooled = result.seed_std
    found = [f"{m.label} {fmt(pooled[m.key][0], m.fmt)} ({pooled[m.key][1]} df)"
             for m in metrics if pooled[m.key] is not None]
    if not found:
        return "Seed noise at this scale: not measured (no row has two completed runs)."
    return ("Seed noise at this scale (the std over seeds, pooled over the rows with two or more runs): "
            + ", ".join(found) + "; a difference of about that size is within noise.")


WEIGHTS = {"ema": "the EMA model's", "raw": "the trained model's"}


def reported_weights_line(result: TableResult) -> str:
    """Which weights our ``metrics.reported`` values come from, per row (``trainer.ema.reported``)."""
    spec = result.spec
    if not any(path.startswith("metrics.reported.") for m in spec.metrics for path in m.value):
        return ""
    rows: dict[str, list[str]] = {}
    for row in result.rows:
        seen = {get_path(run.record.summary, "metrics.reported.weights")
                for _, run in row.points if run.record is not None}
        name = " ".join(spec.display(k, row.labels[k]) for k in spec.label_keys)
        for which in sorted(w for w in seen if w):
            rows.setdefault(which, []).append(name)
    if len(rows) == 1:
        return f"Our metrics are {WEIGHTS[next(iter(rows))]} in every row."
    parts = [f"{WEIGHTS[w]} for {', '.join(names)}" for w, names in sorted(rows.items())]
    return "Our metrics are " + "; ".join(parts) + "." if parts else ""


def shows_run_as(result: TableResult) -> bool:
    """Whether some row ran another backbone than its paper's (a scale's ``*_micro`` member)."""
    return any(r.run_as != sorted({str(p.backbone) for p, _ in r.points}) or r.same_as for r in result.rows)


def row_label(result: TableResult, row: Row, keys: tuple[str, ...] | None = None) -> str:
    spec = result.spec
    return " / ".join(spec.display(k, row.labels[k]) for k in (keys or spec.label_keys))


def ran_as(result: TableResult, row: Row, keys: tuple[str, ...] | None = None) -> str:
    """What ran for ``row``; for a row served by the very runs of an earlier one, which row that is."""
    same = f" (= {row_label(result, row.same_as, keys)})" if row.same_as is not None else ""
    return ", ".join(row.run_as) + same


def repeated_groups(result: TableResult) -> dict[str, str]:
    """``{repeating group: the group it repeats}`` for groups whose every row repeats another's runs."""
    key = result.spec.rows[0]
    groups: dict[str, list[Row]] = {}
    for row in result.rows:
        groups.setdefault(str(row.labels[key]), []).append(row)
    repeated = {}
    for group, rows in groups.items():
        origins = {str(r.same_as.labels[key]) for r in rows if r.same_as is not None}
        if len(origins) == 1 and all(r.same_as is not None for r in rows) and origins != {group}:
            repeated[group] = origins.pop()
    return repeated


def shared_runs_notes(result: TableResult) -> list[str]:
    """One sentence per set of rows that are one set of runs at this scale: one result, not several."""
    spec, key = result.spec, result.spec.rows[0]
    repeated = repeated_groups(result)
    notes = []
    for origin in dict.fromkeys(repeated.values()):
        copies = [g for g, o in repeated.items() if o == origin]
        names = [spec.display(key, g) for g in [origin, *copies]]
        members = ", ".join(next(r.run_as for r in result.rows if str(r.labels[key]) == origin))
        notes.append(f"At this scale {_and(names)} are the same runs ({members}): the rows of "
                     f"{_and(names[1:])} repeat {names[0]}'s values; they are one result, not {len(names)}.")
    for row in result.rows:
        if row.same_as is not None and str(row.labels[key]) not in repeated:
            notes.append(f"At this scale {row_label(result, row)} is the same run(s) as "
                         f"{row_label(result, row.same_as)}: its values repeat those, not a second result.")
    return notes


def _and(names: list[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


# ---------------------------------------------------------------- grids (shared by Markdown and LaTeX)
def grid(result: TableResult) -> tuple[list[str], list[list[str]]]:
    """Header and body cells of the table as shown (long layout, or a pivot for ``columns`` tables)."""
    spec = result.spec
    shown = shows_run_as(result)
    if spec.columns:
        return _pivot_grid(result, shown)
    swept, sweep_cells = sweep_columns(result)
    header = [spec.header(k) for k in spec.rows] + (["run as"] if shown else []) + swept
    for m in spec.metrics:
        header += [f"{m.label}", "paper"] + ([f"Δ {m.label}", "Δ paper"] if m.delta else [])
    body = []
    for row in result.rows:
        line = [spec.display(k, row.labels[k]) for k in spec.rows]
        line += [ran_as(result, row)] if shown else []
        line += sweep_cells(row)
        for m in spec.metrics:
            cell = row.cells[m.key]
            line += [ours(cell, m), paper(cell, m)]
            if m.delta:
                line += [our_delta(cell, m), delta(cell.paper_delta, m)]
        body.append(line)
    return header, body


def _pivot_grid(result: TableResult, shown: bool) -> tuple[list[str], list[list[str]]]:
    spec, metric = result.spec, result.spec.metrics[0]
    col_key = spec.columns
    columns = list(dict.fromkeys(str(r.labels[col_key]) for r in result.rows))
    by_row: dict[tuple[str, ...], dict[str, Row]] = {}
    for row in result.rows:
        by_row.setdefault(tuple(str(row.labels[k]) for k in spec.rows), {})[str(row.labels[col_key])] = row
    header = [spec.header(k) for k in spec.rows] + [""] + [spec.display(col_key, c) for c in columns]
    body = []
    for cells in by_row.values():
        first = next(iter(cells.values()))
        names = [spec.display(k, first.labels[k]) for k in spec.rows]
        what = [("ours", lambda c: ours(c, metric)), ("paper", lambda c: paper(c, metric))]
        if metric.delta:
            what += [("Δ ours", lambda c: our_delta(c, metric)),
                     ("Δ paper", lambda c: delta(c.paper_delta, metric))]
        if shown:
            what.append(("run as", None))
        for i, (label, show) in enumerate(what):
            shown = names if i == 0 else [""] * len(names)
            if show is None:
                values = [ran_as(result, cells[c], spec.rows) if c in cells else "" for c in columns]
            else:
                values = [show(cells[c].cells[metric.key]) if c in cells else "" for c in columns]
            body.append(shown + [label] + values)
    return header, body


# ---------------------------------------------------------------- across backbones
def bracket(found: Interval | None, spec: str, noise_at: float | None = None) -> str:
    """``estimate [low, high] (n)``, ``≈`` where the interval holds ``noise_at``."""
    if found is None:
        return "—"
    text = format(found.estimate, spec)
    if found.has_interval:
        text += f" [{format(found.low, spec)}, {format(found.high, spec)}]"
        if noise_at is not None and found.low <= noise_at <= found.high:  # type: ignore[operator]
            text += f" {WITHIN_NOISE}"
    return text


def across_caption(result: TableResult, across: list[Across]) -> str:
    spec, first = result.spec, across[0]
    strata = " / ".join(spec.header(k) for k in first.stratum_keys)
    return (f"Across {strata}: per method, its mean rank among the rows of each {strata} (1: best, ties "
            "share their ranks) and its probability of improvement P(X > baseline), the chance that a run of "
            f"X beats a run of the baseline row of the same {strata} and seed (every pair of runs where the "
            f"seeds differ), averaged over the {strata} values (Agarwal et al. 2021, arXiv:2108.13264). "
            f"[low, high]: the {LEVEL} stratified bootstrap interval (runs resampled within their {strata}; "
            f"percentile, {N_RESAMPLES} resamples), none where a cell has one run; {WITHIN_NOISE}: P's "
            "interval holds 1/2. n: the strata ranked / compared."
            + (f" A diverged run is a result, the worst: it ranks last in its {strata} and loses every "
               "comparison (ties another diverged run); `k diverged`: the method's diverged runs counted so."
               if any(m.diverged for a in across for m in a.methods) else ""))


def across_grid(result: TableResult, across: list[Across]) -> tuple[list[str], list[list[str]]]:
    spec = result.spec
    keys = list(dict.fromkeys(k for a in across for m in a.methods for k in m.labels))
    header = [spec.header(k) for k in keys]
    for a in across:
        header += [f"mean rank ({a.metric.label})", f"P(X > baseline) ({a.metric.label})"]
    body = []
    for i, method in enumerate(across[0].methods):
        line = [spec.display(k, method.labels[k]) if k in method.labels else "" for k in keys]
        for a in across:
            m = a.methods[i]
            counted = f"{m.strata}; {m.diverged} diverged" if m.diverged else f"{m.strata}"
            line.append(f"{bracket(m.rank, '.2f')} ({counted})" if m.rank else "—")
            line.append("baseline" if m.baseline and not m.compared else
                        f"{bracket(m.improvement, '.2f', 0.5)} ({m.compared})" if m.improvement else "—")
        body.append(line)
    return header, body


def across_csv(result: TableResult, across: list[Across]) -> str:
    """One line per delta metric x method: mean rank and probability of improvement, their intervals."""
    spec = result.spec
    keys = list(dict.fromkeys(k for a in across for m in a.methods for k in m.labels))
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["table", "scale", "metric", *keys, "baseline", "strata_ranked", "diverged_runs",
                     "mean_rank", "mean_rank_low", "mean_rank_high", "strata_compared", "p_improvement",
                     "p_improvement_low", "p_improvement_high", "within_noise"])
    for a in across:
        for m in a.methods:
            rank, poi = m.rank, m.improvement
            noise = poi is not None and poi.has_interval and poi.low <= 0.5 <= poi.high  # type: ignore[operator]
            writer.writerow([spec.id, result.plan.scale.name, a.metric.key,
                             *[m.labels.get(k, "") for k in keys], m.baseline, m.strata, m.diverged,
                             *[_raw(getattr(rank, f, None)) for f in ("estimate", "low", "high")], m.compared,
                             *[_raw(getattr(poi, f, None)) for f in ("estimate", "low", "high")],
                             WITHIN_NOISE if noise else ""])
    return out.getvalue()


# ---------------------------------------------------------------- formats
def to_markdown(result: TableResult) -> str:
    header, body = grid(result)
    lines = [f"# {result.spec.title}", ""] + [part for line in caption(result) for part in (line, "")]
    lines += _md_table(header, body)
    across = across_strata(result)
    if across:
        lines += ["", "## Across " + " / ".join(result.spec.header(k) for k in across[0].stratum_keys), "",
                  across_caption(result, across), ""]
        lines += _md_table(*across_grid(result, across))
    return "\n".join(lines) + "\n"


def _md_table(header: list[str], body: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(c.replace("|", "\\|") for c in line) + " |" for line in body)]


def to_csv(result: TableResult) -> str:
    """Tidy: one line per row x metric, every number unformatted."""
    spec = result.spec
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    keys = list(spec.label_keys)
    swept = [spec.best_of.key] if spec.best_of else []  # the value a best_of row's cells are
    writer.writerow(["table", "scale", *keys, *swept, "run_as", "same_runs_as", "metric", "mean", "std", "n",
                     "ci95", "markers", "paper", "delta", "delta_ci95", "delta_test", "within_noise",
                     "paper_delta"])
    for row in result.rows:
        same = row_label(result, row.same_as) if row.same_as is not None else ""
        for m in spec.metrics:
            cell = row.cells[m.key]
            writer.writerow([spec.id, result.plan.scale.name, *[row.labels[k] for k in keys],
                             *([row.choice] if swept else []), " ".join(row.run_as), same, m.key,
                             _raw(cell.mean), _raw(cell.std), cell.n, _raw(_half(cell.interval)),
                             "; ".join(cell.markers), "" if cell.paper is None else cell.paper,
                             _raw(cell.delta), _raw(_half(cell.delta_interval)),
                             cell.delta_interval.kind.lower() if cell.delta_interval else "",
                             WITHIN_NOISE if cell.within_noise else "", _raw(cell.paper_delta)])
    return out.getvalue()


def _raw(value: float | None) -> str:
    return "" if value is None else repr(round(value, 6))


def _half(interval: Interval | None) -> float | None:
    return None if interval is None else interval.half_width


_TEX = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_", "{": r"\{",
        "}": r"\}", "~": r"\textasciitilde{}", "^": r"\^{}", "±": r"$\pm$", "Δ": r"$\Delta$", "—": "---",
        "–": "--", "→": r"$\to$", "≥": r"$\geq$", "≤": r"$\leq$", "≈": r"$\approx$", "−": "$-$",
        "<": r"\textless{}", ">": r"\textgreater{}"}


def tex_escape(text: str) -> str:
    text = re.sub(r"`([^`]*)`", r"\1", text)
    text = re.sub(r"\*\*([^*]*)\*\*", r"\1", text)
    return "".join(_TEX.get(ch, ch) for ch in text)


def to_latex(result: TableResult) -> str:
    header, body = grid(result)
    labels = len(result.spec.rows) + (1 if result.spec.columns else 0)
    lines = ["% generated by normexp.tables -- needs \\usepackage{booktabs}"]
    lines += _tex_table(header, body, labels, " ".join(caption(result)), f"tab:normexp-{result.spec.id}")
    across = across_strata(result)
    if across:
        header, body = across_grid(result, across)
        labels = len(header) - 2 * len(across)
        lines += _tex_table(header, body, labels, across_caption(result, across),
                            f"tab:normexp-{result.spec.id}-across")
    return "\n".join(lines) + "\n"


def _tex_table(header: list[str], body: list[list[str]], labels: int, text: str, label: str) -> list[str]:
    cols = "l" * labels + "r" * (len(header) - labels)
    lines = [r"\begin{table}[t]", r"\centering", r"\small", f"\\begin{{tabular}}{{{cols}}}", r"\toprule",
             " & ".join(tex_escape(h) for h in header) + r" \\", r"\midrule"]
    lines += [" & ".join(tex_escape(c) for c in line) + r" \\" for line in body]
    return lines + [r"\bottomrule", r"\end{tabular}", f"\\caption{{{tex_escape(text)}}}",
                    f"\\label{{{label}}}", r"\end{table}"]


# ---------------------------------------------------------------- plots
def headline(result: TableResult) -> Metric:
    return next((m for m in result.spec.metrics if m.delta), result.spec.metrics[0])


@dataclass
class Bar:
    """One row of a table's picture: its labels (values as text), normalizer, headline cell and, for a row
    served by another row's runs, that row's key (``same_as``)."""

    labels: dict[str, str]
    norm: str | None
    mean: float | None
    half: float | None  # half-width of its interval; None: no interval (fewer than two runs)
    n: int
    markers: list[str]
    paper: Any
    within_noise: bool
    same_as: tuple[str, ...] | None = None
    paper_metric: bool = True  # our value is the paper's metric (not a fallback value path)

    def key(self, keys: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(self.labels[k] for k in keys)


def bars_of(result: TableResult) -> list[Bar]:
    """The headline metric of every row, from the aggregated records."""
    metric, keys = headline(result), result.spec.label_keys
    bars = []
    for row in result.rows:
        cell = row.cells[metric.key]
        bars.append(Bar({k: str(row.labels[k]) for k in keys}, row.norm, cell.mean, _half(cell.interval),
                        cell.n, cell.markers, cell.paper, bool(cell.within_noise),
                        None if row.same_as is None else tuple(str(row.same_as.labels[k]) for k in keys),
                        cell.paths <= {metric.value[0], str(metric.derive)}))
    return bars


def bars_from_csv(spec: TableSpec, path: Path) -> list[Bar]:
    """The headline metric of every row from a table's committed CSV (where its records are not kept). The CSV
    does not say which value path gave a cell: a metric with fallback paths gets no paper ticks."""
    metric = next((m for m in spec.metrics if m.delta), spec.metrics[0])
    keys = spec.label_keys
    rows = [r for r in csv.DictReader(path.open()) if r["metric"] == metric.key]
    by_name = {" / ".join(spec.display(k, r[k]) for k in keys): tuple(r[k] for k in keys) for r in rows}
    norms = {o.partition("=")[2] for b in spec.blocks for o in b.split() if o.startswith("norm=")}
    only_norm = next(iter(norms)) if len(norms) == 1 else None  # a table of one normalizer's settings
    bars = []
    for r in rows:
        paper: Any = r["paper"] or None
        with contextlib.suppress(TypeError, ValueError):  # else a paper cell in words ("61.0 → failed")
            paper = float(paper)
        n, half = int(r["n"] or 0), r.get("ci95")  # a CSV before the ci95 column: from std and n
        half = float(half) if half else t_half_width(float(r["std"]), n) if r["std"] and n > 1 else None
        bars.append(Bar({k: r[k] for k in keys}, r.get("norm.name") or only_norm,
                        float(r["mean"]) if r["mean"] else None, half, n,
                        [m for m in r["markers"].split("; ") if m], paper,
                        bool(r.get("within_noise")), by_name.get(r["same_runs_as"]),
                        len(metric.value) == 1))
    return bars


def plot_bars(result: TableResult, path: Path) -> None:
    draw_bars(result.spec, result.plan.scale.name, bars_of(result), path)


def setting_name(spec: TableSpec, labels: dict[str, str]) -> str:
    """A setting (some row keys' values) in words: the spec's ``setting_labels`` entry, else each value by its
    ``labels`` name, or ``<header> <value>`` where it has none."""
    named = spec.setting_label(labels)
    if named is not None:
        return named
    parts = []
    for k, v in labels.items():
        shown = spec.display(k, v)
        parts.append(shown if shown != v or k == "norm.name" else f"{spec.header(k)} {v}")
    return ", ".join(parts)


def draw_bars(spec: TableSpec, scale: str, bars: list[Bar], path: Path) -> None:
    """The headline metric per row (mean, 95 % t error bars where there is an interval, n), grouped by the
    first row key, one colour per normalizer (shades and hatches tell one normalizer's settings apart in a
    group); bars within noise dashed and marked ``≈``; the paper's value a black tick where ours is the same
    metric. A row served by another row's runs is drawn once: its group's slot names the row it repeats, and a
    group whose every row repeats another's is that group's tick."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metric = next((m for m in spec.metrics if m.delta), spec.metrics[0])
    keys, group_key = spec.label_keys, spec.rows[0]
    setting_keys = [k for k in keys if k != group_key]
    by_key = {b.key(keys): b for b in bars}
    copies_of: dict[str, set[str]] = {}  # group -> the groups its rows repeat
    for b in bars:
        origin = by_key[b.same_as].labels[group_key] if b.same_as else None
        copies_of.setdefault(b.labels[group_key], set()).add(origin)
    repeats = {g: o.pop() for g, o in copies_of.items() if len(o) == 1 and None not in o
               and o != {g}}  # every row of g repeats one other group: g is that group's tick
    groups = [g for g in dict.fromkeys(b.labels[group_key] for b in bars) if g not in repeats]
    members = {g: [b for b in bars if b.labels[group_key] == g] for g in groups}

    def setting(b: Bar) -> tuple[str, ...]:
        return tuple(b.labels[k] for k in setting_keys)

    settings: dict[str | None, list[tuple[str, ...]]] = {}
    crowded: set[str | None] = set()  # normalizers with several settings in one group
    for g in groups:
        for b in members[g]:
            settings.setdefault(b.norm, [])
            if setting(b) not in settings[b.norm]:
                settings[b.norm].append(setting(b))
        if any(sum(b.norm == n for b in members[g]) > 1 for n in settings):
            crowded |= {n for n in settings if sum(b.norm == n for b in members[g]) > 1}
    styles = {}
    for norm, found in settings.items():
        tones = shades(norm_color(norm), len(found), lightest=0.6)[::-1] if norm in crowded else None
        for k, s in enumerate(found):
            styles[norm, s] = {"color": tones[k] if tones else norm_color(norm),
                               "hatch": HATCHES[k % len(HATCHES)] if tones else ""}
    most = max((len(m) for m in members.values()), default=1)
    width = 0.8 / most
    fig, ax = plt.subplots(figsize=(max(6.0, 0.6 * len(bars) + 3.5), 4.4))
    labelled: set[tuple[str | None, tuple[str, ...]]] = set()
    ticked = False
    for i, group in enumerate(groups):
        for j, b in enumerate(members[group]):  # the group's bars side by side, centred on its tick
            x = i + width * (j - (len(members[group]) - 1) / 2)
            if b.same_as is not None:  # the runs are another row's: say whose, draw them there
                ax.text(x, 0, " = " + setting_name(spec, dict(zip(keys, b.same_as, strict=True))),
                        ha="center", va="bottom", rotation=90, fontsize=7, color="0.35")
                continue
            style = styles[b.norm, setting(b)]
            label = None
            if (b.norm, setting(b)) not in labelled and setting_keys:
                label = setting_name(spec, dict(zip(setting_keys, setting(b), strict=True)))
                labelled.add((b.norm, setting(b)))
            noise = b.within_noise
            ax.bar(x, b.mean or 0, width, color=style["color"], hatch=style["hatch"], edgecolor="white",
                   linewidth=0.5, label=label)
            if noise:  # a dashed outline of its own: the hatch keeps the setting's colour
                ax.bar(x, b.mean or 0, width, fill=False, edgecolor="black", linestyle="--", linewidth=1.0)
            if b.half is not None:
                ax.errorbar(x, b.mean or 0, yerr=b.half, color="black", capsize=3, lw=1)
            also = [setting_name(spec, {k: v for k, v in c.labels.items() if v != b.labels[k]})
                    for c in bars if c.same_as == b.key(keys) and c.labels[group_key] not in repeats]
            if also:
                ax.annotate("= " + "\n= ".join(also), (x, (b.mean or 0) + (b.half or 0)), xytext=(0, 2),
                            textcoords="offset points", ha="center", va="bottom", fontsize=6)
            if b.n:
                ax.annotate(f"n={b.n}", (x, 0), xytext=(0, 2), textcoords="offset points", ha="center",
                            va="bottom", fontsize=6, color="black" if style["hatch"] else "white")
            if noise:
                ax.annotate(WITHIN_NOISE, (x, (b.mean or 0) + (b.half or 0)), xytext=(0, 2 + 8 * len(also)),
                            textcoords="offset points", ha="center", va="bottom", fontsize=9)
            if isinstance(b.paper, (int, float)) and b.paper_metric:
                ax.plot([x - width / 2, x + width / 2], [b.paper] * 2, color="black", lw=2)
                ticked = True
            markers = [m.split(":")[0] for m in b.markers if m != "n/a"]  # "failed: <error>" -> "failed"
            if markers:
                ax.text(x, 0, " " + ", ".join(markers), ha="center", va="bottom", rotation=90, fontsize=7)
    named = {g: [g, *(copy for copy, origin in repeats.items() if origin == g)] for g in groups}
    ticks = [" =\n".join(spec.display(group_key, g) for g in named[group]) for group in groups]
    ax.set_xticks(range(len(groups)), ticks)
    ax.set_xlim(-0.6, len(groups) - 0.4)
    ax.set_ylabel(metric.label + (f" (error bars: {LEVEL} t interval)" if any(b.half for b in bars) else ""))
    single = "; no error bar: one run" if any(b.n == 1 for b in bars) else ""
    notes = [f"scale {scale}", f"n: completed seeds{single}"]
    if ticked:
        notes.append("black ticks: the paper's value")
    elif any(isinstance(b.paper, (int, float)) for b in bars):
        others = ", ".join(f"`{p}`" for p in metric.value[1:]) or "another value"
        notes.append(f"no paper ticks: our cells may be {others}, not the paper's `{metric.value[0]}`")
    if any(b.same_as for b in bars):
        notes.append("a = b: the same runs, drawn once")
    if any(b.within_noise for b in bars):
        notes.append(f"dashed, {WITHIN_NOISE}: Δ within noise")
    ax.set_title(textwrap.fill(spec.title, int(11 * fig.get_figwidth())), fontsize=9)
    fig.text(0.01, 0.01, textwrap.fill("; ".join(notes), int(15 * fig.get_figwidth())), fontsize=7,
             va="bottom", color="0.3")
    if labelled:
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def plot_curves(result: TableResult, path: Path) -> bool:
    """Training loss per step and the headline validation metric per epoch of every run of the table; with the
    spec's ``curves`` panels, one training-loss panel per panel instead (a paper's loss-curve figure). None
    drawn (and an old one removed) where no run logged a training loss (a table of evaluations)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..tracking.records import logged_rows

    spec = result.spec
    rows = [r for r in result.rows if r.same_as is None]
    runs = {run.run_id: run.record.dir for r in rows for _, run in r.shown if run.record is not None}
    logs = {run_id: found for run_id, where in runs.items() if (found := logged_rows(where)) is not None}
    if not any("train/loss" in r for log in logs.values() for r in log):
        path.unlink(missing_ok=True)
        return False
    finals = [p.removeprefix("metrics.final.") for m in spec.metrics for p in m.value
              if p.startswith("metrics.final.")]  # the first the runs log (EMA's where there is an EMA)
    val_key = next((k for k in finals if any(k in r for log in logs.values() for r in log)), None)
    styles = member_styles((r.norm, r.key) for r in rows)
    ax_val = None
    if spec.curves:
        fig, axes = plt.subplots(1, len(spec.curves), figsize=(5.5 * len(spec.curves), 4), squeeze=False)
        panels = [(ax, [r for r in rows if panel.matches(r.labels)], panel.title)
                  for ax, panel in zip(axes[0], spec.curves, strict=True)]
        val_key = None
    else:
        fig, (ax_loss, ax_val) = plt.subplots(1, 2, figsize=(11, 4))
        panels = [(ax_loss, rows, "training loss (dotted: divergence)")]
    for ax_loss, panel_rows, _ in panels:
        for row in panel_rows:
            copies = [r for r in result.rows if r.same_as is row]
            label = " = ".join(row_label(result, r) for r in [row, *copies])
            for j, (_, run) in enumerate(sorted(row.shown, key=lambda pr: pr[0].seed)):
                if run.run_id in logs:
                    kw = {"color": styles[row.key]["color"], "ls": styles[row.key]["linestyle"], "lw": 1,
                          "label": label if j == 0 else None}
                    _plot_run(run, logs[run.run_id], ax_loss, ax_val if val_key else None, val_key, kw)
    for ax_loss, _, title in panels:
        ax_loss.set(xlabel="step", ylabel="train/loss", title=title)
        ax_loss.set_yscale("log")
        ax_loss.grid(alpha=0.3)
    if spec.curves:
        for ax_loss, _, _ in panels:
            ax_loss.legend(fontsize=7)
        handles = []
    else:
        ax_val.set(xlabel="epoch", ylabel=val_key or "", title=val_key or "no per-epoch metric")
        ax_val.grid(alpha=0.3)
        handles, labels = ax_loss.get_legend_handles_labels()
        if not handles:
            handles, labels = ax_val.get_legend_handles_labels()
        if handles:
            fig.legend(handles, labels, loc="lower center", ncol=min(4, len(labels)), fontsize=7)
    mirror = f"; as {spec.curves_mirror}, dotted: divergence" if spec.curves_mirror else ""
    fig.suptitle(textwrap.fill(f"{spec.title} ({result.plan.scale.name}{mirror})", 120), fontsize=9)
    rows_of_legend = (len(labels) + 3) // 4 if handles else 0
    fig.tight_layout(rect=(0, min(0.06 * rows_of_legend, 0.4), 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _plot_run(run: Any, records: list[dict[str, Any]], ax_loss: Any, ax_val: Any, val_key: str | None,
              kw: dict[str, Any]) -> None:
    """A run's training loss per logged step (interval rows, not epoch rows) and its validation metric."""
    steps = [(r["step"], r["train/loss"]) for r in records
             if isinstance(r.get("train/loss"), (int, float)) and "val/top1" not in r]
    if steps:
        ax_loss.plot(*zip(*steps, strict=True), **kw)
    vals = [(r["epoch"], r[val_key]) for r in records if isinstance(r.get(val_key), (int, float))]
    if ax_val is not None and vals:
        ax_val.plot(*zip(*vals, strict=True), marker=".", **kw)
    if run.status == "diverged":
        ax_loss.axvline(get_path(run.record.summary, "diverged.step"), color=kw["color"], ls=":")


# ---------------------------------------------------------------- writing
def write_table(result: TableResult, out_dir: Path = RESULTS_DIR / "tables") -> list[Path]:
    """The table's files in ``out_dir`` (``out_dir/<scale>`` off the default scale), ``index.json`` and the
    README section."""
    readme = out_dir.parent / "README.md"
    scale = result.plan.scale.name
    if scale != DEFAULT_SCALE:
        out_dir = out_dir / scale
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / result.spec.id
    paths = [stem.with_suffix(".md"), stem.with_suffix(".csv"), stem.with_suffix(".tex")]
    for path, text in zip(paths, (to_markdown(result), to_csv(result), to_latex(result)), strict=True):
        path.write_text(text)
    across = across_strata(result)
    if across:
        paths.append(out_dir / f"{result.spec.id}_across.csv")
        paths[-1].write_text(across_csv(result, across))
    plot_bars(result, stem.with_suffix(".png"))
    paths.append(stem.with_suffix(".png"))
    if plot_curves(result, out_dir / f"{result.spec.id}_curves.png"):
        paths.append(out_dir / f"{result.spec.id}_curves.png")
    update_index(result, out_dir, readme)
    return paths


def update_index(result: TableResult, out_dir: Path, readme: Path) -> None:
    """``index.json`` beside the tables, and their section of ``readme`` built from it (one per scale)."""
    folder = out_dir.relative_to(readme.parent).as_posix() if out_dir.is_relative_to(readme.parent) \
        else out_dir

    def row(table_id: str, entry: dict[str, Any]) -> str:
        runs = entry["runs"]
        return (f"| [{table_id}]({folder}/{table_id}.md) | {entry['title']} | {entry['scale']} | "
                f"{runs['completed']} / {runs['diverged']} / {runs['failed']} of {runs['total']} | "
                f"{entry['rendered_at'][:10]} |")

    scale = result.plan.scale.name
    markers, heading = (INDEX_BEGIN, INDEX_END), "Paper tables"
    if scale != DEFAULT_SCALE:
        markers = tuple(m.replace("tables:", f"tables-{scale}:") for m in markers)
        heading = f"Paper tables at scale {scale}"
    entry = {"title": result.spec.title, "source": result.spec.source, **provenance(result)}
    write_index(out_dir, result.spec.id, entry, heading, markers,
                "| table | what | scale | runs: completed / diverged / failed of all | rendered |", row,
                readme)


def write_index(out_dir: Path, key: str, entry: dict[str, Any], heading: str, markers: tuple[str, str],
                header: str, row: Callable[[str, dict[str, Any]], str], readme: Path | None = None) -> None:
    """Set ``key`` in ``out_dir/index.json``, then rewrite the README section between ``markers``."""
    index_path = out_dir / "index.json"
    index = json.loads(index_path.read_text()) if index_path.is_file() else {}
    index[key] = entry
    index_path.write_text(json.dumps(dict(sorted(index.items())), indent=2) + "\n")
    begin, end = markers
    rule = "|" + "---|" * header.count(" | ") + "---|"
    lines = "\n".join([begin, header, rule, *(row(k, v) for k, v in sorted(index.items())), end])
    readme = readme or out_dir.parent / "README.md"
    text = readme.read_text() if readme.is_file() else "# Results\n"
    if begin in text:
        text = text[:text.index(begin)] + lines + text[text.index(end) + len(end):]
    else:
        text = text.rstrip("\n") + f"\n\n## {heading}\n\n" + lines + "\n"
    readme.write_text(text)


__all__ = ["metric_value", "to_csv", "to_latex", "to_markdown", "write_table"]
