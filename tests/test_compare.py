"""``normexp compare`` over fabricated run records: filters, tags, grouping, mean and t interval (n), deltas
against a baseline group, formats."""

from __future__ import annotations

import csv
import io
import json

import pytest
import yaml

from normexp.compare import main

RUNS = [  # (backbone, norm, seed, status, top1)
    ("vit_small", "ln", 0, "completed", 80.0), ("vit_small", "ln", 1, "completed", 82.0),
    ("vit_small", "dyt", 0, "completed", 81.0), ("vit_small", "dyt", 1, "diverged", None),
    ("swin_tiny", "dyt", 0, "completed", 83.0), ("swin_tiny", "ln", 0, "failed", None),
]


@pytest.fixture
def root(tmp_path):
    for i, (backbone, norm, seed, status, top1) in enumerate(RUNS):
        run_dir = tmp_path / "classification" / f"run{i}"
        run_dir.mkdir(parents=True)
        config = {"backbone": {"name": backbone}, "norm": {"name": norm}, "task": {"name": "classification"},
                  "data": {"name": "digits"}, "seed": seed, "tags": ["paper"] if norm == "dyt" else []}
        (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
        final = {"val/top1": top1} if top1 is not None else {}
        (run_dir / "summary.json").write_text(json.dumps(
            {"run_id": f"r{i}", "status": status, "seed": seed, "params": 1000 + i,
             "metrics": {"final": final}, "started_at": f"2026-01-01T00:00:0{len(RUNS) - i}+00:00"}))
    return tmp_path


def test_groups_filters_and_counts(root, capsys):
    main(["--root", str(root), "backbone.name=vit_*"])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert lines[0] == "| backbone.name | norm.name | runs | val/top1 | val/top5 | not completed |"
    assert lines[1] == "| vit_small | ln | 2 | 81 ± 12.71 (2) | — |  |"  # t(0.975, 1 df) x 1.414 / sqrt 2
    assert lines[2] == "| vit_small | dyt | 2 | 81 (1 run) | — | 1 diverged |"
    assert len(lines) == 3  # swin filtered out


def test_groups_in_order_of_their_first_start(root, capsys):
    main(["--root", str(root), "--sort", "started"])
    lines = [line.split(" | ")[:2] for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert lines[1:] == [["| swin_tiny", "ln"], ["| swin_tiny", "dyt"], ["| vit_small", "dyt"],
                         ["| vit_small", "ln"]]  # the runs started last-listed first


def test_tags_metrics_and_csv(root, capsys):
    main(["--root", str(root), "--tag", "paper", "--group-by", "norm.name", "--metrics", "val/top1,params",
          "--format", "csv"])
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert [r["norm.name"] for r in rows] == ["dyt"]
    assert float(rows[0]["val/top1_mean"]) == 82.0 and rows[0]["val/top1_n"] == "2"
    assert float(rows[0]["val/top1_ci95"]) == pytest.approx(12.706205 * 1.0, abs=1e-5)  # seeds 0, 0: 81, 83
    assert rows[0]["not completed"] == "1 diverged"


def test_no_match_is_one_line(root, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--root", str(root), "norm.name=power"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().startswith("error: no run records match")


def test_baseline_deltas_are_paired_by_seed(root, capsys):
    """Two more DyT seeds on ViT-S: DyT {0: 81, 1: 84} against LN {0: 80, 1: 82} -> differences 1 and 2,
    paired: +1.5 ± 6.35 (t with 1 df), within noise; Swin's LN failed: no delta."""
    path = root / "classification" / "run3" / "summary.json"
    summary = json.loads(path.read_text())
    summary.update(status="completed", metrics={"final": {"val/top1": 84.0}})
    path.write_text(json.dumps(summary))
    main(["--root", str(root), "--baseline", "norm.name=ln", "--metrics", "val/top1", "--format", "csv"])
    out = io.StringIO(capsys.readouterr().out)
    rows = {(r["backbone.name"], r["norm.name"]): r for r in csv.DictReader(out)}
    dyt = rows["vit_small", "dyt"]
    assert float(dyt["val/top1_delta"]) == 1.5 and dyt["val/top1_delta_test"] == "paired"
    assert float(dyt["val/top1_delta_ci95"]) == pytest.approx(12.706205 * 0.5, abs=1e-5)
    assert dyt["val/top1_within_noise"] == "≈"
    assert rows["vit_small", "ln"]["val/top1_delta"] == ""  # the baseline itself
    assert rows["swin_tiny", "dyt"]["val/top1_delta"] == ""  # its LN failed
    main(["--root", str(root), "--baseline", "norm.name=ln", "--metrics", "val/top1"])
    out = capsys.readouterr().out
    assert "| vit_small | dyt | 2 | 82.5 ± 19.06 (2) | +1.5 ± 6.353 ≈ |  |" in out and "paired by seed" in out
    with pytest.raises(SystemExit):
        main(["--root", str(root), "--baseline", "task.name=x"])
    assert "not one of the groups' keys" in capsys.readouterr().err


@pytest.mark.parametrize(("baseline", "says"), [
    ("norm.name=LN", "names none of the groups' norm.name values (dyt, ln): name one, e.g. --baseline "
                     "norm.name=dyt"),
    ("backbone.name=*", "names several of the groups' backbone.name values (swin_tiny, vit_small): name one, "
                        "e.g. --baseline backbone.name=swin_tiny")])
def test_a_baseline_naming_no_group_or_several_is_one_line(root, capsys, baseline, says):
    with pytest.raises(SystemExit) as exit_info:
        main(["--root", str(root), "--baseline", baseline])
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert captured.err == f"error: --baseline {baseline} {says}\n" and captured.out == ""


def test_a_baseline_pattern_naming_one_group_is_that_group(root, capsys):
    main(["--root", str(root), "--baseline", "norm.name=l*", "--metrics", "val/top1", "--format", "csv"])
    out = io.StringIO(capsys.readouterr().out)
    rows = {(r["backbone.name"], r["norm.name"]): r for r in csv.DictReader(out)}
    assert float(rows["vit_small", "dyt"]["val/top1_delta"]) == 0.0  # 81 against LN's 80 and 82 (Welch)


def test_non_finite_and_overflowing_values_are_read_not_a_crash(root, capsys, caplog):
    """Older records holding NaN / Infinity read as diverged, each named with its seed; values of 1e308,
    whose sum overflows, still have their mean (and an infinite interval where the spread overflows)."""
    for i, top1 in ((0, "NaN"), (1, "Infinity")):  # vit_small / ln, seeds 0 and 1
        path = root / "classification" / f"run{i}" / "summary.json"
        path.write_text(path.read_text().replace('"val/top1": 8', f'"val/top1": {top1}, "x": 8'))
    for i, top1 in ((2, 1.7e308), (3, -1.7e308)):  # vit_small / dyt, seeds 0 and 1
        path = root / "classification" / f"run{i}" / "summary.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "status": "completed",
                                    "metrics": {"final": {"val/top1": top1}}}))
    main(["--root", str(root), "backbone.name=vit_small", "--metrics", "val/top1"])
    out = capsys.readouterr().out
    assert "| vit_small | ln | 2 | — | 2 diverged |" in out
    assert "| vit_small | dyt | 2 | 0 ± inf (2) |  |" in out
    for i, (seed, value) in enumerate(((0, "nan"), (1, "inf"))):
        assert f"run{i} (seed {seed}) holds non-finite metrics (final.val/top1 = {value}): read as diverged" \
            in caplog.text
    main(["--root", str(root), "--group-by", "backbone.name", "--baseline", "backbone.name=swin_tiny"])
    assert "| vit_small | 4 | 0 ± inf (2) | -83 | — | — | 2 diverged |" in capsys.readouterr().out


