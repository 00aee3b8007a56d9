"""The dashboard answers its question: MLflow's compare page of a table's runs, rendered by headless Chromium,
lists each run under a name that says which row it is, and shows the table's metric."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess

import pytest
import yaml
from conftest import ROOT

pytestmark = pytest.mark.slow

SQUASH = {"identity": 58.0, "tanh": 80.0, "hardtanh": 79.0, "sigmoid": 78.0}


def screenshot_script():
    spec = importlib.util.spec_from_file_location("dashboard_screenshot", ROOT / "scripts" /
                                                  "dashboard_screenshot.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def table_records(root) -> set[str]:
    """Four finished records of a table's runs, as its planner labels them (run name, metric)."""
    run_ids = set()
    for i, (squash, top1) in enumerate(SQUASH.items()):
        run_dir = root / "tables" / "smoke" / "dyt_squash" / f"vit_micro-dyt-digits-s0-{i}"
        run_dir.mkdir(parents=True)
        config = {"name": "vit_micro-dyt-digits-s0", "seed": 0, "backbone": {"name": "vit_micro"},
                  "norm": {"name": "dyt", "squash": squash}, "task": {"name": "classification"},
                  "data": {"name": "digits"},
                  "table": {"id": "dyt_squash", "scale": "smoke", "metric": "final/val/top1",
                            "run_name": f"dyt_squash/ViT-S,ViT-B/{squash}/s0"}}
        summary = {"status": "completed", "run_id": f"run{i}", "name": config["name"],
                   "started_at": "2026-12-01T10:00:00+00:00", "finished_at": "2026-12-01T10:05:00+00:00",
                   "metrics": {"final": {"val/loss": 1.0, "val/top1": top1, "epoch": 8},
                               "best": {"val/top1": top1, "epoch": 8}}, "params": 679786}
        (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
        (run_dir / "summary.json").write_text(json.dumps(summary))
        (run_dir / "metrics.jsonl").write_text(
            json.dumps({"step": 10, "epoch": 1, "train/loss": 2.0, "lr": 0.001}) + "\n"
            + json.dumps({"step": 45, "epoch": 1, "val/top1": top1, "val/loss": 1.0}) + "\n")
        run_ids.add(summary["run_id"])
    return run_ids


def test_the_compare_page_names_each_run_by_its_row_and_plots_the_table_metric(tmp_path, monkeypatch):
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("no chromium on the PATH (apt-get install chromium)")
    monkeypatch.chdir(tmp_path)
    wanted = table_records(tmp_path / "outputs")
    script = screenshot_script()
    with script.dashboard(tmp_path / "outputs") as base:
        url, chosen = script.compare_url(base, wanted)
        assert len(chosen) == 4
        page = subprocess.run([browser, *script.CHROMIUM_FLAGS, "--window-size=1600,1000", "--dump-dom", url],
                              capture_output=True, text=True, timeout=300).stdout
        shot = tmp_path / "page.png"
        subprocess.run([browser, *script.CHROMIUM_FLAGS, "--window-size=1600,1000", f"--screenshot={shot}",
                        url], capture_output=True, timeout=300)
    names = [f"dyt_squash/ViT-S,ViT-B/{squash}/s0" for squash in SQUASH]
    assert all(name in page for name in names), page[-3000:]  # four runs, four names
    axes = re.findall(r'class="axis-title"[^>]*data-unformatted="([^"]*)"', page)  # the plot's axes
    assert axes[0] == "norm.squash" and axes[-1] == "final/val/top1", axes
    assert shot.stat().st_size > 10_000
