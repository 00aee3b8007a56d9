"""File-system trouble a user fixes -- an output root that is a file, read-only storage, a full disk -- is one
line (what, where, what to do), exit code 2, and changes nothing; ``analyze`` writes what collaborators can
read and cleans up after a killed analyze."""

from __future__ import annotations

import errno
import os
import resource
import socket
import stat
import subprocess
import time
from pathlib import Path

import pytest
import torch
from conftest import plant_record, quick_cfg, run_cli

from normexp import dashboard
from normexp.analysis import cli as analyze_cli
from normexp.engine.checkpoint import load_checkpoint
from normexp.errors import UserError, storage_error
from normexp.run import run
from normexp.tracking.records import read_summary


@pytest.fixture
def read_only():
    """Makes a directory read-only storage: a read-only bind mount (permissions do not stop root), else the
    write permissions taken away. Undone at teardown."""
    mounts, chmodded = [], []

    def make(path: Path) -> Path:
        if os.geteuid() == 0:
            for args in (["mount", "--bind", str(path), str(path)],
                         ["mount", "-o", "remount,bind,ro", str(path)]):
                done = subprocess.run(args, capture_output=True, text=True)
                if done.returncode != 0:
                    if mounts or args[1] == "-o":
                        subprocess.run(["umount", str(path)], check=False)
                    pytest.skip(f"read-only storage: root cannot bind-mount here ({done.stderr.strip()})")
                if args[1] == "--bind":
                    mounts.append(path)
        else:
            for p in [path, *path.rglob("*")]:
                chmodded.append((p, p.stat().st_mode))
                p.chmod(p.stat().st_mode & ~0o222)
        return path

    yield make
    for path in reversed(mounts):
        subprocess.run(["umount", str(path)], check=False)
    for path, mode in reversed(chmodded):
        path.chmod(mode)


def one_line(error: BaseException) -> str:
    text = str(error)
    assert "\n" not in text
    return text


def test_an_output_root_that_is_a_file_is_one_line_and_exit_2(tmp_path):
    root = tmp_path / "outputs"
    root.write_text("not a directory")
    out = run_cli("logger=none", env={"NORMEXP_OUTPUT_DIR": str(root)})
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert out.stderr.strip().splitlines() == [f"error: '{root}' is a file where a directory is needed: move "
                                               "it away, or give an output root you can write: "
                                               "NORMEXP_OUTPUT_DIR=<dir>"]
    assert root.read_text() == "not a directory"


def test_read_only_storage(completed, tmp_path, read_only, capsys):
    """A new run on it is one line; a run it holds that is done is done (no lock needed to say so); one that
    is not is one line; analyze and the dashboard say where else to write."""
    done = plant_record(completed, tmp_path / "ro" / "done")
    unfinished = plant_record(completed, tmp_path / "ro" / "unfinished", status="interrupted")
    read_only(tmp_path / "ro")
    with pytest.raises(UserError) as error:
        run(quick_cfg(), tmp_path / "ro" / "new")
    assert one_line(error.value) == (f"Read-only file system: '{tmp_path / 'ro' / 'new'}': give an output "
                                     "root you can write: NORMEXP_OUTPUT_DIR=<dir>")
    assert run(quick_cfg(), done) == read_summary(completed)
    with pytest.raises(UserError) as error:
        run(quick_cfg(), unfinished)
    assert one_line(error.value).startswith(f"Read-only file system: '{unfinished / 'run.lock'}'")

    with pytest.raises(UserError) as error:
        analyze_cli.analyze(done, ["tokens"], images=2, seed=0)
    assert one_line(error.value).endswith("': write the analysis elsewhere: --out <dir>")
    with pytest.raises(SystemExit) as exited:
        dashboard.main(["--root", str(tmp_path / "ro"), "--no-serve"])
    assert exited.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: Read-only file system: '{tmp_path / 'ro' / 'mlflow'}': give a store you can write: --store "
        "sqlite:////<writable dir>/mlflow.db, or a server's URL"]


def test_analyze_writes_what_collaborators_read_and_removes_what_killed_ones_left(completed, tmp_path):
    run_dir = plant_record(completed, tmp_path / "run")
    host = socket.gethostname()
    killed = run_dir / f".analysis-999999999-0badc0-{host}"  # a pid that does not run
    older = run_dir / ".analysis-k2j3h4"  # what an analyze before pids were in the name left
    alive = run_dir / f".analysis-{os.getpid()}-c0ffee-{host}"  # an analyze running now
    for path in (killed, older, alive):
        path.mkdir()
    os.utime(older, (time.time() - 7200,) * 2)
    umask = os.umask(0o022)
    try:
        out, _ = analyze_cli.analyze(run_dir, ["tokens"], images=2, seed=0)
    finally:
        os.umask(umask)
    assert stat.S_IMODE(out.stat().st_mode) == 0o755  # what the umask gives, as the run's own files
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o644 for p in out.iterdir())
    assert not killed.exists() and not older.exists() and alive.exists()


def test_a_file_size_limit_during_a_checkpoint_keeps_the_last_one_and_the_run_continues(tmp_path,
                                                                                       monkeypatch):
    """``ulimit -f`` (as a quota or a full disk) while the second epoch's checkpoint is written."""
    real_save, saves = torch.save, []

    def limited_at_the_second(state, f, *args, **kwargs):
        saves.append(f)
        if len(saves) != 2:
            return real_save(state, f, *args, **kwargs)
        limits = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, limits[1]))  # this process's writes, for a moment
        try:
            return real_save(state, f, *args, **kwargs)
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, limits)

    monkeypatch.setattr(torch, "save", limited_at_the_second)
    run_dir = tmp_path / "run"
    with pytest.raises(OSError) as error:
        run(quick_cfg(epochs=2), run_dir)
    assert error.value.errno == errno.EFBIG  # what the file system said, not torch's RuntimeError
    assert one_line(storage_error(error.value)) == (
        f"File too large: '{run_dir / 'checkpoint.pth'}': free space (or raise the quota or the file-size "
        "limit), then run the same command again (a run continues from its last checkpoint)")
    assert read_summary(run_dir)["status"] == "failed"
    assert load_checkpoint(run_dir)["epoch"] == 1  # the first epoch's, whole
    assert not [p for p in run_dir.iterdir() if p.name.endswith(".tmp")]
    monkeypatch.undo()
    summary = run(quick_cfg(epochs=2), run_dir)  # once there is room
    assert summary["status"] == "completed"
    assert [a["status"] for a in summary["attempts"]] == ["failed", "completed"]
