"""``normexp figure``: the papers' figures from our runs, planned like the tables (``make figure-<id>``).

    normexp figure list
    normexp figure run dtn_attention --scale smoke [--seeds 0,1,2] [--launcher slurm] [key=value ...]
    normexp figure run dyt_io --scale full --dry-run      # the runs and their settings only
    normexp figure render dtn_attention --scale smoke      # re-render from the run records only

A figure spec (``configs/figure/<id>.yaml``) says which runs (``blocks``: Hydra sweeps, as a table's), which
analysis (``io``, ``alpha``, ``tokens``, ``attention``, ``activations`` of the trained models, or
``stability``: the runs' outcomes on a grid of two swept settings, ``grid: {x, y, panels}``) and which
layers. Its runs are planned by the table planner, so a run another table or figure already has (the same
resolved config) is reused, not trained again, and missing ones are launched by the table sweeper through
any Hydra launcher (into ``<output root>/tables/<scale>/figure-<id>/``). ``run`` then analyses each row's
run (its first seed) and renders ``results/figures/<id>.png`` with the runs side by side, ``<id>.json``
(the figure, its runs and the numbers) and, per analysis, ``<id>.csv`` / ``<id>_points.csv`` /
``<id>_history.csv``; the figures section of ``results/README.md`` indexes them. Everything is computed
before a file is written. Exit code: 2 for bad input (an unknown figure), 1 when a run the figure needs has
no result (after rendering the others), 0 otherwise.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf

from .. import CONFIG_DIR
from ..errors import UserError, one_line
from ..tables.cli import planner_cli, run_cli, sweep_command
from ..tables.plan import PlannedRun, TablePlan, hydra_composer, plan_table
from ..tables.render import RESULTS_DIR, write_index
from ..tables.spec import Metric, TableSpec, get_path, list_scales, load_scale, searchpath_of
from ..tables.sweep import print_plan
from ..tracking.records import utc_now
from .core import ANALYSES, RunAnalysis, analyse, load_run, select_slots
from .render import (
    LabelledRun,
    alpha_history_rows,
    io_point_rows,
    plot_activations,
    plot_alpha,
    plot_attention,
    plot_io,
    plot_stability,
    plot_tokens,
    write_rows,
)

FIGURE_DIR = CONFIG_DIR / "figure"
FIGURES_BEGIN, FIGURES_END = "<!-- figures:begin -->", "<!-- figures:end -->"
FIGURE_KEYS = {"title", "source", "mirrors", "analysis", "rows", "blocks", "labels", "images", "seed",
               "slots", "max_slots", "token_slot", "color_by", "points", "notes", "grid", "headers"}
KINDS = (*ANALYSES, "stability")  # stability reads the runs' records only: no model is loaded


def list_figures() -> list[str]:
    return sorted(p.stem for p in FIGURE_DIR.glob("*.yaml"))


@dataclass(frozen=True)
class FigureSpec:
    id: str
    title: str
    source: str
    mirrors: str
    analysis: str
    rows: tuple[str, ...]
    blocks: tuple[str, ...]
    labels: dict[str, dict[str, str]] = field(default_factory=dict)
    images: int = 16
    seed: int = 0
    slots: tuple[str, ...] = ()
    max_slots: int | None = None
    token_slot: str | None = None
    color_by: str = "norm"
    points: int = 1000
    notes: str = ""
    grid: dict[str, Any] = field(default_factory=dict)  # stability: {x: key, y: key, panels: [keys]}
    headers: dict[str, str] = field(default_factory=dict)  # a row key's name in words (an axis)

    @property
    def table_id(self) -> str:
        return f"figure-{self.id}"

    def table(self) -> TableSpec:
        """The table the planner sees: the figure's runs, one top-1 column (shown in the figure's titles)."""
        top1 = Metric(key="top1", label="Top-1 (%)",
                      value=("metrics.final.ema/val/top1", "metrics.final.val/top1"), fmt=".1f")
        return TableSpec(id=self.table_id, title=self.title, source=self.source, rows=self.rows,
                         metrics=(top1,), blocks=self.blocks, labels=self.labels)

    def table_yaml(self) -> str:
        """The same table as a spec file, for the table sweeper that launches the runs."""
        top1 = {"key": "top1", "label": "Top-1 (%)",
                "value": ["metrics.final.ema/val/top1", "metrics.final.val/top1"]}
        return yaml.safe_dump({"title": self.title, "source": self.source, "rows": list(self.rows),
                               "metrics": [top1], "blocks": list(self.blocks), "labels": self.labels},
                              sort_keys=False)

    def label(self, labels: dict[str, Any]) -> str:
        return " / ".join(str(self.labels.get(k, {}).get(str(v), v)) for k, v in labels.items())


def load_figure(name: str) -> FigureSpec:
    """``configs/figure/<name>.yaml`` (or the spec file ``name``)."""
    path = Path(name) if name.endswith((".yaml", ".yml")) else FIGURE_DIR / f"{name}.yaml"
    if not path.is_file():
        raise UserError(f"no figure '{path.stem}' ({path}); available: {', '.join(list_figures())}")
    data = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    if not isinstance(data, dict):
        raise UserError(f"{path} is not a mapping")
    unknown = sorted(set(data) - FIGURE_KEYS)
    if unknown:
        raise UserError(f"{path}: unknown key(s) {unknown}; allowed: {sorted(FIGURE_KEYS)}")
    if data.get("analysis") not in KINDS:
        raise UserError(f"{path}: 'analysis' must be one of {', '.join(KINDS)}, got {data.get('analysis')}")
    grid = data.get("grid") or {}
    keys = {grid.get("x"), grid.get("y"), *(grid.get("panels") or [])}
    if data["analysis"] == "stability" and (None in keys or not keys <= set(data.get("rows") or [])):
        raise UserError(f"{path}: a stability figure needs grid: {{x: <row key>, y: <row key>, panels: "
                        "[<row keys>]}, every key one of its rows")
    if not data.get("blocks") or not data.get("rows"):
        raise UserError(f"{path}: a figure needs 'rows' and 'blocks'")
    if data.get("color_by", "norm") not in ("norm", "token", "channel"):
        raise UserError(f"{path}: 'color_by' is norm, token or channel")
    slots = data.get("slots") or ()
    return FigureSpec(
        id=path.stem, title=data.get("title", path.stem), source=data.get("source", ""),
        mirrors=data.get("mirrors", ""), analysis=data["analysis"], rows=tuple(data["rows"]),
        blocks=tuple(data["blocks"]), labels=data.get("labels") or {}, images=int(data.get("images", 16)),
        seed=int(data.get("seed", 0)), slots=(slots,) if isinstance(slots, str) else tuple(slots),
        max_slots=data.get("max_slots"), token_slot=data.get("token_slot"),
        color_by=data.get("color_by", "norm"), points=int(data.get("points", 1000)),
        notes=str(data.get("notes", "")).strip(), grid=grid, headers=data.get("headers") or {})


# ---------------------------------------------------------------- planning and running
def make_plan(spec: FigureSpec, scale: str, seeds: tuple[int, ...] | None, extra: list[str],
              root: Path | None = None) -> TablePlan:
    with hydra_composer() as compose:
        return plan_table(spec.table(), load_scale(scale), seeds, compose, root=root, extra=extra)


def launch(spec: FigureSpec, scale: str, seeds: tuple[int, ...] | None, launcher: str | None,
           extra: list[str]) -> None:
    """The table sweeper over the figure's table, written as a spec file for the sweep's lifetime."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"{spec.table_id}.yaml"
        path.write_text(spec.table_yaml())
        cmd = sweep_command(str(path), scale, seeds, launcher, extra)
        print("$ " + " ".join(cmd[1:]), flush=True)
        subprocess.run(cmd, check=False)  # failures are in the records; the figure says which


