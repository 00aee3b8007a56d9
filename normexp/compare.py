"""``normexp compare``: compare logged runs from their local records -- no account, no network.

    normexp compare                                         # every run under outputs/, by backbone and norm
    normexp compare norm.name=dyt "backbone.name=vit_*" --metrics val/top1,val/top5,params
    normexp compare --group-by backbone.name,norm.name,norm.squash --tag classification --format csv
    normexp compare --table dyt_squash --scale smoke        # the runs of a table, grouped by its rows
    normexp compare --table mytable hydra.searchpath=[file://$PWD/configs]   # your own table (as table run)
    normexp compare "backbone.name=vit_*" --baseline norm.name=ln   # each group's delta against its LN group

Reads every ``summary.json`` (and its ``config.yaml``) under ``--root`` (default ``$NORMEXP_OUTPUT_DIR`` or
``outputs``), keeps the runs that match every ``KEY=PATTERN`` filter (fnmatch on the config value at a dotted
path) and every ``--tag`` (the W&B tags: backbone, norm, task, data and the config's ``tags``), groups them by
the ``--group-by`` config paths and prints each metric as mean ± the half-width of its 95 % Student t interval
(n) over the completed runs of a group (``mean (1 run)``: no interval), with the runs that diverged or failed
counted beside. ``--baseline KEY=VALUE`` (KEY one of the group-by paths; VALUE, or a pattern, naming one
of the groups' values) adds each metric's delta against the group with KEY set to VALUE, as the tables do:
paired by seed where both groups completed the same seeds (the mean and t interval of the per-seed
differences), Welch's interval otherwise (marked), ``≈`` where the interval contains 0 (within noise).
Metrics: summary paths (``params``, ``metrics.best.val/top1``), or a bare name for the final evaluation
(``val/top1`` means ``metrics.final.val/top1``). With ``--table`` the runs are the table's (its plan at
``--scale``), grouped by its row labels, and the default metrics are its columns: the numbers the rendered
table shows.
"""

from __future__ import annotations

import argparse
import csv
import fnmatch
import io
import sys
from collections.abc import Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import UserError
from .tables import stats
from .tables.spec import DEFAULT_SCALE, Metric, get_path
from .tracking.records import Record, index_records, output_root, warn_damaged


@dataclass
class Entry:
    """One run as compare sees it: its group labels, its record and config."""

    labels: dict[str, Any]
    record: Record
    config: dict[str, Any]
    seed: Hashable = None  # the run's seed: what deltas pair by


def metric_spec(name: str) -> Metric:
    path = name if "." in name or "/" not in name else f"metrics.final.{name}"
    return Metric(key=name, label=name, value=(path,), fmt=".4g")


def record_tags(config: dict[str, Any]) -> set[str]:
    names = [get_path(config, k) for k in ("backbone.name", "norm.name", "task.name", "data.name")]
    return {str(n) for n in names if n is not None} | {str(t) for t in config.get("tags") or []}


def matches(config: dict[str, Any], filters: list[tuple[str, str]], tags: list[str]) -> bool:
    if any(not fnmatch.fnmatchcase(str(get_path(config, k)), pattern) for k, pattern in filters):
        return False
    return set(tags) <= record_tags(config)


def entries_from_records(root: Path, group_by: list[str]) -> list[Entry]:
    entries = []
    for record in index_records(root, with_config=True).values():  # a damaged record: skipped, named
        entries.append(Entry({k: get_path(record.config, k) for k in group_by}, record, record.config,
                             get_path(record.config, "seed")))
    return entries


def entries_from_table(table: str, scale: str, seeds: tuple[int, ...] | None, group_by: list[str] | None,
                       root: Path | None, extra: list[str] = ()
                       ) -> tuple[list[Entry], list[Metric], list[str]]:
    """The runs of ``table`` (``extra``: the Hydra settings and plugins it was run with, as ``table run``
    takes them) labelled by its rows, its metrics, and the group keys."""
    from .tables.cli import make_plan

    plan = make_plan(table, scale, seeds, list(extra), root)
    keys = group_by or list(plan.spec.label_keys)
    entries = []
    for run in plan.damaged():  # skipped, named
        warn_damaged(run.record.dir, run.record.damage)
    for point, run in plan.points:
        record = run.record
        if record is None or record.damage is not None:
            continue
        labels = {k: point.labels[k] if k in point.labels else get_path(record.config, k) for k in keys}
        entries.append(Entry(labels, record, record.config, point.seed))
    return entries, list(plan.spec.metrics), keys


@dataclass
class Summary:
    """One metric of one group: its completed runs' values by seed, their t interval and std; the delta
    against the baseline group (``--baseline``) with its interval."""

    values: dict[Hashable, float]
    delta: stats.Interval | None = None

    @property
    def interval(self) -> stats.Interval | None:
        return stats.t_interval(list(self.values.values()))

    @property
    def std(self) -> float | None:
        return stats.std(list(self.values.values())) if len(self.values) > 1 else None


