"""The local dashboard against a real MLflow server on localhost (SQLite store in a temporary directory): a
2-run sweep mirrored live with logger=mlflow, a third record (logged with no logger) imported, everything
read back through MLflow's REST API; importing again adds nothing."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from conftest import run_cli

from normexp.tracking.records import read_metrics

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def api(url: str, path: str, body: dict | None = None) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(f"{url}/api/2.0/mlflow/{path}", data=data,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    where = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    command = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri",
               f"sqlite:///{where / 'mlflow.db'}", "--host", "127.0.0.1", "--port", str(port),
               "--workers", "1"]
    process = subprocess.Popen(command, cwd=where, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(240):
        try:
            urllib.request.urlopen(f"{url}/health", timeout=2)
            break
        except OSError:
            assert process.poll() is None, "the MLflow server did not start"
            time.sleep(0.5)
    yield url
    process.terminate()
    process.wait(timeout=30)


def all_runs(url: str) -> list[dict]:
    experiments = api(url, "experiments/search", {"max_results": 100})["experiments"]
    found = api(url, "runs/search", {"experiment_ids": [e["experiment_id"] for e in experiments],
                                     "max_results": 100})
    return found.get("runs", [])


def test_sweep_mirrored_live_and_a_record_imported(tmp_path, server):
    env = {"NORMEXP_OUTPUT_DIR": str(tmp_path / "out")}
    common = ["trainer.epochs=1", "trainer.warmup_epochs=0", "trainer.log_interval=5",
              "trainer.progress=false"]
    sweep = run_cli("-m", "seed=0,1", "logger=mlflow", f"logger.mlflow.tracking_uri={server}", *common,
                    env=env)
    assert sweep.returncode == 0, sweep.stderr[-3000:]
    alone = run_cli("norm=dyt", "logger=none", *common, env=env)
    assert alone.returncode == 0, alone.stderr[-3000:]
    assert len(all_runs(server)) == 2

    dashboard = [sys.executable, "-m", "normexp", "dashboard", "--root", str(tmp_path / "out"), "--store",
                 server, "--no-serve"]
    first = subprocess.run(dashboard, capture_output=True, text=True, timeout=300)
    assert "1 imported, 2 already in the store" in first.stdout, first.stderr[-2000:]
    runs = all_runs(server)
    assert len(runs) == 3

    summaries = (tmp_path / "out").glob("**/summary.json")
    records = {json.loads(p.read_text())["run_id"]: p.parent for p in summaries}
    for run in runs:
        tags = {t["key"]: t["value"] for t in run["data"]["tags"]}
        params = {p["key"]: p["value"] for p in run["data"]["params"]}
        metrics = {m["key"]: m["value"] for m in run["data"]["metrics"]}
        record = records[tags["normexp.run_id"]]
        summary = json.loads((record / "summary.json").read_text())
        assert (tags["backbone"], tags["task"], tags["data"]) == ("vit_micro", "classification", "digits")
        assert tags["norm"] == params["norm.name"] and params["seed"] == str(summary["seed"])
        assert params["trainer.epochs"] == "1" and params["backbone.name"] == "vit_micro"
        assert metrics["final/val/top1"] == pytest.approx(summary["metrics"]["final"]["val/top1"])
        assert run["info"]["status"] == "FINISHED"
        history = api(server, f"metrics/get-history?run_id={run['info']['run_id']}&metric_key=train/loss")
        logged = sorted((m["step"], m["value"]) for m in history["metrics"])
        expected = sorted((r["step"], r["train/loss"]) for r in read_metrics(record) if "train/loss" in r)
        assert [s for s, _ in logged] == [s for s, _ in expected]
        assert [v for _, v in logged] == pytest.approx([v for _, v in expected])

    again = subprocess.run(dashboard, capture_output=True, text=True, timeout=300)
    assert "0 imported, 3 already in the store" in again.stdout and len(all_runs(server)) == 3