@dataclass
class FigureRun:
    label: str
    planned: PlannedRun
    seed: int
    analysis: RunAnalysis | None = None
    problem: str | None = None


def figure_runs(spec: FigureSpec, plan: TablePlan) -> list[FigureRun]:
    """Each row's run of its first seed, in the order of the blocks."""
    rows: dict[str, FigureRun] = {}
    for point, run in plan.points:
        label = spec.label(point.labels)
        if label not in rows or point.seed < rows[label].seed:
            rows[label] = FigureRun(label, run, point.seed)
    return list(rows.values())


def analyse_runs(spec: FigureSpec, runs: list[FigureRun]) -> None:
    """The figure's analysis of every row that has a trained model; why not for the others."""
    for row in runs:
        run = row.planned
        if spec.analysis == "stability":  # the outcome is the result: a diverged run is shown
            if run.record is None or run.status not in ("completed", "diverged"):
                row.problem = f"{row.label}: {run.status}"
            continue
        if run.record is None or run.status != "completed":
            row.problem = f"{row.label}: {run.status}" + (f" ({run.record.dir.name})" if run.record else "")
            continue
        try:
            loaded = load_run(run.record.dir)
            slots = None
            if spec.analysis == "io":
                from ..norms.placement import norm_slot_names

                slots = select_slots(norm_slot_names(loaded.model), list(spec.slots) or None, spec.max_slots)
            row.analysis = analyse(loaded, [spec.analysis], images=spec.images, seed=spec.seed,
                                   io_slots=slots, io_points=spec.points, token_slot=spec.token_slot)
        except UserError as e:
            row.problem = f"{row.label}: {one_line(e)}"


