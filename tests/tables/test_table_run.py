"""A table end to end on the embedded digits: one Hydra multirun through the table sweeper, a diverging run
recorded as a result, a failing run that does not stop the others, re-runs that skip what is done, and
``normexp compare`` agreeing with the rendered table.

The ``table run``s call the command's entry point in-process (the runs they launch are still ``python -m
normexp`` multiruns; the command line itself: the slow two-planner test)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import ROOT

from normexp import compare
from normexp.tables import cli

SPEC = """
title: A tiny table
source: none
rows: [norm.name, norm.squash]
metrics:
  - {key: top1, label: Top-1, value: metrics.final.val/top1, fmt: .2f, delta: true}
baseline:
  - set: {norm.name: dyt, norm.squash: tanh}
blocks:
  - norm=dyt norm.squash=identity trainer.lr=0.05   # diverges within a few steps
  - norm=dyt norm.squash=tanh
  - norm=ln data.batch_size=5000                    # fails: the training set is smaller than one batch
"""
SCALE = """
description: one epoch of the digits demo at the digits' own 8 px
seeds: [0]
overrides:
  classification: [trainer.epochs=1, trainer.warmup_epochs=0, trainer.progress=false, logger=none,
                   data.img_size=8]
"""


def md_cells(text: str) -> dict[str, list[str]]:
    lines = [line for line in text.splitlines() if line.startswith("| ")][1:]
    return {" ".join(c[:2]): c for c in ([x.strip() for x in line.strip("|").split(" | ")] for line in lines)}


def in_process(capfd: pytest.CaptureFixture, main: Callable[[list[str]], None],
               *args: str) -> tuple[int, str]:
    """``main(args)``'s exit code and everything written to stdout and stderr (its subprocesses' included)."""
    try:
        main(list(args))
        code = 0
    except SystemExit as exited:
        code = exited.code
    out = capfd.readouterr()
    return code, out.out + out.err


def test_table_runs_skips_and_plans_what_is_missing(tmp_path, capfd, monkeypatch):
    """The output root is no plain ASCII word: its path reaches every job as one quoted override."""
    spec, scale, out = tmp_path / "tiny.yaml", tmp_path / "cpu1.yaml", tmp_path / "results"
    spec.write_text(SPEC)
    scale.write_text(SCALE)
    args = ("run", str(spec), "--scale", str(scale), "--out", str(out))
    root = tmp_path / "ünïcödé"

    monkeypatch.setenv("NORMEXP_OUTPUT_DIR", str(root))
    monkeypatch.setenv("WANDB_SILENT", "true")
    code, first = in_process(capfd, cli.main, *args)
    assert code == 1, first[-2000:]  # a run failed: the table is written all the same
    assert "hydra/sweeper=table" in first and "Launching 3 jobs" in first
    cells = md_cells((out / "cpu1" / "tiny.md").read_text())
    assert cells["dyt identity"][2].startswith("diverged@")
    assert int(cells["dyt identity"][2].removeprefix("diverged@")) <= 10
    top1 = cells["dyt tanh"][2]
    assert top1.endswith(" (1 run)") and 0 < float(top1.split()[0]) <= 100
    assert cells["ln None"][2].startswith("failed: UserError: the training set is smaller than one batch")
    for suffix in (".md", ".csv", ".tex", ".png", "_curves.png"):
        assert (out / "cpu1" / f"tiny{suffix}").stat().st_size > 0

    # without the failing block every run is done: nothing is launched
    spec.write_text(SPEC.replace("  - norm=ln data.batch_size=5000", "  # removed"))
    code, again = in_process(capfd, cli.main, *args)
    assert code == 0, again[-2000:]
    assert "2 done (skipped), 0 to run" in again and "hydra/sweeper=table" not in again

    code, compared = in_process(capfd, compare.main, "--table", str(spec), "--scale", str(scale))
    assert code == 0, compared
    rows = md_cells(compared)
    assert rows["dyt tanh"][3] == top1 and rows["dyt identity"][3] == "—"
    assert rows["dyt identity"][4] == "1 diverged"

    # a deleted record is planned again, and only that one (trained again: the slow test below)
    tanh, identity = record_dirs(root)
    shutil.rmtree(tanh)
    code, third = in_process(capfd, cli.main, *args, "--dry-run")
    assert code == 0, third[-2000:]
    assert "1 done (skipped), 1 to run" in third and "Launching" not in third


def record_dirs(root: Path) -> tuple[Path, Path]:
    """The tiny table's run directories: (DyT tanh, DyT identity)."""
    runs = [d for d in (root / "classification").iterdir() if (d / "config.yaml").is_file()]
    (tanh,) = [d for d in runs if "squash: tanh" in (d / "config.yaml").read_text()]
    (identity,) = [d for d in runs if "squash: identity" in (d / "config.yaml").read_text()]
    return tanh, identity


