"""W&B mirror of a run record (offline by default: no account, no network; ``wandb sync`` later)."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class WandbMirror:
    """Logs every record row to W&B; the W&B summary mirrors ``summary.json``."""

    def __init__(self, cfg: Any, run_dir: Path, config: dict[str, Any], name: str, tags: list[str]) -> None:
        import wandb  # imported here: runs with logger=none never pay for it

        self._wandb = wandb
        self.run = wandb.init(
            project=cfg.project,
            entity=cfg.get("entity"),
            group=cfg.get("group"),
            job_type=cfg.get("job_type"),
            tags=list(dict.fromkeys(tags)),  # unique, in order
            name=name,
            config=config,
            dir=str(run_dir),
            mode=cfg.mode,
            # one W&B run per run directory: a resumed (or requeued) run continues its W&B run
            id=cfg.get("id") or hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:16],
            resume="allow",
            settings=wandb.Settings(silent=True, console="off"),
        )
        self.dir = Path(self.run.dir).parent  # .../wandb/offline-run-<date>-<id>
        if cfg.mode == "offline":
            log.info("W&B offline run: %s (upload with `wandb sync %s`)", self.dir, self.dir)

    def log(self, row: dict[str, Any]) -> None:
        step = row.get("step")
        self.run.log({k: v for k, v in row.items() if k != "step" and v is not None}, step=step)

    def log_image(self, key: str, path: Path, step: int) -> None:
        self.run.log({key: self._wandb.Image(str(path))}, step=step)

    def finish(self, summary: dict[str, Any]) -> None:
        flat = {}
        for key, value in summary.items():
            if key == "metrics":
                for kind, metrics in value.items():
                    flat.update({f"{kind}/{metric}": v for metric, v in metrics.items()})
            else:
                flat[key] = value
        self.run.summary.update(flat)  # one update record, not one per key
        self.run.finish(exit_code=0 if summary.get("status") == "completed" else 1)
