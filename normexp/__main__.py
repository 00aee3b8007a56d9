"""``normexp [group=option ...] [key=value ...]``: compose the config (Hydra), then run it (``normexp.run``).

``normexp <command> ...`` runs a tool instead: ``table``, ``compare``, ``dashboard``, ``sync``, ``analyze``,
``figure``, ``export`` (``normexp <command> --help``). A mistake on the command line is one ``error:`` line,
exit 2.
"""

from __future__ import annotations

import importlib
import os
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from hydra.types import RunMode
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from . import CONFIG_DIR
from . import command_line as said
from .errors import Interrupted, UserError, one_line

COMMANDS = {"table": "normexp.tables.cli", "compare": "normexp.compare", "dashboard": "normexp.dashboard",
            "sync": "normexp.sync", "analyze": "normexp.analysis.cli", "figure": "normexp.analysis.figures",
            "export": "normexp.export"}
composed = False  # from here on, an exception is the run's, not the command line's


@hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name="train")
def run_app(cfg: DictConfig) -> float | None:
    from .run import Outcome, run  # the run's imports once Hydra has composed (not for --cfg, --help)

    global composed
    composed, hydra_cfg, outcome = True, HydraConfig.get(), Outcome()
    try:
        summary = run(cfg, outcome=outcome, beside=said.hydra_files(cfg, hydra_cfg))
    except (UserError, OSError) as e:
        error = said.user_error(e)
        if error is None:  # not the user's to fix
            raise
        print(f"error: {one_line(error)}", file=sys.stderr)
        if hydra_cfg.mode == RunMode.MULTIRUN:
            error.reported = True  # type: ignore[attr-defined]
            raise error from e  # the sweep records this job as failed and carries on with the others
        sys.exit(2)
    except (Interrupted, KeyboardInterrupt) as e:
        sys.exit(said.interrupted(e, cfg, outcome.run_dir))
    return said.report(cfg, summary, outcome.run_dir, outcome.started) if outcome.run_dir else None


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in COMMANDS:
        command = sys.argv.pop(1)
        sys.argv[0] = f"normexp {command}"
        importlib.import_module(COMMANDS[command]).main()
        return
    own_full_error = "HYDRA_FULL_ERROR" in os.environ
    os.environ.setdefault("HYDRA_FULL_ERROR", "1")  # Hydra's errors reach us whole: one line each, below
    try:
        said.refuse_directory_overrides(sys.argv[1:])
        from .code_defaults import register  # the code's defaults the yaml files compose (imports the models)

        register()
        run_app()
    except (HydraException, OmegaConfBaseException) as e:  # (MissingConfigException is an OSError too)
        if own_full_error or composed:
            raise
        print(f"error: {said.hydra_error_line(e)}", file=sys.stderr)
        sys.exit(2)
    except (UserError, OSError) as e:  # a sweep's job (reported by it), or Hydra making a run's directory
        error = said.user_error(e)
        if error is None:
            raise
        if not getattr(error, "reported", False):
            print(f"error: {one_line(error)}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
