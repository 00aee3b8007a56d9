"""How a run starts: a refused start changes nothing, a done run is not run again, an unfinished one continues
(the same command finds it), Ctrl-C checkpoints, a killed run reads as interrupted, and one process at a time
holds a run directory."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import compose_cfg, interrupted_in_epoch_2, quick_cfg
from omegaconf import OmegaConf

from normexp.engine.trainer import Trainer
from normexp.errors import Interrupted, UserError
from normexp.run import Outcome, claim, run
from normexp.tracking import lock as lock_module
from normexp.tracking.lock import RunBusy, RunLock, read_owner
from normexp.tracking.provenance import config_hash
from normexp.tracking.records import (
    effective_status,
    index_records,
    read_metrics,
    read_summary,
    write_json_atomic,
)
from normexp.tracking.run_dir import run_dir


def digest(directory: Path) -> dict[str, str]:
    """Every file under ``directory`` and a hash of its bytes."""
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def copy_of(completed: Path, tmp_path: Path, status: str | None = None) -> Path:
    run_dir = tmp_path / "run"
    shutil.copytree(completed, run_dir)
    if status is not None:  # the same record, as a run stopped before its end would have left it
        summary = read_summary(run_dir)
        summary["status"] = status
        (run_dir / "summary.json").write_text(json.dumps(summary))
    return run_dir


def damage(path: Path) -> None:
    """4 KB of random bytes in the middle of the file (a bad block, a partial copy)."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 4096] = random.Random(0).randbytes(4096)
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def held_by_a_live_process(run_dir: Path) -> None:
    """A lock naming this test's parent process: alive, and not this process."""
    owner = {"host": socket.gethostname(), "pid": os.getppid(), "pid_start": lock_module._process_start(
        os.getppid()), "claimed_at": "2026-01-01T00:00:00+00:00"}
    (run_dir / "run.lock").write_text(json.dumps(owner))


