"""``normexp table``: run, render and list the paper tables (``python -m normexp.tables`` too).

    normexp table list
    normexp table run dyt_squash --scale smoke [--seeds 0,1,2] [--launcher slurm] [key=value ...]
    normexp table run dtn_vit --scale full --dry-run     # the runs and their key settings, nothing launched
    normexp table render dyt_squash --scale smoke         # re-render from the run records only
    normexp table run mytable plugins=[mynorms] hydra.searchpath=[file://$PWD/configs]   # your own table

A table or scale name is looked up in normexp's ``configs/`` and then in the directories of
``hydra.searchpath`` (your own ``configs/table/<id>.yaml``); every override, ``plugins=`` and
``hydra.searchpath=`` included, reaches every run the table launches.

``run`` plans the table (which runs it needs, which are done), launches the missing ones as one Hydra
multirun with the table sweeper (``python -m normexp -m hydra/sweeper=table ...``, so any Hydra launcher can
run them), then renders ``results/tables/<id>.{md,csv,tex,png}`` and ``<id>_curves.png`` from the records
(at a scale other than smoke: in ``results/tables/<scale>/``). It exits 1 when a run failed or is still
missing (after rendering what there is), 0 otherwise -- a diverged run is a result.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from ..errors import UserError, one_line
from ..tracking.lock import live_owner
from .aggregate import aggregate
from .plan import PlannedRun, TablePlan, hydra_composer, is_hydra_override, plan_table
from .render import RESULTS_DIR, to_markdown, write_table
from .spec import (
    DEFAULT_SCALE,
    distinct_seeds,
    list_scales,
    list_tables,
    load_scale,
    load_table,
    searchpath_of,
)
from .sweep import print_plan

WAIT_POLL_S = 5.0


def parse_seeds(text: str | None) -> tuple[int, ...] | None:
    """``--seeds 0,1,2`` as distinct integers (None: the scale's)."""
    if not text:
        return None
    try:
        seeds = tuple(int(s) for s in text.replace(" ", "").split(",") if s)
    except ValueError:
        raise UserError(f"--seeds takes comma-separated integers, e.g. 0,1,2; got '{text}'") from None
    return distinct_seeds(seeds, "--seeds")


def make_plan(table: str, scale: str, seeds: tuple[int, ...] | None, extra: list[str],
              root: Path | None = None) -> TablePlan:
    searchpath = searchpath_of(extra)  # a user's own tables and scales: hydra.searchpath=[file://<dir>]
    spec, scale_spec = load_table(table, searchpath), load_scale(scale, searchpath)
    hydra_overrides = [o for o in extra if is_hydra_override(o)]  # Hydra's settings: how every job composes
    with hydra_composer(hydra_overrides) as compose:
        return plan_table(spec, scale_spec, seeds, compose, root=root,
                          extra=[o for o in extra if not is_hydra_override(o)])


def sweep_command(table: str, scale: str, seeds: tuple[int, ...] | None, launcher: str | None,
                  extra: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "normexp", "-m", "hydra/sweeper=table", f"hydra.sweeper.table={table}",
           f"hydra.sweeper.scale={scale}"]
    if seeds:
        cmd.append(f"hydra.sweeper.seeds=[{','.join(map(str, seeds))}]")
    if launcher:
        cmd.append(f"launcher={launcher}")
    return cmd + extra


def render(plan: TablePlan, out: Path) -> int:
    result = aggregate(plan)
    paths = write_table(result, out)
    print(to_markdown(result))
    print("wrote " + ", ".join(str(p) for p in paths))
    unfinished = [r for r in plan.runs if not r.done]
    if unfinished:
        print(f"{len(unfinished)} run(s) without a result: "
              + "; ".join(f"{r.dir_name} ({r.status})" for r in unfinished), file=sys.stderr)
        return 1
    return 0


def wait_for(runs: list[PlannedRun], poll_s: float = WAIT_POLL_S) -> None:
    """Until no live process holds any of ``runs`` (another planner's, or a SLURM job's)."""
    print(f"waiting for {len(runs)} run(s) running in other processes: "
          + "; ".join(f"{r.dir_name} ({r.owner()})" for r in runs), flush=True)
    while any(r.record is not None and live_owner(r.record.dir) is not None for r in runs):
        time.sleep(poll_s)


def cmd_run(args: argparse.Namespace) -> int:
    """Launch what the table still needs, wait for its runs that other processes are running, render.

    Two planners on one output root share the work: each job claims its run (``run.lock``) before it
    trains, a run another process holds is skipped and waited for, and one whose owner died is launched
    again (it resumes from its checkpoint). Runs that start from another table's runs (``key=table:<id>``)
    wait for them: that table is run first (once per call), then this one's plan is made again."""
    start = time.perf_counter()
    plan = make_plan(args.table, args.scale, args.seeds, args.overrides)
    if args.dry_run:
        print_plan(plan, dry_run=True)
        return 0
    launched: set[str] = set()
    first: set[str] = set()  # tables whose runs this one's start from, run first
    while True:
        todo = [r for r in plan.to_run() if r.run_id not in launched]
        busy = plan.busy()
        needed = sorted({r.needs for r in plan.blocked() if r.needs} - first)
        if todo:
            launched |= {r.run_id for r in todo}
            cmd = sweep_command(args.table, args.scale, args.seeds, args.launcher, args.overrides)
            print("$ " + " ".join(cmd[1:]), flush=True)
            subprocess.run(cmd, check=False)  # failures are in the records; the table says which
        elif busy:
            wait_for(busy)
        elif needed:  # its runs start from another table's that have no result yet: that table first
            for table in needed:
                print(f"table {plan.spec.id}: runs start from table {table}'s, which have no result yet: "
                      "running that table first", flush=True)
                cmd_run(argparse.Namespace(**{**vars(args), "table": table}))
            first |= set(needed)
        else:
            break
        if plan.blocked():  # the run a blocked one starts from may have its result now: plan again
            plan = make_plan(args.table, args.scale, args.seeds, args.overrides)
        else:
            plan.refresh()
    if not launched:
        print_plan(plan, dry_run=False)
    status = render(plan, args.out)
    print(f"table {plan.spec.id} at scale {plan.scale.name}: {time.perf_counter() - start:.0f} s wall time")
    return status


def cmd_render(args: argparse.Namespace) -> int:
    return render(make_plan(args.table, args.scale, args.seeds, args.overrides), args.out)


def cmd_list(args: argparse.Namespace) -> int:
    searchpath = searchpath_of(args.overrides)
    for table in list_tables(searchpath):
        spec = load_table(table, searchpath)
        print(f"{table:16s} {spec.title}  [{spec.source or 'ours'}]")
    print(f"\nscales: {', '.join(list_scales(searchpath))}")
    return 0


def planner_cli(prog: str, description: str, item: str, out: Path, list_func: Callable[..., int],
                run_func: Callable[..., int], render_func: Callable[..., int]) -> argparse.ArgumentParser:
    """The command line of ``normexp table`` and ``normexp figure``: ``list``, then ``run`` / ``render`` of
    one ``item`` (a spec id under ``configs/<item>/`` or a spec file) at a scale."""
    parser = argparse.ArgumentParser(prog=prog, description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    listing = sub.add_parser("list", help=f"the {item}s and scales")
    listing.add_argument("overrides", nargs="*", help="hydra.searchpath=[file://<dir>/configs]: theirs too")
    listing.set_defaults(func=list_func)
    for name, func, what in (("run", run_func, f"run what a {item} still needs, then render it"),
                             ("render", render_func, f"render a {item} from its run records")):
        p = sub.add_parser(name, help=what)
        p.add_argument(item, help=f"a {item} id (configs/{item}/<id>.yaml) or a {item} spec file")
        p.add_argument("--scale", default=DEFAULT_SCALE, help="a scale (configs/scale/<name>.yaml) or a file")
        p.add_argument("--seeds", type=parse_seeds, default=None, help="e.g. 0,1,2 (default: the scale's)")
        p.add_argument("--out", type=Path, default=out, help=f"where the {item} files go")
        p.add_argument("overrides", nargs="*", help="Hydra overrides for every run (part of its identity)")
        p.set_defaults(func=func)
        if name == "run":
            p.add_argument("--launcher", default=None,
                           help="configs/launcher/: slurm, submitit_local (default: local, in this process)")
            p.add_argument("--dry-run", action="store_true", help="print the runs and their settings only")
    return parser


def run_cli(parser: argparse.ArgumentParser, argv: list[str] | None) -> None:
    """Parse ``argv`` (overrides may follow the options) and run its command; a UserError is one line,
    exit code 2."""
    try:
        args, unknown = parser.parse_known_args(argv)  # an option's parser (--seeds) raises UserError
        args.overrides += [u for u in unknown if "=" in u and not u.startswith("-")]
        unknown = [u for u in unknown if u not in args.overrides]
        if unknown:
            parser.error(f"unrecognized arguments: {' '.join(unknown)}")
        sys.exit(args.func(args))
    except UserError as e:
        print(f"error: {one_line(e)}", file=sys.stderr)
        sys.exit(2)


def main(argv: list[str] | None = None) -> None:
    run_cli(planner_cli("normexp table", __doc__, "table", RESULTS_DIR / "tables", cmd_list, cmd_run,
                        cmd_render), argv)


if __name__ == "__main__":
    main()