def summarise(entries: list[Entry], metrics: list[Metric],
              baseline: tuple[str, str] | None = None) -> list[dict[str, Any]]:
    """One line per group: the labels, n runs by status, and per metric a :class:`Summary` over the completed
    runs -- with, given ``baseline`` (KEY, VALUE), its delta against the group whose KEY is VALUE."""
    from .tables.aggregate import metric_value

    groups: dict[tuple[str, ...], list[Entry]] = {}
    for entry in entries:
        groups.setdefault(tuple(str(v) for v in entry.labels.values()), []).append(entry)
    lines = []
    for members in groups.values():
        completed = [e for e in members if e.record.status == "completed"]
        line: dict[str, Any] = dict(members[0].labels)
        line["runs"] = len(members)
        line["not completed"] = ", ".join(f"{sum(e.record.status == s for e in members)} {s}"
                                          for s in sorted({e.record.status for e in members} - {"completed"}))
        for metric in metrics:
            found = [(e.seed, v) for e in completed
                     if (v := metric_value(metric, e.record.summary)) is not None]
            line[metric.key] = Summary(stats.by_seed([s for s, _ in found], [v for _, v in found]))
        lines.append(line)
    if baseline is not None:
        key, value = baseline
        by_labels = {tuple(str(line[k]) for k in members[0].labels): line
                     for line, members in zip(lines, groups.values(), strict=True)}
        for line, members in zip(lines, groups.values(), strict=True):
            labels = {k: str(line[k]) for k in members[0].labels}
            base = by_labels.get(tuple({**labels, key: value}.values()))
            if base is None or base is line:
                continue
            for metric in metrics:
                own, ref = line[metric.key].values, base[metric.key].values
                if own and ref:
                    line[metric.key].delta = stats.delta(own, ref)
    return lines


CSV_FIELDS = ("mean", "std", "n", "ci95")
DELTA_FIELDS = ("delta", "delta_ci95", "delta_test", "within_noise")


def _csv_fields(summary: Summary, with_delta: bool) -> list[Any]:
    found, d = summary.interval, summary.delta
    out: list[Any] = [found.estimate if found else None, summary.std, len(summary.values),
                      found.half_width if found else None]
    if with_delta:
        noise = stats.within_noise(d)
        out += [d.estimate if d else None, d.half_width if d else None, d.kind.lower() if d else None,
                stats.WITHIN_NOISE if noise else None]
    return ["" if v is None else v for v in out]


def mean_text(summary: Summary, spec: str) -> str:
    found = summary.interval
    if found is None:
        return "—"
    if found.half_width is None:
        return f"{found.estimate:{spec}} (1 run)"
    return f"{found.estimate:{spec}} ± {found.half_width:{spec}} ({found.n})"


def delta_text(summary: Summary, spec: str) -> str:
    d = summary.delta
    if d is None:
        return "—"
    text = f"{d.estimate:+{spec}}"
    if d.has_interval:
        text += f" ± {d.half_width:{spec}}"
        text += f" {stats.WITHIN_NOISE}" if stats.within_noise(d) else ""
        text += " (Welch)" if d.kind == "Welch" else ""
    return text


def render(lines: list[dict[str, Any]], keys: list[str], metrics: list[Metric], fmt: str,
           with_delta: bool = False) -> str:
    fields = CSV_FIELDS + (DELTA_FIELDS if with_delta else ())
    if fmt == "csv":
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow([*keys, "runs", "not completed", *[f"{m.key}_{s}" for m in metrics for s in fields]])
        for line in lines:
            writer.writerow([*[line[k] for k in keys], line["runs"], line["not completed"],
                             *[v for m in metrics for v in _csv_fields(line[m.key], with_delta)]])
        return out.getvalue()
    header = [*keys, "runs"]
    for m in metrics:
        header += [m.label] + ([f"Δ {m.label}"] if with_delta else [])
    header.append("not completed")
    rows = []
    for line in lines:
        cells = [str(line[k]) for k in keys] + [str(line["runs"])]
        for m in metrics:
            cells.append(mean_text(line[m.key], m.fmt))
            if with_delta:
                cells.append(delta_text(line[m.key], m.fmt))
        cells.append(line["not completed"] or "")
        rows.append(cells)
    text = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(text + ["| " + " | ".join(r) + " |" for r in rows]) + "\n"


def legend(baseline: tuple[str, str] | None) -> str:
    """What the Markdown's numbers are."""
    text = (f"mean ± the half-width of its {stats.CONFIDENCE * 100:.0f} % Student t interval over the "
            "completed seeds (n)")
    if baseline is None:
        return text + "; --baseline KEY=VALUE adds deltas."
    return (text + f"; Δ: against {baseline[0]}={baseline[1]}, paired by seed where both groups completed "
            f"the same seeds, else Welch's (marked); {stats.WITHIN_NOISE}: the interval contains 0 (within "
            "noise).")


