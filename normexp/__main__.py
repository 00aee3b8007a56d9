"""``normexp [group=option ...] [key=value ...]``: compose the config, then run it (a Hydra app).

``normexp <command> ...`` runs one of the tools instead: ``table`` (paper tables), ``compare`` (compare run
records), ``dashboard`` (MLflow's UI over every record), ``sync`` (upload offline W&B runs), ``analyze`` (look
inside a trained run), ``figure`` (the papers' figures from their runs);
``normexp <command> --help`` says more.
"""

from __future__ import annotations

import logging
import os
import sys
from datetime import datetime

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from . import CONFIG_DIR
from .errors import UserError, one_line

log = logging.getLogger("normexp")

# ``normexp <command>``: tools that are not training runs (a Hydra override always contains '=').
COMMANDS = {"table": "normexp.tables.cli", "compare": "normexp.compare", "dashboard": "normexp.dashboard",
            "sync": "normexp.sync", "analyze": "normexp.analysis.cli", "figure": "normexp.analysis.figures"}


@hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name="train")
def run_app(cfg: DictConfig) -> float | None:
    from .engine.trainer import Interrupted
    from .run import run  # heavy imports after Hydra has parsed the command line (fast --help/--cfg)

    hydra_cfg = HydraConfig.get()
    run_dir = hydra_cfg.runtime.output_dir
    try:
        summary = run(cfg, run_dir)
    except UserError as e:
        print(f"error: {one_line(e)}", file=sys.stderr)
        if hydra_cfg.mode == RunMode.MULTIRUN:
            raise  # the sweep records this job as failed and carries on with the others
        sys.exit(2)
    except Interrupted as e:
        print(f"interrupted: {e}", file=sys.stderr)
        sys.exit(128 + e.signum)
    log.info("run record: %s", run_dir)
    print(f"run record: {run_dir}")
    if summary["status"] == "diverged":
        print(f"{summary['error']} -- recorded as a result (status 'diverged')")
        return None
    best = summary["metrics"].get("best", {})
    metric = cfg.trainer.get("best_metric") if "trainer" in cfg else None
    if metric and metric in best:
        print(f"best {metric}: {best[metric]:.2f} (epoch {best['epoch']})")
        return float(best[metric])  # returned to Hydra sweepers
    return None


def join_job() -> None:
    """Before Hydra names the run directory: every process of a job must name the same one.

    The directory's time stamp comes from ``NORMEXP_RUN_STAMP`` (train.yaml), set here once and inherited
    by what this process launches -- SLURM jobs of a sweep, and the same jobs when they are requeued, so a
    requeued job finds its checkpoint. Under torchrun, process 0's stamp is broadcast to the others, whose
    Hydra writes no files there and logs warnings only.
    """
    os.environ.setdefault("NORMEXP_RUN_STAMP", datetime.now().strftime("%Y-%m-%d/%H-%M-%S"))
    if "RANK" not in os.environ or int(os.environ.get("WORLD_SIZE", "1")) < 2:
        return
    from .engine import distributed

    cpu = any(arg in ("trainer.device=cpu", "++trainer.device=cpu") for arg in sys.argv[1:])
    world = distributed.init_distributed("cpu" if cpu else "auto")
    os.environ["NORMEXP_RUN_STAMP"] = distributed.broadcast_object(os.environ["NORMEXP_RUN_STAMP"])
    if not world.is_main:
        sys.argv += ["hydra.output_subdir=null", "hydra/job_logging=stdout",
                     "hydra.job_logging.root.level=WARNING"]


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in COMMANDS:
        import importlib

        command = sys.argv.pop(1)
        sys.argv[0] = f"normexp {command}"
        importlib.import_module(COMMANDS[command]).main()
        return
    join_job()
    run_app()


if __name__ == "__main__":
    main()