def stability_cells(spec: FigureSpec, plan: TablePlan) -> list[dict[str, Any]]:
    """One cell per row of a stability figure (its first seed): its grid position, status, the step it
    diverged at and its top-1."""
    from ..tables.aggregate import metric_value

    metric = spec.table().metrics[0]
    cells: dict[str, dict[str, Any]] = {}
    for point, run in sorted(plan.points, key=lambda pr: pr[0].seed):
        panel = " / ".join(spec.label({k: point.labels[k]}) for k in spec.grid.get("panels") or [])
        key = spec.label(point.labels)
        if key in cells:
            continue
        summary = run.record.summary if run.record is not None else {}
        x, y = spec.grid["x"], spec.grid["y"]
        cells[key] = {"panel": panel or spec.title, "label": key, x: point.labels[x], y: point.labels[y],
                      "seed": point.seed, "status": run.status,
                      "diverged_step": (summary.get("diverged") or {}).get("step"),
                      "top1": metric_value(metric, summary) if run.status == "completed" else None,
                      "run_as": (run.config.get("backbone") or {}).get("name"), "run_id": run.run_id}
    return list(cells.values())


def chance_level(plan: TablePlan) -> float | None:
    """The top-1 (%) of guessing, 100 / the classes of the runs' data (None: the runs' data differ)."""
    classes = {get_path(run.config, "data.num_classes") for run in plan.runs}
    found = classes.pop() if len(classes) == 1 else None
    return 100 / found if isinstance(found, int) and found > 0 else None


