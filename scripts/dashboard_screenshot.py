"""MLflow's comparison of one table's runs, screenshot in headless Chromium (makes results/dashboard.png).

    python scripts/dashboard_screenshot.py --table dyt_squash --scale smoke --out results/dashboard.png

Serves the UI on a free port with ``normexp dashboard`` (which first imports the records not in the store),
finds the table's runs by their ``normexp.run_id`` tag through the REST API, and opens MLflow's
compare-runs page with ``chromium --headless --screenshot``. Needs Debian's ``chromium`` on the PATH.
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--table", default="dyt_squash")
    parser.add_argument("--scale", default="smoke")
    parser.add_argument("--out", type=Path, default=Path("results/dashboard.png"))
    parser.add_argument("--size", default="1600,1000", help="window width,height in pixels")
    args = parser.parse_args()
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        sys.exit("error: no chromium on the PATH: install Debian's chromium package "
                 "(apt-get install chromium)")

    plan = make_plan(args.table, args.scale, None, [])
    wanted = {r.run_id for r in plan.runs if r.record}
    if not wanted:
        sys.exit(f"error: table {args.table} has no finished runs at scale {args.scale}: "
                 f"run `make table-{args.table} SCALE={args.scale}` first")
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "normexp", "dashboard", "--port", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_for(f"{base}/health")
        experiments = post(f"{base}/api/2.0/mlflow/experiments/search", {"max_results": 100})["experiments"]
        ids = [e["experiment_id"] for e in experiments]
        runs = post(f"{base}/api/2.0/mlflow/runs/search",
                    {"experiment_ids": ids, "max_results": 1000}).get("runs", [])
        chosen = [r for r in runs if {t["key"]: t["value"] for t in r["data"].get("tags", [])}
                  .get(RUN_ID_TAG) in wanted]
        run_ids = [r["info"]["run_id"] for r in chosen]
        experiment_ids = sorted({r["info"]["experiment_id"] for r in chosen})
        query = urllib.parse.urlencode({"runs": json.dumps(run_ids),
                                        "experiments": json.dumps(experiment_ids)})
        url = f"{base}/#/compare-runs?{query}"
        args.out.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                        f"--window-size={args.size}", "--virtual-time-budget=30000",
                        f"--screenshot={args.out.resolve()}", url],
                       check=True, capture_output=True, timeout=300)
        print(f"{len(run_ids)} runs of {args.table} ({args.scale}) compared: {url}\nwrote {args.out}")
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # the dashboard and the mlflow server it started
        server.wait(timeout=30)


if __name__ == "__main__":
    main()
