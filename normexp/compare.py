"""``normexp compare``: compare logged runs from their local records -- no account, no network.

    normexp compare                                         # every run under outputs/, by backbone and norm
    normexp compare norm.name=dyt "backbone.name=vit_*" --metrics val/top1,val/top5,params
    normexp compare --group-by backbone.name,norm.name,norm.squash --tag classification --format csv
    normexp compare --table dyt_squash --scale smoke        # the runs of a table, grouped by its rows

Reads every ``summary.json`` (and its ``config.yaml``) under ``--root`` (default ``$NORMEXP_OUTPUT_DIR`` or
``outputs``), keeps the runs that match every ``KEY=PATTERN`` filter (fnmatch on the config value at a dotted
path) and every ``--tag`` (the W&B tags: backbone, norm, task, data and the config's ``tags``), groups them by
the ``--group-by`` config paths and prints each metric as mean +- std (n) over the completed runs of a group,
with the runs that diverged or failed counted beside. Metrics: summary paths (``params``,
``metrics.best.val/top1``), or a bare name for the final evaluation (``val/top1`` means
``metrics.final.val/top1``). With ``--table`` the runs are the table's (its plan at ``--scale``), grouped by
its row labels, and the default metrics are its columns: the numbers the rendered table shows.
"""

from __future__ import annotations

import argparse
import csv
import fnmatch
import io
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import UserError
from .tables.spec import Metric, get_path
from .tracking.records import Record, index_records, output_root, warn_damaged


@dataclass
class Entry:
    """One run as compare sees it: its group labels, its record and config."""

    labels: dict[str, Any]
    record: Record
    config: dict[str, Any]


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
        entries.append(Entry({k: get_path(record.config, k) for k in group_by}, record, record.config))
    return entries


def entries_from_table(table: str, scale: str, seeds: tuple[int, ...] | None, group_by: list[str] | None,
                       root: Path | None) -> tuple[list[Entry], list[Metric], list[str]]:
    from .tables.cli import make_plan

    plan = make_plan(table, scale, seeds, [], root)
    keys = group_by or list(plan.spec.label_keys)
    entries = []
    for run in plan.damaged():  # skipped, named
        warn_damaged(run.record.dir, run.record.damage)
    for point, run in plan.points:
        record = run.record
        if record is None or record.damage is not None:
            continue
        labels = {k: point.labels[k] if k in point.labels else get_path(record.config, k) for k in keys}
        entries.append(Entry(labels, record, record.config))
    return entries, list(plan.spec.metrics), keys


def summarise(entries: list[Entry], metrics: list[Metric]) -> list[dict[str, Any]]:
    """One line per group: the labels, n runs by status, and mean/std/n per metric over completed runs."""
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
            values = [v for e in completed if (v := metric_value(metric, e.record.summary)) is not None]
            line[metric.key] = (statistics.fmean(values) if values else None,
                                statistics.stdev(values) if len(values) > 1 else None, len(values))
        lines.append(line)
    return lines


def render(lines: list[dict[str, Any]], keys: list[str], metrics: list[Metric], fmt: str) -> str:
    if fmt == "csv":
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow([*keys, "runs", "not completed",
                         *[f"{m.key}_{s}" for m in metrics for s in ("mean", "std", "n")]])
        for line in lines:
            writer.writerow([*[line[k] for k in keys], line["runs"], line["not completed"],
                             *[("" if v is None else v) for m in metrics for v in line[m.key]]])
        return out.getvalue()
    header = [*keys, "runs", *[m.label for m in metrics], "not completed"]
    rows = []
    for line in lines:
        cells = [str(line[k]) for k in keys] + [str(line["runs"])]
        for m in metrics:
            mean, std, n = line[m.key]
            cells.append("—" if mean is None else
                         f"{mean:{m.fmt}}" + (f" ± {std:{m.fmt}}" if std is not None else "") + f" ({n})")
        cells.append(line["not completed"] or "")
        rows.append(cells)
    text = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(text + ["| " + " | ".join(r) + " |" for r in rows]) + "\n"


def parse_filters(items: list[str]) -> list[tuple[str, str]]:
    filters = []
    for item in items:
        key, sep, pattern = item.partition("=")
        if not sep or not key:
            raise UserError(f"filter '{item}' is not KEY=PATTERN (e.g. norm.name=dyt, 'backbone.name=vit_*')")
        filters.append((key, pattern))
    return filters


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="normexp compare", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("filters", nargs="*", help="KEY=PATTERN on the run's config (fnmatch)")
    parser.add_argument("--root", type=Path, default=None, help="output root (default: $NORMEXP_OUTPUT_DIR "
                        "or outputs)")
    parser.add_argument("--table", default=None, help="only the runs of this table, grouped by its rows")
    parser.add_argument("--scale", default="smoke", help="with --table: the scale (default smoke)")
    parser.add_argument("--seeds", default=None, help="with --table: e.g. 0,1,2 (default: the scale's)")
    parser.add_argument("--tag", action="append", default=[], help="keep runs with this W&B tag (repeatable)")
    parser.add_argument("--group-by", default=None, help="comma-separated config paths "
                        "(default: backbone.name,norm.name; with --table its row labels)")
    parser.add_argument("--metrics", default=None, help="comma-separated (default: val/top1,val/top5; "
                        "with --table its columns)")
    parser.add_argument("--format", choices=("md", "csv"), default="md")
    args = parser.parse_args(argv)
    try:
        filters = parse_filters(args.filters)
        group_by = args.group_by.split(",") if args.group_by else None
        if args.table:
            from .tables.cli import parse_seeds

            seeds = parse_seeds(args.seeds)
            entries, metrics, keys = entries_from_table(args.table, args.scale, seeds, group_by, args.root)
        else:
            keys = group_by or ["backbone.name", "norm.name"]
            entries, metrics = entries_from_records(args.root or output_root(), keys), []
        if args.metrics or not metrics:
            metrics = [metric_spec(m) for m in (args.metrics or "val/top1,val/top5").split(",")]
        entries = [e for e in entries if matches(e.config, filters, args.tag)]
        if not entries:
            raise UserError("no run records match: check --root, the filters and the tags")
        print(render(summarise(entries, metrics), keys, metrics, args.format), end="")
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
