"""The pre-training and generative tasks as processes: killed with SIGKILL mid-epoch (DiT: also while it
samples), the same command continues the run to the numbers of an uninterrupted one (a DINO teacher and
centre, the schedules, the RNG states, DiT's sample shards included); two torchrun processes write one
record."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT

from normexp.engine.checkpoint import load_checkpoint
from normexp.tracking.records import read_metrics, read_summary

pytestmark = pytest.mark.slow

COMMON = ["logger=none", "trainer.progress=false", "trainer.device=cpu", "data.img_size=8",
          "trainer.epochs=2", "trainer.warmup_epochs=1", "trainer.log_interval=1",
          "trainer.checkpoint_interval=2", "data.val_fraction=0.8", "data.batch_size=32"]
TASKS = {
    "mae": ["task=mae", "norm=dtn"],  # DTN on the visible tokens, in the decoder on the full grid
    "dino": ["task=dino", "norm=dyt", "task.local_crops=2", "task.local_size=4", "task.out_dim=64",
             "task.hidden_dim=32", "task.bottleneck_dim=16"],
    # its samples scored too: the same fd_digits after a kill
    "dit": ["task=dit", "norm=dyt", "task.fid.samples=40", "task.fid.batch_size=10",
            "task.sampling_steps=10"],
}
ENV = {**os.environ, "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1"}


def command(task: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "normexp", *COMMON, *TASKS[task], *extra]


def in_root(output: Path) -> dict[str, str]:
    return {**ENV, "NORMEXP_OUTPUT_DIR": str(output)}


def record_of(task: str, output: Path) -> Path:
    """The run's directory under ``output`` (its identity names it; the run may not have started yet)."""
    found = list(output.glob(f"{task}/*"))
    return found[0] if found else output / task / "not-started"


def finish(task: str, output: Path, *extra: str) -> dict:
    done = subprocess.run(command(task, *extra), cwd=ROOT, env=in_root(output), capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return read_summary(record_of(task, output))


@pytest.mark.parametrize("task", list(TASKS))
def test_sigkill_mid_epoch_then_the_same_command(tmp_path, task):
    reference = finish(task, tmp_path / "uninterrupted")
    killed = tmp_path / "killed"
    process = subprocess.Popen(command(task), cwd=ROOT, env=in_root(killed), stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    deadline = time.time() + 600
    while time.time() < deadline:
        run_dir = record_of(task, killed)
        rows = read_metrics(run_dir) if (run_dir / "metrics.jsonl").is_file() else []
        if max((r["step"] for r in rows), default=0) >= 13:  # into epoch 2 (11 updates each), checkpointed
            break
        assert process.poll() is None, "the run ended before it was killed"
        time.sleep(0.05)
    process.kill()
    process.wait()
    state = load_checkpoint(run_dir)
    assert state["epoch"] == 1 and state["batch"] > 0  # mid-epoch
    if task == "dino":
        assert set(state["task"]) == {"teacher", "center"}
    resumed = finish(task, killed)
    assert resumed["metrics"] == reference["metrics"]
    assert [a["status"] for a in resumed["attempts"]] == ["interrupted", "completed"]


@pytest.mark.parametrize("task", list(TASKS))
def test_two_torchrun_processes_write_one_record(tmp_path, task):
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                           "--master_port=29531", "-m", "normexp", *COMMON, *TASKS[task],
                           "data.batch_size=16"], cwd=ROOT, env=in_root(tmp_path), capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir = record_of(task, tmp_path)
    summary = read_summary(run_dir)
    assert summary["status"] == "completed" and summary["world_size"] == 2 and summary["global_batch"] == 32
    assert [p.parent for p in tmp_path.rglob("summary.json")] == [run_dir]


def test_sigkill_while_dit_samples_then_the_same_command(tmp_path):
    """No sample made twice or skipped: the shards finished before the kill are kept as they are, the
    others made, and the scores are an uninterrupted run's."""
    slower = ["task.fid.samples=120", "task.sampling_steps=50"]
    reference = finish("dit", tmp_path / "uninterrupted", *slower)
    killed = tmp_path / "killed"
    process = subprocess.Popen(command("dit", *slower), cwd=ROOT, env=in_root(killed),
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 600
    while time.time() < deadline and len(list(killed.glob("dit/*/shards/shard-*.npz"))) < 3:
        assert process.poll() is None, "the run ended before it was killed"
        time.sleep(0.05)
    process.kill()
    process.wait()
    shards = record_of("dit", killed) / "shards"
    kept = {p.name: p.stat().st_mtime_ns for p in shards.glob("shard-*.npz")}
    assert 3 <= len(kept) < 12
    resumed = finish("dit", killed, *slower)
    assert resumed["metrics"] == reference["metrics"]
    assert all(p.stat().st_mtime_ns == kept[p.name] for p in shards.glob("shard-*.npz") if p.name in kept)
    assert len(list(shards.glob("shard-*.npz"))) == 12 and not list(shards.glob(".*"))