REFUSALS = {
    "another config": (None, None, ["trainer.epochs=5"],
                       "holds another run (completed; it differs in trainer.epochs: 1 -> 5)"),
    "an invalid value": (None, None, ["data.batch_size=0"], "data.batch_size=0: must be >= 1"),
    "a truncated checkpoint": ("interrupted", truncate, [], "cannot read checkpoint"),
    "a damaged checkpoint": ("interrupted", damage, [], "is damaged: record archive/data/"),
    "a live owner": ("running", None, [], "is running in another process (pid "),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_a_refused_start_leaves_every_file_as_it_was(completed, tmp_path, case):
    status, breakage, overrides, message = REFUSALS[case]
    run_dir = copy_of(completed, tmp_path, status)
    if breakage is not None:
        breakage(run_dir / "checkpoint.pth")
    if case == "a live owner":
        held_by_a_live_process(run_dir)
    before = digest(run_dir)
    with pytest.raises(UserError, match="^[^\n]*$") as error:
        run(quick_cfg(*overrides), run_dir)
    assert message in str(error.value)
    assert digest(run_dir) == before


@pytest.mark.parametrize("breakage", [None, truncate])
def test_a_completed_run_is_not_run_again(completed, tmp_path, breakage):
    run_dir = copy_of(completed, tmp_path)
    if breakage is not None:
        breakage(run_dir / "checkpoint.pth")  # not needed: the run is done
    before = digest(run_dir)
    summary = run(quick_cfg(), run_dir)
    assert summary == read_summary(completed) and summary["status"] == "completed"
    assert digest(run_dir) == before


def test_the_same_command_continues_its_unfinished_run_and_appends(tmp_path, monkeypatch):
    """An interrupted run is continued in its own directory (its identity names it); its log is appended,
    not rewritten; the temporary files a killed writer left are removed."""
    monkeypatch.setenv("NORMEXP_OUTPUT_DIR", str(tmp_path))
    first = run_dir(OmegaConf.to_container(quick_cfg(epochs=2), resolve=True))
    assert first.parent == tmp_path / "classification"
    interrupted_in_epoch_2(quick_cfg(epochs=2), None, monkeypatch)
    assert read_summary(first)["status"] == "interrupted"
    logged = (first / "metrics.jsonl").read_bytes()
    stale = [first / ".summary.json.12345.0badc0de.tmp", first / "checkpoint.pth.tmp"]
    for path in stale:
        path.write_text("half written")

    summary = run(quick_cfg(epochs=2))
    assert summary["status"] == "completed" and read_summary(first)["status"] == "completed"
    assert [d.name for d in (tmp_path / "classification").iterdir()] == [first.name]
    assert (first / "metrics.jsonl").read_bytes().startswith(logged)
    assert [r["epoch"] for r in read_metrics(first) if "val/top1" in r] == [1, 2]
    assert not any(path.exists() for path in stale)
    assert not (first / "run.lock").exists()
    # the record covers both processes: the first start, each attempt, the wall time of all
    attempts = summary["attempts"]
    assert [a["status"] for a in attempts] == ["interrupted", "completed"]
    assert summary["started_at"] == attempts[0]["started_at"] <= attempts[1]["started_at"]
    assert summary["wall_time_s"] == pytest.approx(sum(a["wall_time_s"] for a in attempts), abs=0.011)
    assert attempts[0]["wall_time_s"] > 0 and attempts[1]["wall_time_s"] > 0


def test_a_killed_attempt_ends_at_its_last_write(completed, tmp_path):
    """A process killed mid-run recorded no end: the next attempt closes it at the record's last write."""
    run_dir = copy_of(completed, tmp_path, "running")
    summary = read_summary(run_dir)
    summary["attempts"] = [{"started_at": "2026-01-01T00:00:00+00:00", "status": "running"}]
    summary["started_at"] = "2026-01-01T00:00:00+00:00"
    (run_dir / "summary.json").write_text(json.dumps(summary))
    os.utime(run_dir / "checkpoint.pth", (1767225700, 1767225700))  # 2026-01-01 00:01:40 UTC
    for name in ("metrics.jsonl", "summary.json"):
        os.utime(run_dir / name, (1767225650, 1767225650))
    resumed = run(quick_cfg(), run_dir)
    killed, this = resumed["attempts"]
    assert killed["status"] == "interrupted" and "killed" in killed["error"]
    assert killed["finished_at"] == "2026-01-01T00:01:40+00:00" and killed["wall_time_s"] == 100.0
    assert resumed["started_at"] == "2026-01-01T00:00:00+00:00" and this["status"] == "completed"
    assert resumed["wall_time_s"] == pytest.approx(100.0 + this["wall_time_s"], abs=0.011)


def test_an_unfinished_run_of_the_same_name_but_another_config_is_named(completed, tmp_path, caplog):
    """A yaml edited after an interrupt: the same command starts afresh -- and says which unfinished run it
    does not continue, and why."""
    old = yaml.safe_load((completed / "config.yaml").read_text())
    old["trainer"]["lr"] = 0.004
    unfinished = run_dir(old, tmp_path)
    shutil.copytree(completed, unfinished)
    (unfinished / "config.yaml").write_text(yaml.safe_dump(old))
    summary = read_summary(unfinished)
    summary.update(status="interrupted", run_id=config_hash(old))
    (unfinished / "summary.json").write_text(json.dumps(summary))
    config = OmegaConf.to_container(quick_cfg(), resolve=True)
    fresh = run_dir(config, tmp_path)
    start, lock = claim(fresh, config, "auto")
    lock.release()
    assert start.kind == "fresh" and start.run_dir == fresh != unfinished
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert said == [f"not continuing the unfinished run of the same name in {unfinished} (interrupted): it "
                    f"differs in trainer.lr: 0.004 -> {config['trainer']['lr']}; this run starts afresh (set "
                    "those back to continue that one)"]


def test_a_lock_that_names_no_owner_is_no_obstacle(completed, tmp_path):
    """An empty or garbage run.lock (its writer died before writing it): a completed run needs no lock to say
    it is done, and an unfinished one takes the lock over once it is seconds old."""
    done = copy_of(completed, tmp_path / "done")
    (done / "run.lock").write_text("")
    assert run(quick_cfg(), done)["status"] == "completed"
    unfinished = copy_of(completed, tmp_path / "unfinished", "interrupted")
    (unfinished / "run.lock").write_text("\x00garbage")
    os.utime(unfinished / "run.lock", (1767225600, 1767225600))
    start, lock = claim(unfinished, OmegaConf.to_container(quick_cfg(), resolve=True), "auto")
    assert start.kind == "resume" and lock.owned()
    lock.release()


def test_ctrl_c_checkpoints_the_update_under_way_and_records_interrupted(tmp_path, monkeypatch):
    real_step = Trainer.optimizer_step

    def ctrl_c_at_update_5(self):
        real_step(self)
        if self.update == 5:
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(Trainer, "optimizer_step", ctrl_c_at_update_5)
    handler = signal.getsignal(signal.SIGINT)
    with pytest.raises(Interrupted) as stop:
        run(quick_cfg(epochs=2), tmp_path / "run")
    assert stop.value.signum == signal.SIGINT
    summary = read_summary(tmp_path / "run")
    assert summary["status"] == "interrupted" and summary["error"].startswith("SIGINT at step 5")
    from normexp.engine.checkpoint import load_checkpoint

    assert load_checkpoint(tmp_path / "run")["update"] == 5
    assert signal.getsignal(signal.SIGINT) is handler  # restored


def test_a_killed_run_reads_as_interrupted(completed, tmp_path):
    run_dir = copy_of(completed, tmp_path, "running")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    owner = {"host": socket.gethostname(), "pid": int(dead.stdout), "pid_start": None,
             "claimed_at": "2026-01-01T00:00:00+00:00"}
    (run_dir / "run.lock").write_text(json.dumps(owner))  # left by a kill -9
    assert effective_status(run_dir, read_summary(run_dir)) == "interrupted"
    assert index_records(tmp_path)[read_summary(run_dir)["run_id"]].status == "interrupted"
    held_by_a_live_process(run_dir)
    assert effective_status(run_dir, read_summary(run_dir)) == "running"


def test_one_process_holds_a_run_directory(tmp_path, monkeypatch):
    first = RunLock.acquire(tmp_path)
    with pytest.raises(RunBusy, match=f"pid {os.getpid()} on {socket.gethostname()}"):
        RunLock.acquire(tmp_path)
    first.release()
    assert not (tmp_path / "run.lock").exists()
    with RunLock.acquire(tmp_path) as second:
        assert read_owner(tmp_path).pid == os.getpid() and second.owned()

    # another host's lock: alive while its heartbeat is fresh, taken over once it is stale
    (tmp_path / "run.lock").write_text(json.dumps({"host": "elsewhere", "pid": 1, "pid_start": None,
                                                   "claimed_at": "2026-01-01T00:00:00+00:00"}))
    with pytest.raises(RunBusy, match="on elsewhere"):
        RunLock.acquire(tmp_path)
    monkeypatch.setattr(lock_module, "STALE_AFTER_S", 0.0)
    with RunLock.acquire(tmp_path):
        assert read_owner(tmp_path).host == socket.gethostname()


def test_a_runs_identity_names_its_directory(tmp_path):
    """Every process, requeue and repeated command computes the same directory from the config; what is not
    part of the identity (loggers, table marks) does not move it; another seed or trial= does."""
    config = OmegaConf.to_container(quick_cfg(), resolve=True)
    home = run_dir(config, tmp_path)
    assert home == tmp_path / "classification" / f"{config['name']}-{config_hash(config)[:8]}"
    assert run_dir({**config, "logger": {"wandb": {}}, "table": {"id": "t"}}, tmp_path) == home
    assert run_dir({k: v for k, v in config.items() if k != "trial"}, tmp_path) == home  # made before trial=
    others = {run_dir({**config, "seed": 1}, tmp_path), run_dir({**config, "trial": 1}, tmp_path)}
    assert len(others | {home}) == 3


def test_the_caller_learns_where_the_record_is_and_its_files_go_there_only_when_the_run_starts(tmp_path):
    """What the command reports (its record, or already done); Hydra's files beside the record."""
    files = {".hydra/overrides.yaml": "- seed=0\n"}
    started, again = Outcome(), Outcome()
    run(quick_cfg(), tmp_path / "run", outcome=started, beside=files)
    assert (started.run_dir, started.started) == (tmp_path / "run", True)
    assert (tmp_path / "run" / ".hydra" / "overrides.yaml").read_text() == "- seed=0\n"
    before = digest(tmp_path / "run")
    run(quick_cfg(), tmp_path / "run", outcome=again, beside={"other.yaml": "x"})
    assert (again.run_dir, again.started) == (tmp_path / "run", False) and digest(tmp_path / "run") == before


def test_json_is_written_through_a_synced_temporary_of_its_own(tmp_path, monkeypatch):
    """Two writers never share a temporary file, and the data is on disk before the rename."""
    synced, renamed = [], []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
    monkeypatch.setattr(os, "replace", lambda a, b: (renamed.append(Path(a)), real_replace(a, b)))
    write_json_atomic(tmp_path / "summary.json", {"a": 1})
    write_json_atomic(tmp_path / "summary.json", {"a": 2})
    assert json.loads((tmp_path / "summary.json").read_text()) == {"a": 2}
    assert len(synced) >= 4  # the file, then the directory, twice
    assert len(set(renamed)) == 2 and all(p.name != "summary.json.tmp" for p in renamed)
    assert not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob(".*.tmp"))


def test_a_normalizers_model_defaults_are_not_part_of_a_runs_identity():
    """norm.model_defaults only suggests model settings (DiT's zero_init, where its effect is kept): a DyT
    run made before the key existed is the same run."""
    config = OmegaConf.to_container(compose_cfg("norm=dyt"), resolve=True)
    assert config["norm"]["model_defaults"] == {"zero_init": "none"}
    before = {**config, "norm": {k: v for k, v in config["norm"].items() if k != "model_defaults"}}
    assert config_hash(config) == config_hash(before)


def test_an_option_added_later_is_part_of_a_runs_identity_only_when_set():
    """trainer.decay_epochs (sched=step's interval) came after runs were made: unset, a run made before it
    existed is the same run; set, another run."""
    config = OmegaConf.to_container(compose_cfg(), resolve=True)
    assert config["trainer"]["decay_epochs"] is None
    before = {**config, "trainer": {k: v for k, v in config["trainer"].items() if k != "decay_epochs"}}
    assert config_hash(config) == config_hash(before)
    stepped = OmegaConf.to_container(compose_cfg("trainer.decay_epochs=30"), resolve=True)
    assert config_hash(stepped) != config_hash(config)
