"""Non-finite metrics: written as strict JSON (null) with the run diverged and the reason; an older record
holding JSON's non-standard NaN / Infinity is read the same way, with a warning naming it."""

from __future__ import annotations

import json
import logging

from normexp.tracking.records import RunRecord, read_summary


def strict_json(text: str) -> object:
    def refuse(constant: str) -> None:
        raise ValueError(f"non-standard JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def test_a_non_finite_metric_is_written_as_null_and_the_run_diverges_where_it_was(tmp_path):
    record = RunRecord(tmp_path / "run", {"seed": 0})
    record.log({"step": 40, "epoch": 2, "train/loss": 0.5})
    record.update(metrics={"final": {"val/top1": float("nan"), "val/loss": float("inf"), "epoch": 2},
                           "best": {"val/top1": 12.5}})
    summary = record.finish("completed")
    written = strict_json((tmp_path / "run" / "summary.json").read_text())
    assert written == json.loads(json.dumps(summary))
    assert written["status"] == "diverged" and written["attempts"][-1]["status"] == "diverged"
    assert written["metrics"]["final"] == {"val/top1": None, "val/loss": None, "epoch": 2}
    assert written["metrics"]["best"] == {"val/top1": 12.5}
    assert written["non_finite"] == ["final.val/top1 = nan", "final.val/loss = inf"]
    assert written["error"] == "non-finite metric(s): final.val/top1 = nan, final.val/loss = inf"
    assert written["diverged"] == {"step": 40, "epoch": 2}
    assert read_summary(tmp_path / "run")["status"] == "diverged"


def test_a_divergence_with_a_nan_loss_is_strict_json_too(tmp_path):
    record = RunRecord(tmp_path / "run", {"seed": 0})
    record.update(diverged={"step": 3, "epoch": 1, "loss": float("nan")})
    record.finish("diverged", error="diverged at step 3 (epoch 1): loss nan")
    written = strict_json((tmp_path / "run" / "summary.json").read_text())
    assert written["status"] == "diverged" and written["diverged"] == {"step": 3, "epoch": 1, "loss": None}


def test_an_old_record_with_nan_or_infinity_reads_as_diverged_with_a_warning(tmp_path, caplog):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "summary.json").write_text('{"run_id": "r0", "status": "completed", "seed": 1, "metrics": '
                                          '{"final": {"val/top1": NaN, "val/top5": 99.0}, '
                                          '"best": {"val/top1": Infinity}}}')
    with caplog.at_level(logging.WARNING):
        summary = read_summary(run_dir)
    assert summary["status"] == "diverged"
    assert summary["metrics"] == {"final": {"val/top1": None, "val/top5": 99.0}, "best": {"val/top1": None}}
    assert summary["error"] == "non-finite metric(s): final.val/top1 = nan, best.val/top1 = inf"
    assert f"run record {run_dir} (seed 1) holds non-finite metrics (final.val/top1 = nan, best.val/top1 = " \
           "inf): read as diverged" in caplog.text