def render_stability(spec: FigureSpec, plan: TablePlan, runs: list[FigureRun], out_dir: Path) -> list[Path]:
    cells = stability_cells(spec, plan)
    members = sorted({str(c["run_as"]) for c in cells})
    caption = (f"scale {plan.scale.name}: {', '.join(members)}; seed {min(c['seed'] for c in cells)}; "
               f"{sum(c['status'] == 'completed' for c in cells)} completed, "
               f"{sum(c['status'] == 'diverged' for c in cells)} diverged of {len(cells)}")
    written = []
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        plot_stability(cells, Path(tmp) / f"{spec.id}.png", spec.grid["x"], spec.grid["y"],
                       title=f"{spec.title} [{plan.scale.name} scale]", caption=caption, names=spec.headers,
                       chance=chance_level(plan))
        record = {"figure": spec.id, "title": spec.title, "source": spec.source, "mirrors": spec.mirrors,
                  "analysis": spec.analysis, "scale": plan.scale.name, "caption": caption,
                  "rendered_at": utc_now(), "runs": [_run_entry(r) for r in runs], "numbers": cells}
        (Path(tmp) / f"{spec.id}.json").write_text(json.dumps(record, indent=1, default=str) + "\n")
        write_rows(Path(tmp) / f"{spec.id}.csv", cells)
        for path in sorted(Path(tmp).iterdir()):
            path.replace(out_dir / path.name)
            written.append(out_dir / path.name)
    update_index(spec, plan, runs, out_dir)
    return written


def render_figure(spec: FigureSpec, plan: TablePlan, runs: list[FigureRun], out_dir: Path) -> list[Path]:
    """Draw the figure and write its numbers: into a temporary directory, then moved into ``out_dir``."""
    if spec.analysis == "stability":
        return render_stability(spec, plan, runs, out_dir)
    shown = [LabelledRun(r.label, r.analysis) for r in runs if r.analysis is not None]
    problems = [r.problem for r in runs if r.problem]
    if not shown:
        raise UserError(f"figure {spec.id}: no run has a trained model to analyse ({'; '.join(problems)})")
    members = sorted({f"{s.analysis.run.backbone} on {s.analysis.run.config['data']['name']} "
                      f"{s.analysis.image_size[0]} px" for s in shown})
    seen = sorted({f"{s.analysis.run.backbone} {s.analysis.inputs}" for s in shown if s.analysis.inputs})
    images = (f"validation image {shown[0].analysis.image_indices[0]}" if spec.analysis == "tokens"
              else f"{spec.images} validation images" + (f" ({'; '.join(seen)})" if seen else ""))
    caption = f"scale {plan.scale.name}: {', '.join(members)}; seed {min(r.seed for r in runs)}; {images}"
    notes = sorted({n for s in shown for ns in s.analysis.notes.values() for n in ns})
    if problems:
        caption += "; not shown: " + "; ".join(problems)
    title = f"{spec.title} [{plan.scale.name} scale]"
    numbers: Any
    extra: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        png = Path(tmp) / f"{spec.id}.png"
        if spec.analysis == "io":
            slots = [[n["slot"] for n in s.analysis.io_numbers or []] for s in shown]
            numbers = plot_io(shown, slots, png, spec.color_by, title=title, caption=caption)
            extra["_points.csv"] = io_point_rows(shown, slots, spec.color_by)
        elif spec.analysis == "alpha":
            shown = [s for s in shown if s.analysis.alpha]
            if not shown:
                raise UserError(f"figure {spec.id}: none of its runs has a DyT layer")
            numbers = plot_alpha(shown, png, title=title, caption=caption)
            extra[".csv"] = numbers
            extra["_history.csv"] = alpha_history_rows(shown)
        elif spec.analysis == "activations":
            numbers = plot_activations(shown, png, title=title, caption=caption)
            extra[".csv"] = numbers
        elif spec.analysis == "tokens":
            numbers = plot_tokens(shown, png, title=title, caption=caption)
        else:
            numbers = plot_attention(shown, png, title=title, caption="; ".join([caption, *notes]))
            extra[".csv"] = numbers
        record = {"figure": spec.id, "title": spec.title, "source": spec.source, "mirrors": spec.mirrors,
                  "analysis": spec.analysis, "scale": plan.scale.name, "caption": caption,
                  "rendered_at": utc_now(), "runs": [_run_entry(r) for r in runs], "notes": notes,
                  "numbers": numbers}
        (Path(tmp) / f"{spec.id}.json").write_text(json.dumps(record, indent=1, default=str) + "\n")
        for suffix, rows in extra.items():
            write_rows(Path(tmp) / f"{spec.id}{suffix}", rows)
        written = []
        for path in sorted(Path(tmp).iterdir()):
            target = out_dir / path.name
            path.replace(target)
            written.append(target)
    update_index(spec, plan, runs, out_dir)
    return written


