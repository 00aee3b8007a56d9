"""Robustness: CE / mCE / relative mCE on hand-computed tables, and the task on a 1-epoch demo checkpoint."""

from __future__ import annotations

import json
import math
import shutil
import time

import numpy as np
import pytest
import torch
import yaml
from conftest import quick_cfg, run_cli
from omegaconf import OmegaConf
from PIL import Image

from normexp.errors import UserError
from normexp.metrics.robustness import (
    ALEXNET,
    ALEXNET_CLEAN_ERROR,
    ALEXNET_ERRORS,
    CORRUPTIONS,
    GROUPS,
    Normaliser,
    benchmark_mean,
    corruption_errors,
    group_errors,
    mean_errors,
    relative_corruption_errors,
)
from normexp.run import run
from normexp.tasks.robustness import robustness_metrics, with_checkpoint_model
from normexp.tracking.records import read_metrics, read_summary


# ---------------------------------------------------------------- metrics on hand-computed tables
def test_published_constants():
    assert CORRUPTIONS[:3] == ("gaussian_noise", "shot_noise", "impulse_noise") and len(CORRUPTIONS) == 15
    assert [len(GROUPS[g]) for g in ("noise", "blur", "weather", "digital")] == [3, 4, 4, 4]
    assert set(ALEXNET_ERRORS) == set(CORRUPTIONS) and ALEXNET_CLEAN_ERROR == 0.4348
    assert ALEXNET_ERRORS["glass_blur"] == 0.826268 and ALEXNET_ERRORS["jpeg_compression"] == 0.6065


def test_ce_and_relative_ce_against_alexnet_by_hand():
    table = {"gaussian_noise": {1: 0.2, 2: 0.3, 3: 0.4, 4: 0.5, 5: 0.6}}
    means = mean_errors(table)
    assert means == {"gaussian_noise": pytest.approx(0.4)}
    # CE = 0.4 / 0.886428 = 0.451249...; relative CE = (0.4 - 0.1) / (0.886428 - 0.4348) = 0.3 / 0.451628
    assert corruption_errors(means, ALEXNET)["gaussian_noise"] == pytest.approx(0.4512493, abs=1e-7)
    relative = relative_corruption_errors(means, 0.1, ALEXNET)
    assert relative["gaussian_noise"] == pytest.approx(0.6642635, abs=1e-7)


def test_mce_over_the_15_with_alexnet():
    # AlexNet's own errors give CE = relative CE = 1 for every corruption
    alexnet_itself = {c: dict.fromkeys(range(1, 6), e) for c, e in ALEXNET_ERRORS.items()}
    means = mean_errors(alexnet_itself)
    assert benchmark_mean(corruption_errors(means, ALEXNET)) == pytest.approx(1.0)
    relative = relative_corruption_errors(means, ALEXNET_CLEAN_ERROR, ALEXNET)
    assert benchmark_mean(relative) == pytest.approx(1.0)
    # 50 % error everywhere, clean 25 %: mCE = mean(0.5 / a_c) = 0.5 * 19.40177 / 15 = 0.6467257 and
    # relative mCE = mean(0.25 / (a_c - 0.4348)) = 0.25 * 48.84257 / 15 = 0.8140429 (sums over published a_c)
    half = {c: dict.fromkeys(range(1, 6), 0.5) for c in CORRUPTIONS}
    means = mean_errors(half)
    assert benchmark_mean(corruption_errors(means, ALEXNET)) == pytest.approx(0.6467257, abs=1e-7)
    relative = relative_corruption_errors(means, 0.25, ALEXNET)
    assert benchmark_mean(relative) == pytest.approx(0.8140429, abs=1e-7)


def test_extras_never_enter_mce_and_have_no_alexnet_ce():
    table = {"gaussian_noise": {1: 0.4}, "speckle_noise": {1: 0.9}}
    ce = corruption_errors(mean_errors(table), ALEXNET)
    assert set(ce) == {"gaussian_noise"}
    assert benchmark_mean(mean_errors(table)) == pytest.approx(0.4)
    assert math.isnan(benchmark_mean({"saturate": 0.3}))


