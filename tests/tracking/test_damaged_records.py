"""Damaged run records (``conftest.DAMAGES``): every reader goes through the one checked loader, processes the
good records and names each damaged one in one line; a start refuses one and leaves it as it was. A write cut
short (a full disk, a quota) keeps the failure in the record, and the next start continues the run."""

from __future__ import annotations

import errno
import json
import logging
import os
from types import SimpleNamespace

import pytest
import yaml
from conftest import DAMAGES, damaged_root, plant_record, quick_cfg
from test_start import digest

from normexp import compare, dashboard
from normexp.analysis.core import alpha_history, load_run
from normexp.errors import UserError
from normexp.run import run
from normexp.tables import cli as table_cli
from normexp.tables.sweep import print_launched
from normexp.tracking import records
from normexp.tracking.records import DamagedRecord, load_record, read_metrics, read_summary

IN_SUMMARY_OR_CONFIG = [name for name in DAMAGES if name != "a broken metrics line"]


def warned(caplog: pytest.LogCaptureFixture) -> str:
    return "\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)


@pytest.mark.parametrize("name", list(DAMAGES))
def test_the_loader_says_what_is_wrong_in_one_line(completed, tmp_path, name):
    run_dir = plant_record(completed, tmp_path / "run", damage=name)
    message = DAMAGES[name][1]
    if name in IN_SUMMARY_OR_CONFIG:
        damage = load_record(run_dir, with_config=True).damage
    else:  # the log is read by those who need it
        with pytest.raises(DamagedRecord) as error:
            read_metrics(run_dir)
        damage = str(error.value)
    assert message in damage and "\n" not in damage


def test_compare_and_the_dashboard_import_the_good_records_and_name_the_damaged(completed, tmp_path, capsys,
                                                                                caplog):
    planted = damaged_root(completed, tmp_path / "out")
    compare.main(["--root", str(tmp_path / "out")])
    table = capsys.readouterr().out
    assert "| vit_micro | ln | 2 |" in table  # the good record and the one whose log alone is damaged
    for name in IN_SUMMARY_OR_CONFIG:
        assert f"{planted[name]}: {DAMAGES[name][1]}" in warned(caplog), name
    caplog.clear()

    dashboard.main(["--root", str(tmp_path / "out"), "--no-serve", "--store", f"sqlite:///{tmp_path}/m.db"])
    assert f"records under {tmp_path / 'out'}: 1 imported, 0 already in the store" in capsys.readouterr().out
    for name, run_dir in planted.items():
        if name != "good":
            assert f"skipping the damaged run record {run_dir}: {DAMAGES[name][1]}" in warned(caplog), name


SPEC = """
title: One row, a seed per record
source: none
rows: [norm.name]
metrics:
  - {key: top1, label: Top-1, value: metrics.final.val/top1, fmt: .2f}
blocks: [norm=ln]
"""
SCALE = """
description: the records of quick_cfg(), a seed each
seeds: [0, 1, 2, 3, 4, 5, 6, 7, 8]
overrides:
  classification: [logger=none, data.img_size=8, trainer.epochs=1, trainer.warmup_epochs=0,
                   trainer.progress=false, trainer.log_interval=10]
"""


def test_a_table_shows_damaged_records_as_damaged_and_launches_nothing(completed, tmp_path, capsys, caplog,
                                                                      monkeypatch):
    spec, scale, out = tmp_path / "seeds.yaml", tmp_path / "records.yaml", tmp_path / "results"
    spec.write_text(SPEC)
    scale.write_text(SCALE)
    monkeypatch.setenv("NORMEXP_OUTPUT_DIR", str(tmp_path / "out"))
    plan = table_cli.make_plan(str(spec), str(scale), None, [])
    for planned, name in zip(plan.runs, [None, *DAMAGES], strict=True):  # seed 0 good, a damage per seed
        plant_record(completed, planned.dir, planned.config, damage=name)

    with pytest.raises(SystemExit) as exited:
        table_cli.main(["run", str(spec), "--scale", str(scale), "--out", str(out)])
    assert exited.value.code == 1  # runs without a result
    said = capsys.readouterr()
    assert "0 to run, 0 blocked, 7 damaged" in said.out and "hydra/sweeper=table" not in said.out
    for planned, name in zip(plan.runs[1:], DAMAGES, strict=True):
        at = planned.dir
        if name in IN_SUMMARY_OR_CONFIG:
            assert f"damaged ln (seed {planned.points[0].seed}): {at}: {DAMAGES[name][1]}" in said.out
        else:  # its summary holds the result; the curves leave its log out, and say so
            assert f"skipping the metrics of {at}: {DAMAGES[name][1]}" in warned(caplog)
    table = (out / "records" / "seeds.md").read_text()  # the scale's own folder
    row = next(line for line in table.splitlines() if line.startswith("| ln |"))
    assert row.count("damaged") == 7 and " (2)" in row and "missing" not in row

    # a job the sweeper launched that refused a damaged record: its line says so, no traceback
    damaged = plan.runs[1]
    refusal = DamagedRecord(damaged.dir, DAMAGES["summary is a list"][1])
    print_launched(plan, [damaged], [SimpleNamespace(_return_value=refusal)])
    line = capsys.readouterr().out.splitlines()[0]
    assert line.split()[0] == "damaged" and "(run record" in line and "summary.json holds a list" in line


