"""``normexp dashboard`` (``make dashboard``): every local run in MLflow's UI, with no account.

    normexp dashboard                      # import new records into outputs/mlflow/, serve http://127.0.0.1:5000
    normexp dashboard --port 5001 --root /scratch/outputs
    normexp dashboard --no-serve           # import only
    normexp dashboard --store http://tracking.lab:5000   # import into a team's MLflow server instead

Every run record under the output root -- made with any logger or none, tables' runs included -- that is not
in the store yet is imported (keyed by its ``run_id``; a record still ``running`` waits for the next import),
then MLflow's tracking server and UI start on localhost over the store. Importing again adds nothing; the
records are only read. The UI compares runs side by side, groups and charts them (README: "Dashboards").
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import yaml

from .errors import UserError
from .tracking.records import Record, index_records, output_root


def finished_records(records: Iterable[Record]) -> Iterator[tuple[Path, dict[str, Any], dict[str, Any]]]:
    """(run dir, config, summary) of every record that has ended (completed, diverged, failed, ...)."""
    for record in records:
        if record.status == "running":
            continue
        try:
            config = record.config
        except (OSError, yaml.YAMLError):
            continue  # being written, or not a run record
        yield record.dir, config, record.summary


def serve(uri: str, host: str, port: int) -> int:
    """MLflow's tracking server and UI over ``uri``, in the foreground (Ctrl-C stops it)."""
    print(f"MLflow UI: http://{host}:{port}  (store {uri}; Ctrl-C stops it)", flush=True)
    cmd = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", uri, "--host", host,
           "--port", str(port), "--workers", "1"]
    try:
        return subprocess.run(cmd, check=False).returncode
    except KeyboardInterrupt:
        return 0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="normexp dashboard", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, default=None, help="output root (default: $NORMEXP_OUTPUT_DIR "
                        "or outputs)")
    parser.add_argument("--store", default=None, help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, "
                        "else sqlite:///<root>/mlflow/mlflow.db)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=5000)
    parser.add_argument("--no-serve", action="store_true", help="import only")
    args = parser.parse_args(argv)
    from .tracking.mlflow import import_records, tracking_uri

    root = args.root or output_root()
    try:
        if not root.is_dir():
            raise UserError(f"no run records under '{root}': run something first (make demo), or give --root")
        uri = tracking_uri(args.store, root)
        records = list(index_records(root).values())  # one record per run id: its best result
        running = sum(r.status == "running" for r in records)
        imported, present = import_records(finished_records(records), uri)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"records under {root}: {imported} imported, {present} already in the store"
          + (f", {running} still running (imported once they end)" if running else ""), flush=True)
    if not args.no_serve and not uri.startswith(("http://", "https://")):
        sys.exit(serve(uri, args.host, args.port))
    print(f"store: {uri}")


if __name__ == "__main__":
    main()
