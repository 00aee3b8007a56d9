"""Preemption: a run killed mid-epoch (SIGKILL) or stopped by SIGTERM resumes with trainer.resume=auto (the
default) and ends with the metrics of an uninterrupted run; checkpoint writes are atomic; a truncated
checkpoint is one line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import ROOT, run_cli

from normexp.engine.checkpoint import load_checkpoint, save_checkpoint
from normexp.errors import UserError
from normexp.tracking.records import read_metrics, read_summary

ARGS = ["trainer.epochs=2", "trainer.warmup_epochs=0", "trainer.checkpoint_interval=5",
        "trainer.log_interval=1", "trainer.progress=false", "logger=none", "trainer.device=cpu"]
ENV = {**os.environ, "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1"}


COMMAND = [sys.executable, "-m", "normexp", *ARGS]


def the_record(output: Path) -> Path | None:
    """The one run directory under ``output`` (the run's identity names it)."""
    return next((p.parent for p in output.rglob("metrics.jsonl")), None)


def finish(output: Path) -> dict:
    done = subprocess.run(COMMAND, cwd=ROOT, env={**ENV, "NORMEXP_OUTPUT_DIR": str(output)},
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return read_summary(the_record(output))


def start_until_step(output: Path, step: int, stderr: int | None = subprocess.DEVNULL
                     ) -> tuple[subprocess.Popen, int, Path]:
    """Start the run and return once it has logged ``step`` (and the last step logged, and its directory)."""
    process = subprocess.Popen(COMMAND, cwd=ROOT, env={**ENV, "NORMEXP_OUTPUT_DIR": str(output)},
                               stdout=subprocess.DEVNULL, stderr=stderr, text=True)
    deadline = time.time() + 600
    while time.time() < deadline:
        found = the_record(output)
        rows = read_metrics(found) if found and (found / "metrics.jsonl").is_file() else []
        logged = max((r["step"] for r in rows), default=0)
        if logged >= step:
            return process, logged, found
        assert process.poll() is None, "the run ended before it was interrupted"
        time.sleep(0.05)
    process.kill()
    raise AssertionError(f"step {step} not reached")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict:
    return finish(tmp_path_factory.mktemp("uninterrupted"))


def assert_same_run(resumed_dir: Path, reference: dict) -> None:
    resumed = read_summary(resumed_dir)
    assert resumed["status"] == "completed"
    assert resumed["metrics"] == reference["metrics"]
    rows = read_metrics(resumed_dir)
    steps = [r["step"] for r in rows if "val/top1" not in r]
    assert steps == sorted(set(steps)) == list(range(1, steps[-1] + 1))  # each update logged once
    assert [r["epoch"] for r in rows if "val/top1" in r] == [1, 2]


@pytest.mark.slow
def test_sigkill_mid_epoch_then_the_same_command(tmp_path, uninterrupted):
    """kill -9, then the very command again: it continues the unfinished run in its directory, which ends as
    an uninterrupted run does."""
    output = tmp_path / "outputs"
    process, _, run_dir = start_until_step(output, 12)
    process.kill()
    process.wait()
    state = load_checkpoint(run_dir)
    assert state["epoch"] == 0 and 0 < state["batch"] < 22  # mid-epoch (22 updates per epoch)
    assert read_summary(run_dir)["status"] == "running"
    finish(output)
    assert [p.parent for p in output.rglob("summary.json")] == [run_dir]
    assert_same_run(run_dir, uninterrupted)


@pytest.mark.slow
def test_sigterm_checkpoints_after_the_current_step_then_resumes(tmp_path, uninterrupted):
    process, logged, run_dir = start_until_step(tmp_path, 7)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=120) == 128 + signal.SIGTERM
    summary = read_summary(run_dir)
    assert summary["status"] == "interrupted" and "SIGTERM" in summary["error"]
    stopped_at = load_checkpoint(run_dir)["update"]
    assert logged <= stopped_at <= logged + 2  # the update under way finished, no more
    finish(tmp_path)
    assert_same_run(run_dir, uninterrupted)


@pytest.mark.slow
def test_ctrl_c_checkpoints_and_the_command_it_names_continues(tmp_path, uninterrupted):
    output = tmp_path / "outputs"
    process, logged, run_dir = start_until_step(output, 7, stderr=subprocess.PIPE)
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 128 + signal.SIGINT and "Traceback" not in err
    message = err.strip().splitlines()[-1]
    assert message.startswith("interrupted: SIGINT at step ") and str(run_dir) in message
    assert message.endswith("the same command continues it: python -m normexp " + " ".join(ARGS))
    assert read_summary(run_dir)["status"] == "interrupted"
    assert logged <= load_checkpoint(run_dir)["update"] <= logged + 2
    finish(output)
    assert [p.parent for p in output.rglob("summary.json")] == [run_dir]
    assert_same_run(run_dir, uninterrupted)


def test_a_kill_while_writing_leaves_the_previous_checkpoint(tmp_path):
    path = tmp_path / "checkpoint.pth"
    save_checkpoint(path, {"model": {"w": torch.ones(3)}, "epoch": 1})

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("killed mid-write")

    with pytest.raises(RuntimeError, match="killed mid-write"):
        save_checkpoint(path, {"model": {"w": torch.zeros(1000)}, "epoch": 2, "rest": Unpicklable()})
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pth"]  # the partial write is removed
    previous = load_checkpoint(path)
    assert previous["epoch"] == 1 and torch.equal(previous["model"]["w"], torch.ones(3))


def test_checkpoints_load_without_running_code(tmp_path):
    class Payload:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    torch.save({"model": {}, "x": Payload()}, tmp_path / "evil.pth")
    with pytest.raises(UserError, match="cannot read checkpoint"):
        load_checkpoint(tmp_path / "evil.pth")


def test_truncated_checkpoint_is_one_line_and_exit_2(tmp_path):
    path = tmp_path / "checkpoint.pth"
    save_checkpoint(path, {"model": {"w": torch.ones(1000)}, "epoch": 1})
    path.write_bytes(path.read_bytes()[:700])
    out = run_cli("task=robustness", f"task.checkpoint={path}", "logger=none",
                  env={"NORMEXP_OUTPUT_DIR": str(tmp_path / "out")})
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert lines[-1].startswith(f"error: cannot read checkpoint '{path}'") and "Traceback" not in out.stderr
    assert not (tmp_path / "out").exists()  # refused before the run started: nothing written
