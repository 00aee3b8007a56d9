"""``hydra/sweeper=table``: a Hydra sweeper that launches the runs a normexp table still needs.

    python -m normexp -m hydra/sweeper=table hydra.sweeper.table=dyt_squash hydra.sweeper.scale=smoke

Unlike the basic sweeper, whose jobs are the product of comma lists, this one takes its jobs from a table
spec (``configs/table/<id>.yaml``): every block x seed, mapped onto the scale, composed and identified by its
resolved config; points whose run already has a ``completed`` or ``diverged`` record are skipped (and
listed), the others -- missing, failed or interrupted -- are handed to whichever Hydra launcher is
configured (basic, joblib, submitit/SLURM). A failed job never stops the others. ``dry_run=true`` prints the
runs and their key settings without launching anything. The logic lives in ``normexp.tables``; this module
only adapts it to Hydra's plugin interface (Hydra finds plugins in the ``hydra_plugins`` package; it loads
them without registering the module, so no ``from __future__ import annotations`` here: dataclasses need
real annotations).
"""


from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.core.plugins import Plugins
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, open_dict, read_write


@dataclass
class TableSweeperConf:
    _target_: str = "hydra_plugins.normexp_table_sweeper.table_sweeper.TableSweeper"
    table: str = "???"
    scale: str = "smoke"
    seeds: list[int] = field(default_factory=list)  # empty: the scale's seeds
    dry_run: bool = False


ConfigStore.instance().store(group="hydra/sweeper", name="table", node=TableSweeperConf, provider="normexp")


class TableSweeper(Sweeper):
    def __init__(self, table: str, scale: str = "smoke", seeds: list[int] | None = None,
                 dry_run: bool = False) -> None:
        super().__init__()
        self.table, self.scale, self.dry_run = table, scale, dry_run
        self.seeds = [int(s) for s in seeds] if seeds else None
        self.config: DictConfig | None = None
        self.hydra_context: HydraContext | None = None
        self.launcher: Any = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config, self.hydra_context = config, hydra_context
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config)

    def compose(self, overrides: list[str]) -> DictConfig:
        """A job's config exactly as the launcher will compose it, less the ``hydra`` node."""
        assert self.config is not None and self.hydra_context is not None
        cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
        with read_write(cfg), open_dict(cfg):
            del cfg["hydra"]
        return cfg

    def sweep(self, arguments: list[str]) -> Any:
        from normexp.tables.sweep import run_table_sweep

        return run_table_sweep(self, list(arguments))
