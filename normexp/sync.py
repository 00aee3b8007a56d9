"""``normexp sync``: upload the W&B runs that were logged offline (the default), with ``wandb sync``.

    normexp sync --dry-run        # list the offline runs not uploaded yet
    normexp sync                  # upload them (needs `wandb login` and network)

Each run directory holds its W&B run under ``wandb/offline-run-*``; ``wandb sync`` marks an uploaded one
with a ``.synced`` file, so running this again uploads only what is new.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from .tracking.records import output_root


def offline_runs(root: Path) -> list[Path]:
    """W&B offline runs under ``root`` that ``wandb sync`` has not uploaded."""
    return [run for run in sorted(root.glob("**/wandb/offline-run-*")) if run.is_dir()
            and not any(run.glob("*.wandb.synced"))]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="normexp sync", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, default=None, help="output root (default: $NORMEXP_OUTPUT_DIR "
                        "or outputs)")
    parser.add_argument("--dry-run", action="store_true", help="list, upload nothing")
    args = parser.parse_args(argv)
    runs = offline_runs(args.root or output_root())
    print(f"{len(runs)} offline W&B run(s) to upload")
    for run in runs:
        print(f"  {run}")
    if args.dry_run or not runs:
        return
    failed = [run for run in runs
              if subprocess.run([sys.executable, "-m", "wandb", "sync", str(run)], check=False).returncode]
    if failed:
        print(f"error: {len(failed)} run(s) did not upload (is `wandb login` done, is the network there?)",
              file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