def test_reference_run_normalisation_and_group_means_by_hand():
    reference = Normaliser("LN baseline", {"gaussian_noise": 0.5, "shot_noise": 0.8}, clean_error=0.2)
    table = {"gaussian_noise": {1: 0.2, 3: 0.4}, "shot_noise": {1: 0.6, 3: 0.8}}
    means = mean_errors(table)  # 0.3 and 0.7
    ce = corruption_errors(means, reference)
    assert ce == {"gaussian_noise": pytest.approx(0.6), "shot_noise": pytest.approx(0.875)}
    relative = relative_corruption_errors(means, 0.1, reference)  # (0.3-0.1)/(0.5-0.2), (0.7-0.1)/(0.8-0.2)
    assert relative == {"gaussian_noise": pytest.approx(2 / 3), "shot_noise": pytest.approx(1.0)}
    assert benchmark_mean(ce) == pytest.approx(0.7375)
    assert group_errors(table) == {"noise": pytest.approx(0.5)}
    assert relative_corruption_errors(means, 0.1, Normaliser("no clean", {"gaussian_noise": 0.5})) == {}


def test_table_mce_against_its_baseline_row_is_the_tasks_with_that_reference():
    # one definition of CE and its undefined ratios: the tables' derived columns call the task's metrics
    from normexp.tables.aggregate import mce_vs_baseline, relative_mce_vs_baseline

    own = {c: 30.0 + i for i, c in enumerate(CORRUPTIONS)}
    ref = {c: 40.0 + 2 * i for i, c in enumerate(CORRUPTIONS)}

    def summary(errors: dict, clean: float) -> dict:
        return {"metrics": {"robustness": {"clean_err": clean, **{f"err/{c}": e for c, e in errors.items()}}}}

    reference = Normaliser("baseline row", ref, 20.0)
    expected = 100 * benchmark_mean(corruption_errors(own, reference))
    assert mce_vs_baseline(summary(own, 10.0), summary(ref, 20.0)) == pytest.approx(expected)
    relative = 100 * benchmark_mean(relative_corruption_errors(own, 10.0, reference))
    assert relative_mce_vs_baseline(summary(own, 10.0), summary(ref, 20.0)) == pytest.approx(relative)
    # a corruption that adds no error to the baseline leaves the relative mCE undefined, as in the task
    assert relative_mce_vs_baseline(summary(own, 10.0), summary({**ref, "fog": 20.0}, 20.0)) is None
    assert mce_vs_baseline(summary(own, 10.0), summary({**ref, "fog": 20.0}, 20.0)) is not None


def test_record_metrics_are_percent_and_say_what_normalises():
    table = {"gaussian_noise": {1: 0.2, 2: 0.3, 3: 0.4, 4: 0.5, 5: 0.6},
             "fog": dict.fromkeys(range(1, 6), 0.1)}
    m = robustness_metrics(table, 0.1, ALEXNET)
    expected = {"err/gaussian_noise/s2": 30.0, "err/gaussian_noise": 40.0, "clean_err": 10.0,
                "ce/gaussian_noise": 45.1249284, "mce": 100 * (0.4 / 0.886428 + 0.1 / 0.819324) / 2,
                "relative_ce/fog": 0.0, "mean_corruption_err": 25.0, "group_err/noise": 40.0,
                "group_err/weather": 10.0}
    assert {k: m[k] for k in expected} == pytest.approx(expected, abs=1e-6)
    assert m["mce_corruptions"] == 2 and m["normalised_by"].startswith("AlexNet")
    unnormalised = robustness_metrics(table, None, None)
    assert "mce" not in unnormalised and unnormalised["normalised_by"] is None


# ---------------------------------------------------------------- the task on a demo checkpoint
@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """A 1-epoch digits run: its run directory holds config.yaml and checkpoint.pth."""
    run_dir = tmp_path_factory.mktemp("demo") / "run"
    run(quick_cfg(), run_dir)
    return run_dir


