"""Chained tables (``task.pretrained=table:<id>``): a fine-tune names the run it starts from by run id
(``run:<run_id>``), found under the output root when it starts -- any root path, moved or mounted elsewhere,
is the same run; a pre-training that diverged is the fine-tune's result, and nothing is launched; a
``table:`` link outside a table spec is one line. Planned in-process on planted records."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import compose_cfg, plant_record

from normexp.errors import UserError
from normexp.run import run
from normexp.tables import cli
from normexp.tables.aggregate import aggregate, marker
from normexp.tables.plan import SOURCE_DIVERGED, TablePlan, resolved
from normexp.tasks import prepare_config
from normexp.tracking.provenance import config_hash
from normexp.tracking.run_dir import find_run
from normexp.tracking.run_dir import run_dir as directory_of

PRE = """
title: pre-training
rows: [norm.name]
metrics: [{key: top1, label: Top-1, value: metrics.final.val/top1}]
blocks: ["norm=dyt"]
"""
FINE = """
title: fine-tuning
rows: [norm.name]
metrics: [{key: top1, label: Top-1, value: metrics.final.val/top1}]
blocks: ["norm=dyt task.pretrained=table:pre"]
"""
SCALE = """
description: the digits at 8 px, one epoch
seeds: [0]
overrides:
  classification: [trainer.epochs=1, trainer.warmup_epochs=0, trainer.progress=false, logger=none,
                   data.img_size=8]
"""


@pytest.fixture
def chained(tmp_path: Path) -> tuple[Path, list[str]]:
    """The configs directory of the two tables and a scale, and the override that finds them."""
    configs = tmp_path / "configs"
    for name, text in (("table/pre", PRE), ("table/fine", FINE), ("scale/tiny", SCALE)):
        (configs / f"{name}.yaml").parent.mkdir(parents=True, exist_ok=True)
        (configs / f"{name}.yaml").write_text(text)
    return configs, [f"hydra.searchpath=[file://{configs}]"]


def plans(extra: list[str], root: Path) -> tuple[TablePlan, TablePlan]:
    return (cli.make_plan("pre", "tiny", None, extra, root=root),
            cli.make_plan("fine", "tiny", None, extra, root=root))


def test_a_chained_run_names_its_source_by_run_id_on_any_root(chained, tmp_path, completed, monkeypatch):
    _, extra = chained
    root = tmp_path / "Résultats, lr=1"  # Hydra's grammar takes none of 'é', ',' or '=' unquoted
    pre, fine = plans(extra, root)
    (source,), (blocked,) = pre.runs, fine.runs
    assert blocked.blocked and blocked.needs == "pre" and blocked not in fine.to_run()
    plant_record(completed, source.dir, source.config)

    _, fine = plans(extra, root)
    (tuned,) = fine.runs
    assert f"task.pretrained=run:{source.run_id}" in tuned.overrides and fine.to_run() == [tuned]
    assert tuned.config["task"]["pretrained"] == f"run:{source.run_id}"

    moved = tmp_path / "moved"  # the same records elsewhere: the same runs, nothing to run again
    shutil.copytree(root, moved)
    _, fine_moved = plans(extra, moved)
    assert [r.run_id for r in fine_moved.runs] == [tuned.run_id]
    assert find_run(source.run_id, moved) == moved / source.dir.relative_to(root)

    # the job finds its source under its output root and has the identity the planner gave it
    monkeypatch.setenv("NORMEXP_OUTPUT_DIR", str(moved))
    job = prepare_config(compose_cfg(*tuned.overrides, *extra))
    assert job.norm.name == "dyt" and config_hash(tuned.config) == tuned.run_id
    monkeypatch.setenv("NORMEXP_OUTPUT_DIR", str(tmp_path / "elsewhere"))
    with pytest.raises(UserError, match=f"run:{source.run_id}: no run with that id under the output root"):
        prepare_config(compose_cfg(*tuned.overrides, *extra))


def test_a_fine_tune_recorded_under_its_sources_directory_is_not_trained_again(chained, tmp_path, completed):
    _, extra = chained
    root = tmp_path / "out"
    pre, _ = plans(extra, root)
    (source,) = pre.runs
    plant_record(completed, source.dir, source.config)
    _, fine = plans(extra, root)
    (tuned,) = fine.runs
    # as planners before run:<run_id> links recorded it: the source's directory in its identity
    located = [f"task.pretrained={source.dir}" if o.startswith("task.pretrained=") else o
               for o in tuned.overrides]
    earlier = resolved(prepare_config(compose_cfg(*located)))
    plant_record(completed, directory_of(earlier, root), earlier)

    _, fine = plans(extra, root)
    (adopted,) = fine.runs
    assert adopted.dir == directory_of(earlier, root) != tuned.dir and adopted.run_id == config_hash(earlier)
    assert adopted.status == "completed" and fine.to_run() == []


def test_a_diverged_pre_training_is_the_fine_tunes_result_and_nothing_is_launched(
        chained, tmp_path, completed, capfd, monkeypatch):
    _, extra = chained
    monkeypatch.setenv("NORMEXP_OUTPUT_DIR", str(tmp_path / "out"))
    (source,) = cli.make_plan("pre", "tiny", None, extra).runs
    plant_record(completed, source.dir, source.config, status="diverged")
    summary = json.loads((source.dir / "summary.json").read_text())
    (source.dir / "summary.json").write_text(json.dumps({**summary, "diverged": {"step": 7, "epoch": 1}}))

    fine = cli.make_plan("fine", "tiny", None, extra)
    (tuned,) = fine.runs
    assert tuned.status == SOURCE_DIVERGED and tuned.done and fine.to_run() == [] and not fine.blocked()
    assert marker(tuned) == "pre-training diverged@7"
    assert aggregate(fine).rows[0].cells["top1"].diverged == [0]

    launched = []
    monkeypatch.setattr(cli.subprocess, "run", lambda *a, **kw: launched.append(a))
    with pytest.raises(SystemExit) as exited:
        cli.main(["run", "fine", "--scale", "tiny", "--out", str(tmp_path / "tables"), *extra])
    out = capfd.readouterr().out
    assert exited.value.code == 0 and launched == []
    assert "| pre-training diverged@7 |" in out and "nothing to start from" in out
    assert not tuned.dir.exists()


def test_a_table_link_outside_a_table_spec_is_one_line(run_dir):
    with pytest.raises(UserError) as refused:
        run(compose_cfg("logger=none", "task.pretrained=table:dtn_backbones"), run_dir)
    assert str(refused.value) == ("'table:dtn_backbones': a table:<id> link works only inside a table spec's "
                                  "blocks (normexp table run); give a run directory, a checkpoint file or "
                                  "run:<run_id>")
    assert not run_dir.exists()
