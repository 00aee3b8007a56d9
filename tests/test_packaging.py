"""The package installs anywhere: ``pip install .`` (not editable) ships the configs, and the demo runs from
a directory outside the source tree."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from conftest import ROOT


def test_every_package_is_listed():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "normexp").glob("**/__init__.py")}
    found |= {".".join(p.parent.relative_to(ROOT).parts)
              for p in (ROOT / "hydra_plugins").glob("*/__init__.py")} | {"hydra_plugins"}
    assert listed == found | {"normexp.configs"}


@pytest.mark.slow
def test_non_editable_install_runs_the_demo_elsewhere(tmp_path):
    """A fresh venv holding normexp as pip installs it (its dependencies come from this environment, read as
    plain paths: the editable install of the checkout stays out), run from a directory of its own."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = Path(subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig."
                                "get_paths()['purelib'])"], check=True, capture_output=True, text=True)
                .stdout.strip())
    (site / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    install = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-input",
                              "--target", str(site), str(ROOT)], capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stderr[-2000:]
    assert (site / "normexp" / "configs" / "train.yaml").is_file()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"WANDB_SILENT": "true"}
    where = subprocess.run([str(venv / "bin" / "python"), "-c", "import normexp; print(normexp.CONFIG_DIR)"],
                           cwd=elsewhere, capture_output=True, text=True, env=env)
    assert where.stdout.strip() == str(site / "normexp" / "configs"), where.stderr
    demo = subprocess.run([str(venv / "bin" / "python"), "-m", "normexp", "trainer.epochs=1", "logger=none",
                           "trainer.progress=false"], cwd=elsewhere, capture_output=True, text=True, env=env,
                          timeout=900)
    assert demo.returncode == 0, demo.stderr[-3000:]
    (summary,) = elsewhere.glob("outputs/classification/*/*/summary.json")
    assert '"status": "completed"' in summary.read_text()