def robustness_cfg(checkpoint, *overrides, corruptions="[gaussian_noise,contrast]", severities="[1,5]"):
    return quick_cfg("task=robustness", f"task.checkpoint={checkpoint}", f"task.corruptions={corruptions}",
                     f"task.severities={severities}", "task.num_workers=0", *overrides)


def test_robustness_of_a_checkpoint_is_recorded_printed_and_mirrored(demo_run, tmp_path, capsys):
    cfg = robustness_cfg(demo_run, f"task.cache_dir={tmp_path / 'cache'}", "logger=wandb")
    summary = run(cfg, tmp_path / "eval")
    results = summary["metrics"]["robustness"]
    assert summary["status"] == "completed" and summary["task"] == "robustness" and summary["params"] > 0
    assert set(results) >= {"clean_err", "err/gaussian_noise/s1", "err/contrast/s5", "err/contrast",
                            "group_err/noise", "group_err/digital", "mean_corruption_err"}
    assert "mce" not in results and results["normalised_by"] is None  # digits: no AlexNet figures
    mean = (results["err/gaussian_noise"] + results["err/contrast"]) / 2
    assert results["mean_corruption_err"] == pytest.approx(mean)
    # errors in percent (the 1-epoch model is near chance, so no ordering of severities is asserted here)
    assert all(0 <= results[f"err/{c}/s{k}"] <= 100 for c in ("gaussian_noise", "contrast") for k in (1, 5))
    rows = [r for r in read_metrics(tmp_path / "eval") if "robustness/err" in r]
    assert [(r["corruption"], r["severity"]) for r in rows] == [
        ("gaussian_noise", 1), ("gaussian_noise", 5), ("contrast", 1), ("contrast", 5)]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and all(r["epoch"] == 1 for r in rows)
    out = capsys.readouterr().out
    assert "gaussian_noise     noise" in out and "no mCE: no AlexNet errors exist for data=digits" in out
    assert "mean corruption error" in out and "over 2 of the 15 corruptions" in out
    assert (tmp_path / "eval" / "robustness.txt").read_text().strip() in out
    # the checkpoint's clean error is the trained run's validation error, up to uint8 quantisation
    trained = read_summary(demo_run)["metrics"]["final"]["val/top1"]
    assert results["clean_err"] == pytest.approx(100 - trained, abs=1.0)
    # W&B gets the same figures: the rows, and the summary as robustness/<metric>
    (log_file,) = list((tmp_path / "eval" / "wandb").glob("offline-run-*/run-*.wandb"))
    data = log_file.read_bytes()
    for expected in ("robustness/err", "robustness/mean_corruption_err", "robustness/err/contrast/s5",
                     "robustness/group_err/noise", json.dumps(results["mean_corruption_err"])):
        assert expected.encode() in data, expected


def test_a_reference_run_normalises_ce(demo_run, tmp_path, capsys):
    reference = tmp_path / "reference"
    run(robustness_cfg(demo_run, "task.cache_dir=null"), reference)
    results = run(robustness_cfg(demo_run, "task.cache_dir=null", f"task.reference_run={reference}"),
                  tmp_path / "eval")["metrics"]["robustness"]
    # the same model on the same pixels: every CE and relative CE is 100 %
    assert results["mce"] == pytest.approx(100.0) and results["ce/contrast"] == pytest.approx(100.0)
    # relative CE divides by the error a corruption *adds* to the reference: defined only where it adds
    # some (a barely trained model can do better on noise than on clean digits), and the relative mCE only
    # when every corruption's is
    added = {c: results[f"err/{c}"] > results["clean_err"] for c in ("gaussian_noise", "contrast")}
    for c, defined in added.items():
        assert results.get(f"relative_ce/{c}") == (pytest.approx(100.0) if defined else None), c
    assert results["relative_mce"] == (pytest.approx(100.0) if all(added.values()) else None)
    assert str(reference) in results["normalised_by"]
    assert f"CE normalised by reference run {reference}" in capsys.readouterr().out
    with pytest.raises(UserError, match="has no error for glass_blur severity 1"):
        run(robustness_cfg(demo_run, f"task.reference_run={reference}", corruptions="[glass_blur]"),
            tmp_path / "bad")


