"""``python -m normexp [group=option ...] [key=value ...]``: compose the config, then run it."""

from __future__ import annotations

import logging
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from . import CONFIG_DIR
from .errors import UserError

log = logging.getLogger("normexp")


@hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name="train")
def main(cfg: DictConfig) -> float | None:
    from .run import run  # heavy imports after Hydra has parsed the command line (fast --help/--cfg)

    run_dir = HydraConfig.get().runtime.output_dir
    try:
        summary = run(cfg, run_dir)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    best = summary["metrics"].get("best", {})
    log.info("run record: %s", run_dir)
    print(f"run record: {run_dir}")
    metric = cfg.trainer.get("best_metric") if "trainer" in cfg else None
    if metric and metric in best:
        print(f"best {metric}: {best[metric]:.2f} (epoch {best['epoch']})")
        return float(best[metric])  # returned to Hydra sweepers
    return None


if __name__ == "__main__":
    main()