@pytest.mark.slow
def test_a_deleted_record_is_trained_again_to_the_same_numbers(tmp_path, capfd, monkeypatch):
    spec, scale, out = tmp_path / "tiny.yaml", tmp_path / "cpu1.yaml", tmp_path / "results"
    root = tmp_path / "root"
    spec.write_text(SPEC.replace("  - norm=ln data.batch_size=5000", "  # removed"))
    scale.write_text(SCALE)
    monkeypatch.setenv("NORMEXP_OUTPUT_DIR", str(root))
    monkeypatch.setenv("WANDB_SILENT", "true")
    args = ("run", str(spec), "--scale", str(scale), "--out", str(out))
    assert in_process(capfd, cli.main, *args)[0] == 0
    top1 = md_cells((out / "cpu1" / "tiny.md").read_text())["dyt tanh"][2]
    tanh, identity = record_dirs(root)
    before = (identity / "summary.json").stat().st_mtime_ns
    shutil.rmtree(tanh)
    code, again = in_process(capfd, cli.main, *args)
    assert code == 0, again[-2000:]
    assert "1 done (skipped), 1 to run" in again and "Launching 1 jobs" in again
    assert (tanh / "summary.json").is_file() and (identity / "summary.json").stat().st_mtime_ns == before
    assert md_cells((out / "cpu1" / "tiny.md").read_text())["dyt tanh"][2] == top1  # same seed, same numbers


PAIR = """
title: Two runs
source: none
rows: [norm.name]
metrics:
  - {key: top1, label: Top-1, value: metrics.final.val/top1, fmt: .2f}
blocks:
  - norm=ln,dyt
"""


@pytest.mark.slow
def test_two_planners_at_once_train_every_run_once(tmp_path):
    """Two `table run`s on one output root (two users, two SLURM array jobs): each job claims its run before
    it trains, so every run is trained once, and both planners end with the whole table."""
    spec, scale = tmp_path / "pair.yaml", tmp_path / "cpu1.yaml"
    spec.write_text(PAIR)
    scale.write_text(SCALE)
    env = {**os.environ, "NORMEXP_OUTPUT_DIR": str(tmp_path / "out"), "WANDB_SILENT": "true"}
    planners = [subprocess.Popen([sys.executable, "-m", "normexp", "table", "run", str(spec), "--scale",
                                  str(scale), "--out", str(tmp_path / f"results{i}")], cwd=ROOT, env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for i in range(2)]
    outputs = [p.communicate(timeout=1200)[0] for p in planners]
    assert [p.returncode for p in planners] == [0, 0], outputs
    runs = sorted((tmp_path / "out").glob("classification/*/summary.json"))
    assert len(runs) == 2
    for summary in runs:
        log = (summary.parent / "normexp.log").read_text()
        assert log.count("params, ") == 1, log  # trained once
        epochs = [r for r in map(json.loads, (summary.parent / "metrics.jsonl").read_text().splitlines())
                  if "val/top1" in r]
        assert len(epochs) == 1 and json.loads(summary.read_text())["status"] == "completed"
        assert not (summary.parent / "run.lock").exists()
    for i in range(2):
        cells = md_cells((tmp_path / f"results{i}" / "cpu1" / "pair.md").read_text())
        assert all(cells[row][1].endswith(" (1 run)") for row in cells), cells
