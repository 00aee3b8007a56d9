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
    assert (site / "normexp" / "norms" / "kernels" / "native.cpp").is_file()  # the native CPU kernels' source
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
    (summary,) = elsewhere.glob("outputs/classification/*/summary.json")
    assert '"status": "completed"' in summary.read_text()


def declared_requirements() -> dict[str, str]:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    from packaging.requirements import Requirement

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return {Requirement(d).name: str(Requirement(d).specifier) for d in deps}


def constraint_versions() -> dict[str, str]:
    pins = [line.split("#")[0].strip() for line in (ROOT / "constraints.txt").read_text().splitlines()]
    return dict(pin.split("==") for pin in pins if pin)


def test_torch_is_a_supported_range_and_the_tested_versions_are_pinned_apart():
    """A cluster's own torch (any release from the oldest with the APIs normexp uses) satisfies the package;
    the versions the tests ran with are constraints that `make install` applies."""
    from importlib import metadata

    from packaging.specifiers import SpecifierSet

    declared, tested = declared_requirements(), constraint_versions()
    for name, oldest in (("torch", "2.5.0"), ("torchvision", "0.20.0")):
        allowed = SpecifierSet(declared[name])
        assert oldest in allowed and tested[name] in allowed
        assert not any(s.operator == "==" for s in allowed), f"{name} is pinned in pyproject.toml"
        assert metadata.version(name).split("+")[0] == tested[name]  # this environment is the tested one
    assert set(tested) >= set(declared)  # every dependency has a tested version
    assert "-c constraints.txt" in (ROOT / "Makefile").read_text()


@pytest.mark.slow
def test_installing_keeps_the_torch_an_environment_already_has(tmp_path):
    """pip's resolver, in a venv that holds the oldest supported torch and torchvision (and every other
    dependency at its tested version), installs normexp alone. The dependencies are metadata-only stand-ins
    (the oldest torch does not install on this machine), so this checks the requirements pip reads, not that
    normexp runs on torch 2.5."""
    from importlib import metadata

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = Path(subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig."
                                "get_paths()['purelib'])"], check=True, capture_output=True, text=True)
                .stdout.strip())
    setuptools = metadata.distribution("setuptools")  # what building normexp's metadata needs
    where = Path(setuptools.locate_file(""))
    for name in ("setuptools", "_distutils_hack", f"setuptools-{setuptools.version}.dist-info"):
        (site / name).symlink_to(where / name)
    oldest = {"torch": "2.5.0", "torchvision": "0.20.0"}
    for name in declared_requirements():
        version = oldest.get(name) or metadata.version(name)
        info = site / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        (info / "RECORD").write_text("")
    report = tmp_path / "report.json"
    pip = [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python")]
    out = subprocess.run([*pip, "install", "--dry-run", "--no-index", "--no-build-isolation", "--quiet",
                          "--report", str(report), str(ROOT)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    import json

    installs = [item["metadata"]["name"] for item in json.loads(report.read_text())["install"]]
    assert installs == ["normexp"]
