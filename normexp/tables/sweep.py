"""What the table sweeper does (``hydra/sweeper=table``): plan, skip what is done, launch the rest, report."""

from __future__ import annotations

from typing import Any

from ..errors import UserError, one_line
from ..tasks import get_task
from ..tracking.records import DONE, load_record
from .plan import PlannedRun, TablePlan, plan_table
from .spec import get_path, load_scale, load_table


def key_settings(config: dict[str, Any]) -> dict[str, Any]:
    """The settings that tell two recipes apart, as a dry run prints them."""
    t, d = config.get("trainer", {}), config.get("data", {})
    lr = t.get("lr")
    if t.get("lr_base_size"):
        lr = f"{lr} x batch/{t['lr_base_size']}"
    if t.get("lr_factor", 1.0) != 1.0:
        lr = f"{lr} x {t['lr_factor']}"
    sched = t.get("sched")
    if sched == "step" and t.get("decay_epochs"):
        sched = f"step x{t.get('decay_rate')} every {t['decay_epochs']} epochs"
    elif sched == "multistep" and t.get("decay_milestones"):
        sched = f"multistep x{t.get('decay_rate')} at {list(t['decay_milestones'])}"
    wd = t.get("weight_decay")
    if wd and t.get("decay_norm_and_bias"):
        wd = f"{wd} (every parameter)"
    settings = {
        "task": get_path(config, "task.name"),
        "backbone": get_path(config, "backbone.name"),
        "norm": get_path(config, "norm.name"),
        "data": d.get("name"),
        "root": d.get("root"),
        "img": d.get("img_size"),
        "batch": d.get("batch_size"),
        "global_batch": t.get("global_batch"),
        "epochs": t.get("epochs"),
        "opt": t.get("opt"),
        "lr": lr,
        "layer_decay": t.get("layer_decay"),
        "wd": wd,
        "warmup": t.get("warmup_iters") and f"{t['warmup_iters']} it" or t.get("warmup_epochs"),
        "sched": sched,
        "drop_path": get_path(config, "backbone.drop_path_rate"),
        "mixup/cutmix": f"{get_path(t, 'mixup.mixup_alpha')}/{get_path(t, 'mixup.cutmix_alpha')}",
        "smoothing": t.get("smoothing"),
        "ema": get_path(t, "ema.decay") if get_path(t, "ema.enabled") else False,
        "clip": t.get("clip_grad"),
        "amp": t.get("amp"),
    }
    task = get_task(settings["task"])
    if task.settings is not None:
        settings.update(task.settings(config))
    return {k: v for k, v in settings.items() if v is not None}


def describe(plan: TablePlan, run: PlannedRun) -> str:
    rows = sorted({" / ".join(plan.spec.display(k, v) for k, v in p.labels.items()) for p in run.points})
    seeds = sorted({p.seed for p in run.points})
    best_of = plan.spec.best_of  # the rows' sweep: which of its values
    swept = f", {plan.spec.header(best_of.key)} {run.points[0].choice}" if best_of else ""
    return f"{'; '.join(rows)} (seed {', '.join(map(str, seeds))}{swept})"


def print_plan(plan: TablePlan, dry_run: bool) -> None:
    spec, scale = plan.spec, plan.scale
    done = [r for r in plan.runs if r.done]
    todo, blocked, busy = plan.to_run(), plan.blocked(), plan.busy()
    damaged = plan.damaged()
    print(f"table {spec.id} at scale {scale.name}: {len(plan.points)} points, {len(plan.runs)} distinct "
          f"runs; {len(done)} done (skipped), {len(todo)} to run, {len(blocked)} blocked"
          + (f", {len(busy)} running elsewhere" if busy else "")
          + (f", {len(damaged)} damaged" if damaged else ""), flush=True)
    for run in done:
        where = (f"at {run.record.dir}" if run.record else
                 f"(pre-training {run.source_diverged}: nothing to start from)")
        print(f"  skip  {describe(plan, run)}: {run.status} {where}")
    for run in busy:
        print(f"  busy  {describe(plan, run)}: running in {run.owner()}")
    for run in blocked:
        print(f"  wait  {describe(plan, run)}: {run.blocked}")
    for run in damaged:
        record = run.record
        print(f"  damaged {describe(plan, run)}: {record.dir}: {record.damage} -- repair it, or move the "
              "directory away to run it again")
    for run in todo:
        why = "" if run.status == "missing" else f" (was {run.status}: re-run)"
        print(f"  run   {describe(plan, run)}{why}")
        if dry_run:
            print("        " + " ".join(run.overrides))
            print("        " + "  ".join(f"{k}={v}" for k, v in key_settings(run.config).items()))
    print(flush=True)


def run_table_sweep(sweeper: Any, arguments: list[str]) -> list[Any]:
    """Plan the table, launch the runs it still needs through the configured launcher, report each.

    Each run goes to the directory its identity names, where the next planning looks for it. Command-line
    overrides apply to every run (and so are part of each run's identity); sweeps there are refused: the
    table spec defines the grid.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser

    if any(o.is_sweep_override() for o in OverridesParser.create().parse_overrides(arguments)):
        raise UserError("a table sweep takes no sweeps on the command line (the table spec defines the "
                        f"grid): {' '.join(arguments)}")
    searchpath = tuple(sweeper.config.hydra.searchpath or ())  # hydra.searchpath=: a user's own specs
    spec, scale = load_table(sweeper.table, searchpath), load_scale(sweeper.scale, searchpath)
    plan = plan_table(spec, scale, sweeper.seeds, sweeper.compose, extra=arguments)
    print_plan(plan, sweeper.dry_run)
    todo = plan.to_run()
    if sweeper.dry_run or not todo:
        return []
    returns = sweeper.launcher.launch([plan.job_overrides(run) for run in todo], initial_job_idx=0)
    print(f"table {spec.id} at scale {scale.name}: launched {len(todo)} run(s)")
    print_launched(plan, todo, returns)
    return [returns]


def print_launched(plan: TablePlan, runs: list[PlannedRun], returns: list[Any]) -> None:
    """A line per launched run: the status its record says (``damaged`` if it does not read back, ``no
    record``) and, for a job that ended without a result, why -- as the job reported it, in one line."""
    for run, job in zip(runs, returns, strict=False):
        record = run.dir
        status = load_record(record).status if (record / "summary.json").is_file() else "no record"
        error = getattr(job, "_return_value", None)
        why = f" ({one_line(error)})" if status not in DONE and isinstance(error, BaseException) else ""
        print(f"  {status:9s} {describe(plan, run)}: {record}{why}")
    print(flush=True)
