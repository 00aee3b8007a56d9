"""Where jobs run: launcher=slurm composes Hydra's submitit SLURM launcher with our keys; a sweep goes end to
end through submitit's local executor."""

from __future__ import annotations

import json

import pytest
from conftest import run_cli
from omegaconf import OmegaConf


def test_slurm_launcher_composes_with_our_keys():
    shown = run_cli("launcher=slurm", "--cfg", "hydra")
    assert shown.returncode == 0, shown.stderr
    launcher = OmegaConf.create(shown.stdout).hydra.launcher
    assert launcher._target_.endswith("submitit_launcher.SlurmLauncher")
    assert OmegaConf.to_container(launcher)["nodes"] == "${launcher.nodes}"  # our keys drive it
    out = run_cli("launcher=slurm", "launcher.nodes=2", "launcher.partition=gpu", "launcher.account=lab",
                  "--cfg", "all", "--resolve")
    assert out.returncode == 0, out.stderr
    hydra = OmegaConf.create(out.stdout).hydra
    assert hydra.launcher._target_.endswith("submitit_launcher.SlurmLauncher") and hydra.mode == "MULTIRUN"
    assert (hydra.launcher.nodes, hydra.launcher.gpus_per_node, hydra.launcher.tasks_per_node) == (2, 8, 8)
    assert (hydra.launcher.partition, hydra.launcher.account) == ("gpu", "lab")
    assert hydra.launcher.timeout_min == 4320


@pytest.mark.slow
def test_a_sweep_through_submitits_local_executor(tmp_path):
    out = run_cli("-m", "launcher=submitit_local", "seed=0,1", "trainer.epochs=1", "logger=none",
                  "trainer.progress=false", env={"NORMEXP_OUTPUT_DIR": str(tmp_path)})
    assert out.returncode == 0, out.stderr[-3000:]
    summaries = [json.loads(p.read_text()) for p in tmp_path.glob("classification/*/summary.json")]
    assert sorted(s["seed"] for s in summaries) == [0, 1]
    assert all(s["status"] == "completed" for s in summaries)
    assert list(tmp_path.glob("multirun/*/*/.submitit"))  # the sweep's own files: Hydra's