@pytest.mark.parametrize("name", IN_SUMMARY_OR_CONFIG)
def test_analyze_names_a_damaged_record_in_one_line(completed, tmp_path, name):
    with pytest.raises(UserError) as error:
        load_run(plant_record(completed, tmp_path / "run", damage=name))
    assert DAMAGES[name][1] in str(error.value) and "\n" not in str(error.value)


def test_analyze_reads_around_a_damaged_log(completed, tmp_path, caplog):
    run_dir = plant_record(completed, tmp_path / "run", damage="a broken metrics line")
    assert alpha_history(run_dir) == {}
    assert DAMAGES["a broken metrics line"][1] in warned(caplog)


@pytest.mark.parametrize("status,name", [("interrupted", name) for name in DAMAGES]
                         + [("completed", "metrics not a mapping")])
def test_a_start_refuses_a_damaged_record_and_leaves_it_as_it_was(completed, tmp_path, status, name):
    """Also a completed record: "already completed" needs a summary that reads back."""
    run_dir = plant_record(completed, tmp_path / "run", status=status, damage=name)
    before = digest(run_dir)
    with pytest.raises(UserError) as error:
        run(quick_cfg(), run_dir)
    assert DAMAGES[name][1] in str(error.value) and "\n" not in str(error.value)
    assert digest(run_dir) == before


# ---------------------------------------------------------------- a write cut short
class FullAfter:
    """``os`` for the records module, whose ``write`` to the metrics log stops short once ``budget`` bytes
    are written -- a partial write, then EFBIG -- as a file-size limit or a full disk does."""

    def __init__(self, budget: int) -> None:
        self.budget = budget

    def write(self, fd: int, data: memoryview) -> int:
        if self.budget <= 0:
            raise OSError(errno.EFBIG, os.strerror(errno.EFBIG))
        written = os.write(fd, data[: self.budget])
        self.budget -= written
        return written

    def __getattr__(self, name: str):
        return getattr(os, name)


def test_a_write_cut_short_keeps_the_failure_and_the_next_start_continues(completed, tmp_path, monkeypatch,
                                                                          caplog):
    run_dir = tmp_path / "run"
    first_epoch = (completed / "metrics.jsonl").stat().st_size  # about what one epoch logs
    monkeypatch.setattr(records, "os", FullAfter(budget=first_epoch + 40))
    with pytest.raises(OSError, match="File too large"):
        run(quick_cfg(epochs=2), run_dir)
    monkeypatch.undo()
    failed = read_summary(run_dir)
    assert failed["status"] == "failed" and f"{run_dir / 'metrics.jsonl'}" in failed["error"]
    assert not (run_dir / "metrics.jsonl").read_bytes().endswith(b"\n")  # half a row at the end
    rows = read_metrics(run_dir)  # every reader: the half row dropped, with a warning
    assert rows and "dropped the unterminated last line of metrics.jsonl" in warned(caplog)

    summary = run(quick_cfg(epochs=2), run_dir)  # the same command, once there is room
    assert summary["status"] == "completed" and "error" not in summary
    assert [a["status"] for a in summary["attempts"]] == ["failed", "completed"]
    assert summary["attempts"][0]["error"] == failed["error"]  # why the first attempt ended stays
    logged = (run_dir / "metrics.jsonl").read_text()
    assert logged.endswith("\n") and [json.loads(line)["epoch"] for line in logged.splitlines()
                                      if "val/top1" in line] == [1, 2]
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["trainer"]["epochs"] == 2


def test_a_whole_row_without_its_newline_is_kept_and_the_file_mended(completed, tmp_path):
    run_dir = plant_record(completed, tmp_path / "run", status="interrupted")
    text = (run_dir / "metrics.jsonl").read_text()
    (run_dir / "metrics.jsonl").write_text(text.rstrip("\n"))  # cut exactly before the last newline
    assert read_metrics(run_dir) == [json.loads(line) for line in text.splitlines()]
    summary = run(quick_cfg(), run_dir)  # resumes from the end-of-training checkpoint: appends nothing
    assert summary["status"] == "completed" and (run_dir / "metrics.jsonl").read_text() == text