def is_table_setting(item: str) -> bool:
    """``hydra.searchpath=[...]`` (where a user's own table is), ``plugins=[...]``: how ``table run`` ran a
    table, not a filter."""
    from .tables.plan import is_hydra_override

    return is_hydra_override(item) or item.lstrip("+~").partition("=")[0] == "plugins"


def parse_filters(items: list[str]) -> list[tuple[str, str]]:
    filters = []
    for item in items:
        key, sep, pattern = item.partition("=")
        if not sep or not key:
            raise UserError(f"filter '{item}' is not KEY=PATTERN (e.g. norm.name=dyt, 'backbone.name=vit_*')")
        filters.append((key, pattern))
    return filters


def baseline_group(baseline: tuple[str, str], keys: list[str], entries: list[Entry]) -> tuple[str, str]:
    """``--baseline KEY=VALUE`` as (KEY, the one value of KEY among the groups that VALUE names, fnmatch as
    the filters); naming none or several is one line listing the values there are."""
    key, pattern = baseline
    if key not in keys:
        raise UserError(f"--baseline {key}={pattern}: {key} is not one of the groups' keys "
                        f"({', '.join(keys)}); add it to --group-by")
    values = sorted({str(e.labels[key]) for e in entries})
    named = [v for v in values if fnmatch.fnmatchcase(v, pattern)]
    if len(named) != 1:
        raise UserError(f"--baseline {key}={pattern} names {'several' if named else 'none'} of the groups' "
                        f"{key} values ({', '.join(named or values)}): name one, e.g. "
                        f"--baseline {key}={(named or values)[0]}")
    return key, named[0]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="normexp compare", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("filters", nargs="*", help="KEY=PATTERN on the run's config (fnmatch); with --table "
                        "also hydra.searchpath=[file://<dir>] and plugins=[...] as the table ran with")
    parser.add_argument("--root", type=Path, default=None, help="output root (default: $NORMEXP_OUTPUT_DIR "
                        "or outputs)")
    parser.add_argument("--table", default=None, help="only the runs of this table, grouped by its rows")
    parser.add_argument("--scale", default=DEFAULT_SCALE,
                        help=f"with --table: the scale (default {DEFAULT_SCALE})")
    parser.add_argument("--seeds", default=None, help="with --table: e.g. 0,1,2 (default: the scale's)")
    parser.add_argument("--tag", action="append", default=[], help="keep runs with this W&B tag (repeatable)")
    parser.add_argument("--group-by", default=None, help="comma-separated config paths "
                        "(default: backbone.name,norm.name; with --table its row labels)")
    parser.add_argument("--metrics", default=None, help="comma-separated (default: val/top1,val/top5; "
                        "with --table its columns)")
    parser.add_argument("--baseline", default=None, metavar="KEY=VALUE", help="add each metric's delta "
                        "against the group whose KEY (a group-by path) is VALUE, e.g. norm.name=ln: paired "
                        "by seed where the seeds agree, else Welch's, with its 95 %% interval")
    parser.add_argument("--sort", choices=("rows", "started"), default="rows", help="the groups in the "
                        "table's (or the records') order, or by their first run's start (started_at)")
    parser.add_argument("--format", choices=("md", "csv"), default="md")
    args = parser.parse_args(argv)
    try:
        table_settings = [item for item in args.filters if is_table_setting(item)]
        if table_settings and not args.table:
            raise UserError(f"{table_settings[0]}: where a table is and what it ran with, only with --table")
        filters = parse_filters([item for item in args.filters if not is_table_setting(item)])
        baseline = parse_filters([args.baseline])[0] if args.baseline else None
        group_by = args.group_by.split(",") if args.group_by else None
        if args.table:
            from .tables.cli import parse_seeds

            seeds = parse_seeds(args.seeds)
            entries, metrics, keys = entries_from_table(args.table, args.scale, seeds, group_by, args.root,
                                                        table_settings)
        else:
            keys = group_by or ["backbone.name", "norm.name"]
            entries, metrics = entries_from_records(args.root or output_root(), keys), []
        if args.metrics or not metrics:
            metrics = [metric_spec(m) for m in (args.metrics or "val/top1,val/top5").split(",")]
        entries = [e for e in entries if matches(e.config, filters, args.tag)]
        if not entries:
            raise UserError("no run records match: check --root, the filters and the tags")
        if baseline is not None:
            baseline = baseline_group(baseline, keys, entries)
        if args.sort == "started":
            entries.sort(key=lambda e: e.record.summary.get("started_at") or "")
        lines = summarise(entries, metrics, baseline)
        print(render(lines, keys, metrics, args.format, with_delta=baseline is not None), end="")
        if args.format == "md":
            print("\n" + legend(baseline))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