def test_the_model_is_the_checkpoints(demo_run):
    cfg = with_checkpoint_model(robustness_cfg(demo_run, "norm=dyt", "backbone.patch_size=4"))
    trained = yaml.safe_load((demo_run / "config.yaml").read_text())
    assert cfg.norm.name == "ln" and OmegaConf.to_container(cfg.backbone) == trained["backbone"]
    assert cfg.name == "vit_micro-ln-digits-s0"  # the record and W&B name the evaluated model


@pytest.mark.parametrize("override,message,started", [
    (None, "task=robustness needs task.checkpoint", False),
    ("data.img_size=32", "trained with data.img_size=8; this run has 32: pass data.img_size=8", False),
    ("task.ema=true", "has no EMA weights", True),  # known once the weights are read: a failed run
])
def test_bad_checkpoint_settings_are_one_line(demo_run, tmp_path, override, message, started):
    cfg = robustness_cfg(demo_run, *([override] if override else []))
    if override is None:
        cfg.task.checkpoint = None
    with pytest.raises(UserError, match=message):
        run(cfg, tmp_path / "eval")
    if started:
        assert read_summary(tmp_path / "eval")["status"] == "failed"
    else:  # refused before the run started: nothing written
        assert not (tmp_path / "eval").exists()


def test_checkpoint_that_does_not_match_the_model(demo_run, tmp_path):
    stale = tmp_path / "stale"  # its stored config no longer describes its weights
    shutil.copytree(demo_run, stale, ignore=shutil.ignore_patterns("wandb"))
    config = yaml.safe_load((stale / "config.yaml").read_text())
    config["backbone"]["patch_size"] = 4
    (stale / "config.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(UserError, match="does not match the configured model") as info:
        run(robustness_cfg(stale), tmp_path / "eval")
    assert "\n" not in str(info.value)
    # a bare state dict (no stored config) is loaded into the configured model
    torch.save(torch.load(demo_run / "checkpoint.pth", weights_only=False)["model"], tmp_path / "bare.pth")
    with pytest.raises(UserError, match="does not match the configured model"):
        run(robustness_cfg(tmp_path / "bare.pth", "norm=dyt"), tmp_path / "eval_bare")
    assert run(robustness_cfg(tmp_path / "bare.pth", "task.cache_dir=null"),
               tmp_path / "eval_ok")["status"] == "completed"


def test_incomplete_imagenet_c_tree_fails_the_run_in_one_line(demo_run, tmp_path):
    root = tmp_path / "tree"  # severity 1 complete (10 class folders), severity 5 never extracted
    for label in range(10):
        (root / "gaussian_noise" / "1" / str(label)).mkdir(parents=True)
        Image.new("RGB", (32, 32)).save(root / "gaussian_noise" / "1" / str(label) / "0000.png")
    with pytest.raises(UserError, match="is missing gaussian_noise severity 5"):
        run(robustness_cfg(demo_run, f"data.imagenet_c_root={root}", corruptions="[gaussian_noise]"),
            tmp_path / "eval")
    assert "severity 5" in read_summary(tmp_path / "eval")["error"]


def test_chained_after_classification_into_the_same_record(tmp_path):
    cfg = quick_cfg("task.robustness.enabled=true", "task.robustness.corruptions=[pixelate]",
                    "task.robustness.severities=[3]", "task.robustness.num_workers=0",
                    "task.robustness.cache_dir=null")
    summary = run(cfg, tmp_path / "run")
    assert set(summary["metrics"]) == {"final", "best", "reported", "robustness"}
    assert summary["metrics"]["robustness"]["err/pixelate/s3"] is not None
    rows = read_metrics(tmp_path / "run")
    steps = [r["step"] for r in rows]
    assert steps == sorted(steps) and rows[-1]["corruption"] == "pixelate"  # W&B needs increasing steps


def make_imagefolder(root, classes=("n01440764", "n01443537"), per_class=(8, 4)):
    rng = np.random.default_rng(0)
    for split, count in zip(("train", "val"), per_class, strict=True):
        for c, wnid in enumerate(classes):
            (root / split / wnid).mkdir(parents=True)
            for i in range(count):  # class 0 bright, class 1 dark
                pixels = np.clip(rng.normal(200 if c == 0 else 50, 20, (40, 48, 3)), 0, 255).astype(np.uint8)
                Image.fromarray(pixels).save(root / split / wnid / f"{wnid}_{i}.JPEG")
    return root


def test_imagenet_on_the_fly_with_alexnet_then_the_same_images_as_a_tree(tmp_path, capsys):
    root = make_imagefolder(tmp_path / "imagenet")
    data = (f"data.root={root}", "data.num_classes=2", "data.img_size=32", "data.batch_size=8",
            "data.eval_batch_size=8", "data.num_workers=0", "data.pin_memory=false")
    run(quick_cfg("data=imagenet", *data, "backbone.patch_size=8"), tmp_path / "train")
    fog = {"corruptions": "[fog]", "severities": "[1,2,3,4,5]"}
    on_the_fly = run(robustness_cfg(tmp_path / "train", "data=imagenet", *data,
                                    f"task.cache_dir={tmp_path}/c", **fog), tmp_path / "fly")
    results = on_the_fly["metrics"]["robustness"]
    assert results["normalised_by"].startswith("AlexNet") and results["mce_corruptions"] == 1
    assert results["ce/fog"] == pytest.approx(results["err/fog"] / 0.819324)
    added = results["err/fog"] - results["clean_err"]
    assert results["relative_ce/fog"] == pytest.approx(added / (0.819324 - 0.4348))
    assert "CE normalised by AlexNet" in capsys.readouterr().out
    (cache_root,) = (tmp_path / "c").glob("imagenet-32px-*")
    assert len(list(cache_root.glob("fog/*/n014*/*.png"))) == 5 * 8  # <corruption>/<severity>/<wnid>/
    from_tree = run(robustness_cfg(tmp_path / "train", "data=imagenet", *data,
                                   f"data.imagenet_c_root={cache_root}", **fog), tmp_path / "tree")
    tree_results = from_tree["metrics"]["robustness"]
    assert {k: v for k, v in tree_results.items() if k != "source"} == \
        {k: v for k, v in results.items() if k != "source"}
    assert tree_results["source"] == f"pre-rendered tree {cache_root}"


def test_cli_without_checkpoint_is_one_line(tmp_path):
    out = run_cli("task=robustness", "logger=none", env={"NORMEXP_OUTPUT_DIR": str(tmp_path)})
    assert out.returncode == 2 and "Traceback" not in out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "task.checkpoint" in errors[0]


@pytest.mark.demo
def test_full_digits_evaluation_from_the_command_line(tmp_path):
    """The acceptance run: all 15 x 5 corruptions of the digits at the demo's 16 px; the second run renders
    nothing (times are printed, not asserted: speed is measured by hand, these machines are noisy)."""
    demo_16px = tmp_path / "demo"
    run(quick_cfg("data.img_size=16"), demo_16px)
    env = {"NORMEXP_OUTPUT_DIR": str(tmp_path / "out")}
    args = ("task=robustness", "data=digits", f"task.checkpoint={demo_16px}", "logger=none")
    times, newest = [], []
    for _ in range(2):
        start = time.perf_counter()
        out = run_cli(*args, env=env)
        times.append(time.perf_counter() - start)
        assert out.returncode == 0, out.stderr[-2000:]
        cached = list((tmp_path / "out" / "corruption_cache").rglob("*.png"))
        newest.append(max(f.stat().st_mtime_ns for f in cached))
    print(f"full 15x5 digits robustness: first {times[0]:.0f} s, cached {times[1]:.0f} s")
    assert len(cached) == 15 * 5 * 360 and newest[1] == newest[0]  # the cache was read, not rewritten
    for corruption in CORRUPTIONS:
        assert corruption in out.stdout
    assert "mean corruption error" in out.stdout and "over the 15 corruptions" in out.stdout
    summaries = [read_summary(p.parent) for p in (tmp_path / "out").rglob("summary.json")]
    assert len(summaries) == 2 and summaries[0]["metrics"] == summaries[1]["metrics"]  # cache = recomputation