MY_TABLES = {  # a user's own pre-training table, and a table fine-tuning from it (task.pretrained=table:)
    "mine_pre": "rows: [norm.name]\nmetrics: [{key: loss, value: metrics.final.val/loss}]\n"
                "blocks: ['experiment=mae_pretrain norm=dyt']\n",
    "mine": "rows: [norm.name]\nmetrics: [{key: top1, value: metrics.reported.top1, fmt: .1f}]\n"
            "blocks: ['experiment=mae_finetune norm=dyt task.pretrained=table:mine_pre']\n",
}


def test_compare_reads_a_users_own_chained_table_as_table_run_finds_it(tmp_path, capsys):
    """``compare --table mine hydra.searchpath=[...]`` (as ``table run`` takes it) and ``--table <spec
    file>`` (its linked table found beside it) read the records of the user's chained table."""
    from normexp.tables.cli import make_plan

    (tmp_path / "configs" / "table").mkdir(parents=True)
    for table, text in MY_TABLES.items():
        (tmp_path / "configs" / "table" / f"{table}.yaml").write_text(text)
    searchpath, root = f"hydra.searchpath=[file://{tmp_path}/configs]", tmp_path / "outputs"
    results = {"mine_pre": {"final": {"val/loss": 0.5}}, "mine": {"reported": {"top1": 70.0}}}
    for table, metrics in results.items():
        for run in make_plan(table, "smoke", None, [searchpath], root).runs:
            assert not run.blocked, run.blocked  # the fine-tune: once its pre-training has a record
            run.dir.mkdir(parents=True)
            (run.dir / "config.yaml").write_text(yaml.safe_dump(run.config))
            (run.dir / "summary.json").write_text(json.dumps({"run_id": run.run_id, "status": "completed",
                                                              "seed": 0, "metrics": metrics}))
    spec_file = str(tmp_path / "configs" / "table" / "mine.yaml")
    for where in (["--table", "mine", searchpath], ["--table", spec_file]):
        main([*where, "--root", str(root), "--format", "csv"])
        rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
        assert [(r["norm.name"], r["top1_mean"]) for r in rows] == [("dyt", "70.0")], where
    with pytest.raises(SystemExit) as exit_info:
        main(["--root", str(root), searchpath])
    assert exit_info.value.code == 2 and "only with --table" in capsys.readouterr().err
