"""MLflow's comparison of one table's runs, screenshot in headless Chromium (makes results/dashboard.png).

    python scripts/dashboard_screenshot.py --table dyt_squash --scale smoke --out results/dashboard.png

Serves the UI on a free port with ``normexp dashboard`` (which first imports the records not in the store),
finds the table's runs by their ``normexp.run_id`` tag through the REST API, and opens MLflow's
compare-runs page with ``chromium --headless --screenshot``: the runs named after the table's rows, the
parallel-coordinates plot of the parameters that differ and the table's metric (the import logs it first,
which that plot shows by default). Needs Debian's ``chromium`` on the PATH.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from normexp.tables.cli import make_plan
from normexp.tracking.mlflow import RUN_ID_TAG


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.load(response)


def wait_for(url: str, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while True:
        try:
            urllib.request.urlopen(url, timeout=5).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1)


CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-extensions", "--no-first-run", "--hide-scrollbars",
                  "--virtual-time-budget=30000")


def find_chromium() -> str:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        sys.exit("error: no chromium on the PATH: install Debian's chromium package "
                 "(apt-get install chromium)")
    return browser


@contextmanager
def dashboard(root: Path | None = None) -> Iterator[str]:
    """``normexp dashboard`` (import, then MLflow's server) on a free port; yields its base URL."""
    port = free_port()
    command = [sys.executable, "-m", "normexp", "dashboard", "--port", str(port)]
    command += ["--root", str(root)] if root else []
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_for(f"{base}/health")
        yield base
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # the dashboard and the mlflow server it started
        server.wait(timeout=30)


def compare_url(base: str, wanted: set[str]) -> tuple[str, list[dict]]:
    """MLflow's compare-runs page of the runs whose ``normexp.run_id`` tag is in ``wanted``, and the runs."""
    experiments = post(f"{base}/api/2.0/mlflow/experiments/search", {"max_results": 100})["experiments"]
    ids = [e["experiment_id"] for e in experiments]
    runs = post(f"{base}/api/2.0/mlflow/runs/search",
                {"experiment_ids": ids, "max_results": 1000}).get("runs", [])
    chosen = [r for r in runs
              if {t["key"]: t["value"] for t in r["data"].get("tags", [])}.get(RUN_ID_TAG) in wanted]
    experiment_ids = sorted({r["info"]["experiment_id"] for r in chosen})
    query = urllib.parse.urlencode({"runs": json.dumps([r["info"]["run_id"] for r in chosen]),
                                    "experiments": json.dumps(experiment_ids)})
    return f"{base}/#/compare-runs?{query}", chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--table", default="dyt_squash")
    parser.add_argument("--scale", default="smoke")
    parser.add_argument("--out", type=Path, default=Path("results/dashboard.png"))
    parser.add_argument("--size", default="1600,1000", help="window width,height in pixels")
    args = parser.parse_args()
    browser = find_chromium()
    plan = make_plan(args.table, args.scale, None, [])
    wanted = {r.run_id for r in plan.runs if r.record}
    if not wanted:
        sys.exit(f"error: table {args.table} has no finished runs at scale {args.scale}: "
                 f"run `make table-{args.table} SCALE={args.scale}` first")
    with dashboard() as base:
        url, chosen = compare_url(base, wanted)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([browser, *CHROMIUM_FLAGS, f"--window-size={args.size}",
                        f"--screenshot={args.out.resolve()}", url],
                       check=True, capture_output=True, timeout=300)
        print(f"{len(chosen)} runs of {args.table} ({args.scale}) compared: {url}\nwrote {args.out}")


if __name__ == "__main__":
    main()
