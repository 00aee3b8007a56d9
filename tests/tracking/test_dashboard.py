"""``normexp dashboard`` as a process: a taken port is one line before anything is written, and the MLflow
server and everything it started end with the dashboard."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT

from normexp import dashboard


@pytest.fixture
def taken_port():
    """A port something listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_a_taken_port_is_one_line_and_exit_2_before_anything_is_written(tmp_path, taken_port, capsys):
    with pytest.raises(SystemExit) as exited:
        dashboard.main(["--root", str(tmp_path), "--port", str(taken_port)])
    assert exited.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: port {taken_port} on 127.0.0.1 is in use (another dashboard?): give another --port, or stop "
        "what listens there"]
    assert not any(tmp_path.iterdir())  # no store was made


def test_without_port_the_next_free_one_is_taken_and_said(taken_port, monkeypatch, capsys):
    monkeypatch.setattr(dashboard, "DEFAULT_PORT", taken_port)
    port = dashboard.choose_port("127.0.0.1", None)
    assert port != taken_port and dashboard.port_free("127.0.0.1", port)
    assert capsys.readouterr().out == f"port {taken_port} is in use: serving on {port}\n"


def _state(pid: int) -> str | None:
    """A process's state letter (``Z``: a zombie), None when it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def alive(pid: int) -> bool:
    return _state(pid) not in (None, "Z")


def descendants(pid: int) -> set[int]:
    """The live processes below ``pid``."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return {p for p in found if alive(p)}


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="lists processes through /proc (Linux)")
def test_sigterm_ends_the_server_and_everything_it_started(tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    process = subprocess.Popen([sys.executable, "-m", "normexp", "dashboard", "--root", str(tmp_path),
                                "--port", str(port)], cwd=ROOT, stdout=subprocess.DEVNULL)
    started: set[int] = set()
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and dashboard.port_free("127.0.0.1", port):
            time.sleep(0.5)
        time.sleep(3)  # the server starts its task queue's workers after it listens
        started = descendants(process.pid)
        assert len(started) >= 2, "the MLflow server and uvicorn at least"
        process.send_signal(signal.SIGTERM)  # to the dashboard alone, as a job scheduler or `kill` sends it
        process.wait(timeout=60)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(alive(pid) for pid in started):
            time.sleep(0.2)
        assert not [pid for pid in started if alive(pid)], "still running after the dashboard ended"
        assert dashboard.port_free("127.0.0.1", port)
    finally:  # never leave them behind, even when the test fails
        for pid in [process.pid, *started]:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
