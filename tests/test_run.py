"""Run records, W&B mirroring and reproducibility of a short digits run."""

from __future__ import annotations

import json
import shutil
import time

import pytest
import torch
import yaml
from conftest import interrupted_in_epoch_2, quick_cfg
from omegaconf import OmegaConf

from normexp.errors import UserError
from normexp.run import run
from normexp.tracking.records import read_metrics, read_summary

EMA_REPORTED = ("trainer.ema.enabled=true", "trainer.ema.reported=true")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A two-epoch run whose recipe reports its EMA weights: (config, summary, run directory)."""
    cfg = quick_cfg(*EMA_REPORTED, epochs=2)
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    return cfg, run(cfg, run_dir), run_dir


def test_the_ema_starts_as_a_copy_and_decays_from_the_first_update(tmp_path, monkeypatch):
    """DiT's update_ema (and timm's / DeiT's ModelEma): the EMA is a copy of the initial model, then
    ema = d ema + (1 - d) model after every update, the first included; with trainer.ema.warmup, timm's
    warm-up decay for the update's number (timm's train.py)."""
    from normexp.engine.trainer import Trainer

    seen: dict[str, dict] = {}
    real_prepare, real_after = Trainer.prepare_step, Trainer.after_update

    def prepare_step(self):
        if self.update == 0:
            seen["initial"] = {k: v.clone() for k, v in self.module.state_dict().items()}
        real_prepare(self)

    def after_update(self):
        real_after(self)
        if self.update == 1:
            seen["model"] = {k: v.clone() for k, v in self.module.state_dict().items()}
            seen["ema"] = {k: v.clone() for k, v in self.ema.module.state_dict().items()}

    monkeypatch.setattr(Trainer, "prepare_step", prepare_step)
    monkeypatch.setattr(Trainer, "after_update", after_update)
    run(quick_cfg("trainer.ema.enabled=true", "trainer.ema.decay=0.75"), tmp_path / "run")
    moved = [k for k, v in seen["model"].items()
             if v.is_floating_point() and not torch.equal(v, seen["initial"][k])]
    assert moved
    for key in moved:
        torch.testing.assert_close(seen["ema"][key], 0.75 * seen["initial"][key] + 0.25 * seen["model"][key])
    run(quick_cfg("trainer.ema.enabled=true", "trainer.ema.decay=0.75", "trainer.ema.warmup=true"),
        tmp_path / "warmup")  # timm's train.py: update 1 at warm-up step 1, a copy
    for key in moved:
        torch.testing.assert_close(seen["ema"][key], seen["model"][key])


def test_tf32_is_set_on_cuda_only_and_recorded(trained):
    """trainer.tf32 (DiT's train.py: torch.backends.cuda.matmul.allow_tf32 and cudnn.allow_tf32); a CPU run
    records it off. The flags are process-wide, so each trainer sets them either way."""
    from normexp.engine.precision import Precision

    before = torch.backends.cuda.matmul.allow_tf32
    try:
        assert Precision(None, torch.device("cuda"), tf32=True).tf32 and torch.backends.cuda.matmul.allow_tf32
        assert torch.backends.cudnn.allow_tf32
        assert not Precision(None, torch.device("cuda"), tf32=False).tf32
        assert not torch.backends.cuda.matmul.allow_tf32
        assert not Precision(None, torch.device("cpu"), tf32=True).tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
    assert trained[1]["tf32"] is False


def test_run_record_holds_config_metrics_summary_and_checkpoint(trained):
    cfg, summary, run_dir = trained
    assert yaml.safe_load((run_dir / "config.yaml").read_text()) == OmegaConf.to_container(cfg, resolve=True)
    rows = read_metrics(run_dir)
    epochs = [r for r in rows if "val/top1" in r]
    assert [r["epoch"] for r in epochs] == [1, 2]
    assert any("train/loss" in r and "val/top1" not in r for r in rows)  # per-interval rows
    on_disk = read_summary(run_dir)
    assert on_disk == json.loads(json.dumps(summary))
    assert on_disk["status"] == "completed" and on_disk["seed"] == 0
    assert on_disk["params"] == 675_178 and on_disk["gmacs"] > 0 and on_disk["images_per_s"] > 0
    final = on_disk["metrics"]["final"]
    assert set(on_disk["metrics"]) == {"final", "best", "reported"} and final["epoch"] == 2
    # the reported metrics: the EMA model's, which this run's recipe says its paper reports
    assert on_disk["metrics"]["reported"] == {"weights": "ema", "epoch": 2, "top1": final["ema/val/top1"],
                                              "top5": final["ema/val/top5"], "loss": final["ema/val/loss"]}
    assert on_disk["versions"]["torch"] and "commit" in on_disk["git"] and len(on_disk["run_id"]) == 16
    assert on_disk["hardware"]["threads"] == torch.get_num_threads()  # CPU results depend on it
    assert (run_dir / "checkpoint.pth").is_file() and not list(run_dir.glob("*.tmp"))


def test_same_seed_gives_identical_metrics(trained, tmp_path):
    _, a, _ = trained
    b = run(quick_cfg(*EMA_REPORTED, epochs=2), tmp_path / "b")
    c = run(quick_cfg(*EMA_REPORTED, "seed=1", epochs=2), tmp_path / "c")
    assert a["metrics"] == b["metrics"] and a["run_id"] == b["run_id"]
    assert a["metrics"] != c["metrics"] and a["run_id"] != c["run_id"]


def wandb_log_payload(path) -> bytes:
    """The record payloads of a W&B offline log, joined (wandb 0.31 ships no python reader for it).

    The log is LevelDB's format: a 7-byte file header, then 32 KiB blocks of records, each with a 7-byte
    header (checksum, 2-byte little-endian length, type); a record that does not fit is split across blocks
    and a block tail under 7 bytes is padding. Joining the payloads undoes the splits, so a key is never cut.
    """
    block, header = 32768, 7
    data, pos, payload = path.read_bytes(), 7, bytearray()
    while pos + header <= len(data):
        if block - pos % block < header:
            pos += block - pos % block
            continue
        length = int.from_bytes(data[pos + 4:pos + 6], "little")
        payload += data[pos + header:pos + header + length]
        pos += header + length
    return bytes(payload)


def test_wandb_offline_run_is_written(run_dir):
    run(quick_cfg("logger=wandb"), run_dir)
    (offline,) = list((run_dir / "wandb").glob("offline-run-*"))
    (log_file,) = list(offline.glob("run-*.wandb"))
    top1 = read_summary(run_dir)["metrics"]["final"]["val/top1"]
    expected = [s.encode() for s in ("vit_micro-ln-digits", "classification", "val/top1", "final/val/top1",
                                     "images_per_s", '"completed"', json.dumps(top1))]
    # The records hold keys and JSON values as plain bytes. W&B's service process may still be writing the
    # last records when finish() returns (seen under load), so give it a moment before reading for good.
    for _ in range(60):
        data = wandb_log_payload(log_file)
        if all(e in data for e in expected):
            break
        time.sleep(0.5)
    for e in expected:
        assert e in data, e


def test_logger_none_writes_no_wandb_files(trained):
    _, _, run_dir = trained  # quick_cfg: logger=none
    assert not (run_dir / "wandb").exists()


def test_failed_run_is_recorded_as_failed(run_dir):
    cfg = quick_cfg("data.batch_size=5000")
    with pytest.raises(UserError, match="smaller than one batch"):
        run(cfg, run_dir)
    summary = read_summary(run_dir)
    assert summary["status"] == "failed" and "smaller than one batch" in summary["error"]


def test_resume_after_a_crash_continues_exactly(trained, tmp_path, monkeypatch):
    """Crashed in its second epoch, resumed from the first epoch's checkpoint (model, optimizer, schedule,
    EMA, RNG): the same final metrics as the uninterrupted run."""
    _, uninterrupted, _ = trained
    interrupted_in_epoch_2(quick_cfg(*EMA_REPORTED, epochs=2), tmp_path / "crashed", monkeypatch)
    assert read_summary(tmp_path / "crashed")["status"] == "interrupted"
    resumed = run(quick_cfg(*EMA_REPORTED, f"trainer.resume={tmp_path / 'crashed'}", epochs=2),
                  tmp_path / "resumed")
    assert [r["epoch"] for r in read_metrics(tmp_path / "resumed") if "val/top1" in r] == [2]
    assert resumed["metrics"]["final"] == uninterrupted["metrics"]["final"]


def test_divergence_is_a_result_with_the_last_finite_metrics(run_dir):
    summary = run(quick_cfg("norm=dyt", "norm.squash=identity", "trainer.lr=0.05", epochs=2), run_dir)
    on_disk = read_summary(run_dir)
    assert summary["status"] == on_disk["status"] == "diverged"
    step = on_disk["diverged"]["step"]
    assert 1 <= step <= 10 and on_disk["error"].startswith(f"diverged at step {step}")
    last = on_disk["metrics"]["last_finite"]
    assert last["step"] == step - 1 and last["train/loss"] > 0  # the loss of the step before
    last_row = read_metrics(run_dir)[-1]
    assert last_row["diverged"] is True and last_row["step"] == step
    assert last_row["train/loss"] in (None, "inf")


def test_max_loss_bounds_the_loss(run_dir):
    """Initial loss is ~2.3 (10 classes): a bound of 1.0 stops the first step, None lets it train."""
    summary = run(quick_cfg("trainer.max_loss=1.0"), run_dir)
    assert summary["status"] == "diverged" and summary["diverged"]["step"] == 1
    assert "last_finite" not in summary["metrics"] and summary["metrics"]["final"] == {}


@pytest.mark.parametrize("status", ["interrupted", "failed", "diverged", "running"])
def test_a_run_that_has_not_completed_is_no_source_unless_deliberately(completed, tmp_path, status):
    """Issue 47 (3): a fine-tune from an unfinished run is refused before its record exists (a running
    record without a live process reads as interrupted); task.allow_incomplete_source=true starts from it,
    and the summary says so."""
    from conftest import plant_record

    source = plant_record(completed, tmp_path / "source", status=status)
    with pytest.raises(UserError) as error:
        run(quick_cfg(f"task.pretrained={source}"), tmp_path / "run")
    shown = "interrupted" if status == "running" else status
    assert str(error.value).startswith(f"task.pretrained={source} is a run that is {shown}, not completed")
    assert not (tmp_path / "run").exists()
    if status == "interrupted":
        summary = run(quick_cfg(f"task.pretrained={source}", "task.allow_incomplete_source=true"),
                      tmp_path / "run")
        assert summary["status"] == "completed"
        assert summary["source"] == {"key": "task.pretrained", "run": str(source), "status": "interrupted",
                                     "allow_incomplete": True}


@pytest.mark.parametrize("norm", ["dyt", "sigma_reparam"])
def test_fine_tuning_with_this_configs_norm_converts_the_starting_runs(tmp_path, norm):
    """Issue 47 (18): task.keep_pretrained_norm=false builds LN from a DyT run (alpha dropped, as DyT's
    release) or a sigma-Reparam run (each weight folded to gamma / sigma(W) W, the LN slots afresh), and says
    so in the record."""
    from normexp.engine.checkpoint import load_checkpoint
    from normexp.models import build_backbone
    from normexp.tasks import prepare_config
    from normexp.tasks.classification import start_from
    from normexp.tracking.records import RunRecord

    source = tmp_path / "source"
    assert run(quick_cfg(f"norm={norm}"), source)["status"] == "completed"
    cfg = prepare_config(quick_cfg(f"task.pretrained={source}", "task.keep_pretrained_norm=false"))
    assert cfg.norm.name == "ln"
    model = build_backbone(cfg.backbone, cfg.norm)
    record = RunRecord(tmp_path / "run", {}, writes=False)
    start_from(model, cfg, record)
    converted = record.summary["pretrained"]["converted"]
    assert (converted["from"], converted["to"]) == (norm, "ln")
    trained = build_backbone(yaml.safe_load((source / "config.yaml").read_text())["backbone"],
                             {"name": norm}).eval()
    trained.load_state_dict(load_checkpoint(source)["model"])
    if norm == "dyt":
        assert "blocks.0.norm1.alpha" in converted["dropped"] and not converted["folded"]
        assert torch.equal(model.blocks[0].norm1.weight, trained.blocks[0].norm1.weight)
    else:
        assert "blocks.0.attn.qkv.weight" in converted["folded"]
        assert "blocks.0.norm1.weight" in converted["fresh"]
        assert torch.allclose(model.blocks[0].attn.qkv.weight, trained.blocks[0].attn.qkv.weight)
        assert torch.equal(model.blocks[0].norm1.weight, torch.ones(96))


def test_a_fine_tuning_from_a_run_link_records_what_its_source_reached(completed, tmp_path, monkeypatch):
    """task.pretrained=run:<run_id> (a chained table's link) is found under the output root, and the record
    keeps the source's final evaluation as a path's does."""
    from normexp.models import build_backbone
    from normexp.tasks import prepare_config
    from normexp.tasks.classification import start_from
    from normexp.tracking.records import RunRecord
    from normexp.tracking.run_dir import run_dir

    source = read_summary(completed)
    located = run_dir(yaml.safe_load((completed / "config.yaml").read_text()), tmp_path / "root")
    shutil.copytree(completed, located)
    monkeypatch.setenv("NORMEXP_OUTPUT_DIR", str(tmp_path / "root"))
    cfg = prepare_config(quick_cfg(f"task.pretrained=run:{source['run_id']}"))
    record = RunRecord(tmp_path / "run", {}, writes=False)
    start_from(build_backbone(cfg.backbone, cfg.norm), cfg, record)
    assert record.summary["pretrained"]["final"] == source["metrics"]["final"] != {}


def test_weights_that_do_not_fit_are_refused_before_the_record_exists(completed, tmp_path):
    """Issue 47 (18): a refusal inside the task left a failed record, which later runs warned about and
    tables relaunched."""
    with pytest.raises(UserError, match="does not match the backbone ViT: unexpected"):
        run(quick_cfg(f"task.pretrained={completed}", "+backbone.depth=4"), tmp_path / "run")
    assert not (tmp_path / "run").exists()
    with pytest.raises(UserError, match="need a linear classifier 'head'; ConvNeXt has none"):
        run(quick_cfg("backbone=convnext_micro", "task.linear_probe=true"), tmp_path / "run")
    assert not (tmp_path / "run").exists()