def _run_entry(row: FigureRun) -> dict[str, Any]:
    record = row.planned.record
    entry: dict[str, Any] = {"label": row.label, "seed": row.seed, "run_id": row.planned.run_id,
                             "status": row.planned.status, "dir": str(record.dir) if record else None}
    if row.analysis is not None:
        run = row.analysis.run
        entry.update(backbone=run.backbone, norm=run.norm, top1=run.top1,
                     weights="EMA" if run.ema else "model",
                     commit=(run.summary.get("git") or {}).get("commit"))
    if row.problem:
        entry["problem"] = row.problem
    return entry


def update_index(spec: FigureSpec, plan: TablePlan, runs: list[FigureRun], out_dir: Path) -> None:
    """``index.json`` beside the figures, and the figures section of ``results/README.md`` built from it."""
    shown = sum(r.analysis is not None or (spec.analysis == "stability" and not r.problem) for r in runs)
    entry = {"title": spec.title, "mirrors": spec.mirrors, "scale": plan.scale.name,
             "runs": f"{shown} of {len(runs)}", "rendered_at": utc_now()}
    write_index(out_dir, spec.id, entry, "Figures", (FIGURES_BEGIN, FIGURES_END),
                "| figure | what | mirrors | scale | runs shown | rendered |",
                lambda fig_id, e: (f"| [{fig_id}](figures/{fig_id}.png) | {e['title']} | {e['mirrors']} | "
                                   f"{e['scale']} | {e['runs']} | {e['rendered_at'][:10]} |"))


# ---------------------------------------------------------------- commands
def cmd_run(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    spec = load_figure(args.figure)
    plan = make_plan(spec, args.scale, args.seeds, args.overrides)
    if args.dry_run:
        print_plan(plan, dry_run=True)
        return 0
    if plan.to_run():
        launch(spec, args.scale, args.seeds, args.launcher, args.overrides)
        plan = make_plan(spec, args.scale, args.seeds, args.overrides)
    else:
        print_plan(plan, dry_run=False)
    status = render(spec, plan, args.out)
    print(f"figure {spec.id} at scale {plan.scale.name}: {time.perf_counter() - start:.0f} s wall time")
    return status


def render(spec: FigureSpec, plan: TablePlan, out: Path) -> int:
    start = time.perf_counter()
    runs = figure_runs(spec, plan)
    analyse_runs(spec, runs)
    out.mkdir(parents=True, exist_ok=True)
    written = render_figure(spec, plan, runs, out)
    print(f"analysed {sum(r.analysis is not None for r in runs)} run(s) and rendered in "
          f"{time.perf_counter() - start:.1f} s")
    print("wrote " + ", ".join(str(p) for p in written))
    missing = [r.problem for r in runs if r.problem]
    if missing:
        print(f"{len(missing)} run(s) not shown: " + "; ".join(missing), file=sys.stderr)
        return 1
    return 0


def cmd_render(args: argparse.Namespace) -> int:
    spec = load_figure(args.figure)
    return render(spec, make_plan(spec, args.scale, args.seeds, args.overrides), args.out)


def cmd_list(args: argparse.Namespace) -> int:
    for name in list_figures():
        spec = load_figure(name)
        print(f"{name:16s} {spec.title}  [{spec.mirrors}]")
    print(f"\nscales: {', '.join(list_scales(searchpath_of(args.overrides)))}")
    return 0


def main(argv: list[str] | None = None) -> None:
    run_cli(planner_cli("normexp figure", __doc__, "figure", RESULTS_DIR / "figures", cmd_list, cmd_run,
                        cmd_render), argv)


if __name__ == "__main__":
    main()
