"""``normexp dashboard`` (``make dashboard``): every local run in MLflow's UI, with no account.

    normexp dashboard                      # import new records into outputs/mlflow/, serve http://127.0.0.1:5000
    normexp dashboard --port 5001 --root /scratch/outputs
    normexp dashboard --no-serve           # import only
    normexp dashboard --store http://tracking.lab:5000   # import into a team's MLflow server instead

Every run record under the output root -- made with any logger or none, tables' runs included -- that is not
in the store yet is imported (keyed by its ``run_id``; a record still ``running`` waits for the next import),
then MLflow's tracking server and UI start on localhost over the store. Importing again adds nothing; the
records are only read. The UI compares runs side by side, groups and charts them
(docs/records-and-dashboards.md: "Dashboards").
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from .errors import UserError, one_line, storage_error
from .tracking.records import Record, index_records, output_root

STORE_HINT = "give a store you can write: --store sqlite:////<writable dir>/mlflow.db, or a server's URL"


def finished_records(records: Iterable[Record]) -> Iterator[tuple[Path, dict[str, Any], dict[str, Any]]]:
    """(run dir, config, summary) of every record that has ended (completed, diverged, failed, ...)."""
    for record in records:
        if record.status != "running":
            yield record.dir, record.config, record.summary


DEFAULT_PORT = 5000
PORTS_TRIED = 20  # without --port: the first free one from DEFAULT_PORT on


def port_free(host: str, port: int) -> bool:
    """Whether a server can listen on ``host:port`` now (as uvicorn binds: with SO_REUSEADDR)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def choose_port(host: str, port: int | None) -> int:
    """``--port`` if free (else one line); without it the first free port from 5000 on, said if not 5000."""
    if port is not None:
        if not port_free(host, port):
            raise UserError(f"port {port} on {host} is in use (another dashboard?): give another --port, or "
                            "stop what listens there")
        return port
    found = next((p for p in range(DEFAULT_PORT, DEFAULT_PORT + PORTS_TRIED) if port_free(host, p)), None)
    if found is None:
        raise UserError(f"ports {DEFAULT_PORT}-{DEFAULT_PORT + PORTS_TRIED - 1} on {host} are all in use: "
                        "give a free one with --port")
    if found != DEFAULT_PORT:
        print(f"port {DEFAULT_PORT} is in use: serving on {found}", flush=True)
    return found


class _Stop(Exception):
    """SIGTERM or SIGHUP reached the dashboard."""


def _raise_stop(signum: int, frame: Any) -> None:
    raise _Stop(signum)


def serve(uri: str, host: str, port: int) -> int:
    """MLflow's tracking server and UI over ``uri``, in the foreground, until it ends, Ctrl-C, SIGTERM or
    SIGHUP. The server runs in a process group of its own (it starts uvicorn and a task queue): however the
    dashboard is stopped, the whole group is stopped with it."""
    cmd = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", uri, "--host", host,
           "--port", str(port), "--workers", "1"]
    previous = {s: signal.signal(s, _raise_stop) for s in (signal.SIGTERM, signal.SIGHUP)}
    server = subprocess.Popen(cmd, start_new_session=True)
    print(f"MLflow UI: http://{host}:{port}  (store {uri}; Ctrl-C stops it)", flush=True)
    try:
        return server.wait()
    except (KeyboardInterrupt, _Stop):
        return 0
    finally:
        _stop_group(server)
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _stop_group(server: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM to the server's process group; once the server has ended (or ``grace_s`` passed), SIGKILL
    to whatever of the group is left."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        server.wait(timeout=grace_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.pid, signal.SIGKILL)
    server.wait()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="normexp dashboard", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, default=None, help="output root (default: $NORMEXP_OUTPUT_DIR "
                        "or outputs)")
    parser.add_argument("--store", default=None, help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, "
                        "else sqlite:///<root>/mlflow/mlflow.db)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=None,
                        help=f"default: {DEFAULT_PORT}, or the next free port when it is taken")
    parser.add_argument("--no-serve", action="store_true", help="import only")
    args = parser.parse_args(argv)
    from .tracking.mlflow import import_records, tracking_uri

    root = args.root or output_root()
    try:
        if not root.is_dir():
            raise UserError(f"no run records under '{root}': run something first (make demo), or give --root")
        uri = tracking_uri(args.store, root)
        serving = not args.no_serve and not uri.startswith(("http://", "https://"))
        port = choose_port(args.host, args.port) if serving else None  # before anything is written
        records = list(index_records(root, with_config=True).values())  # a damaged one: skipped, named
        running = sum(r.status == "running" for r in records)
        try:
            imported, present = import_records(finished_records(records), uri)
        except OSError as e:
            raise storage_error(e, STORE_HINT) or e from e
    except UserError as e:
        print(f"error: {one_line(e)}", file=sys.stderr)
        sys.exit(2)
    print(f"records under {root}: {imported} imported, {present} already in the store"
          + (f", {running} still running (imported once they end)" if running else ""), flush=True)
    if serving:
        sys.exit(serve(uri, args.host, port))
    print(f"store: {uri}")


if __name__ == "__main__":
    main()
