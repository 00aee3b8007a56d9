"""``normexp analyze`` on a run of every family, on a trained DyT run, and on bad input."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from conftest import quick_cfg, run_cli
from omegaconf import OmegaConf

from normexp.analysis import cli
from normexp.analysis.core import ANALYSES, load_run
from normexp.engine.alpha_probe import ALPHA_KEY, STD_KEY
from normexp.models import build_backbone
from normexp.run import run
from normexp.tasks.dino import build_network
from normexp.tasks.mae import build_mae
from normexp.tracking.provenance import config_hash
from normexp.tracking.records import read_metrics, read_summary


def fake_run(run_dir: Path, *overrides: str, status: str = "completed", checkpoint: bool = True,
             epoch: int = 1) -> Path:
    """A run record as training leaves it, with the untrained model's weights (what the analysis reads
    does not depend on training): config.yaml, summary.json, checkpoint.pth."""
    config = OmegaConf.to_container(quick_cfg(*overrides), resolve=True)
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    summary = {"status": status, "run_id": config_hash(config), "metrics": {"final": {"val/top1": 12.5}}}
    if status == "diverged":
        summary["error"] = "diverged at step 3 (epoch 1): loss nan"
    (run_dir / "summary.json").write_text(json.dumps(summary))
    if checkpoint:
        torch.manual_seed(0)
        model = build_backbone(config["backbone"], config["norm"])
        torch.save({"model": model.state_dict(), "epoch": epoch, "ema": None}, run_dir / "checkpoint.pth")
    return run_dir


@pytest.fixture(scope="module")
def dyt_run(tmp_path_factory):
    """One trained run for the module: the 1-epoch digits demo with DyT (its metrics.jsonl logs alpha)."""
    run_dir = tmp_path_factory.mktemp("dyt") / "run"
    run(quick_cfg("norm=dyt", epochs=1), run_dir)
    return run_dir


FAMILIES = [("vit_micro", "dyt"), ("vit_micro_star", "dtn"), ("swin_micro", "ln"), ("pvt_micro", "ln"),
            ("pvt_v2_micro", "in"), ("levit_micro", "bn"), ("t2t_vit_micro", "ln"), ("convnext_micro", "rms")]
GLOBAL = {"vit_micro", "vit_micro_star", "pvt_micro", "pvt_v2_micro", "t2t_vit_micro", "swin_micro"}


@pytest.mark.parametrize(("backbone", "norm"), FAMILIES)
def test_analyze_writes_every_figure_of_every_family(tmp_path, backbone, norm):
    run_dir = fake_run(tmp_path / "run", f"backbone={backbone}", f"norm={norm}")
    out, summary = cli.analyze(run_dir, list(ANALYSES), images=3, seed=0, max_slots=3)
    files = {p.name for p in out.iterdir()}
    assert {"io.png", "io_channels.png", "io.json", "io_points.csv", "tokens.png", "tokens.json",
            "summary.json"} <= files
    assert set(summary["files"]) == files
    io = json.loads((out / "io.json").read_text())
    slots = summary["slots"]  # every norm slot; the io figure draws 3, evenly spaced in depth
    assert [row["slot"] for row in io] == [slots[round(i * (len(slots) - 1) / 2)] for i in range(3)]
    with (out / "activations.csv").open() as f:  # every slot; a saturated fraction for DyT's only
        activations = list(csv.DictReader(f))
    assert [row["slot"] for row in activations] == slots and "activations.png" in files
    assert all((row["saturated_fraction"] != "") == (norm == "dyt") for row in activations)
    assert ("alpha.png" in files) == (norm == "dyt")
    if norm != "dyt":
        assert "no layer with a scalar alpha" in summary["notes"]["alpha"][0]
    assert ("attention.png" in files) == (backbone in GLOBAL)
    if backbone not in GLOBAL:  # a clear note instead of a figure
        assert "does not apply" in " ".join(summary["notes"]["attention"]) or \
            "no explicit attention weights" in " ".join(summary["notes"]["attention"])
    if backbone == "swin_micro":
        assert any("windowed attention" in note for note in summary["notes"]["attention"])
    assert not [p for p in run_dir.iterdir() if p.name.startswith(".analysis")]


@pytest.mark.parametrize("task", ["mae", "dino"])
def test_analyze_a_self_supervised_run_rebuilds_the_backbone_its_weights_fill(tmp_path, task):
    """An MAE run's encoder, a DINO run's teacher backbone: headless, unlike the configured classifier."""
    small_head = ["task.out_dim=64", "task.hidden_dim=32", "task.bottleneck_dim=16"] if task == "dino" else []
    overrides = [f"task={task}", "norm=dyt", *small_head]
    run_dir, cfg = fake_run(tmp_path / "run", *overrides, checkpoint=False), quick_cfg(*overrides)
    torch.manual_seed(0)
    if task == "mae":
        mae = build_mae(cfg)
        state, encoder = {"model": mae.state_dict()}, mae.encoder.state_dict()
    else:
        teacher = build_network(cfg, drop_path=False)
        state = {"model": teacher.state_dict(), "task": {"teacher": teacher.state_dict()}}
        encoder = teacher.backbone.state_dict()
    torch.save({**state, "epoch": 1, "ema": None}, run_dir / "checkpoint.pth")
    loaded = load_run(run_dir)
    assert loaded.model.state_dict().keys() == encoder.keys() and "head.weight" not in encoder
    assert all(torch.equal(loaded.model.state_dict()[k], v) for k, v in encoder.items())
    out, summary = cli.analyze(run_dir, ["tokens"], images=2, seed=0)
    assert summary["files"] == ["tokens.png", "tokens.json", "summary.json"]
    assert (out / "tokens.json").is_file()


def test_analyze_reads_the_added_slots_of_a_placement_per_head_ones_included(tmp_path):
    """HybridNorm's per-head q / k / v slots see (B * heads, N, head_dim): the io and tokens figures count
    their images, tokens and heads as the block's (8 px digits: a 4 x 4 grid, 4 heads of 24 channels)."""
    run_dir = fake_run(tmp_path / "run", "backbone.norm_position=hybrid", "norm=dtn")
    _, summary = cli.analyze(run_dir, ["io", "tokens"], images=3, seed=0, slots=["blocks.0.*"])
    assert summary["slots"][:4] == ["blocks.0.attn.q_norm", "blocks.0.attn.k_norm", "blocks.0.attn.v_norm",
                                    "blocks.0.norm2"]
    [tokens] = json.loads((run_dir / "analysis" / "tokens.json").read_text())
    assert tokens["slot"] == "blocks.0.norm2"  # the default: the first slot on the block's tokens
    io = {row["slot"]: row for row in json.loads((run_dir / "analysis" / "io.json").read_text())}
    assert set(io) == set(summary["slots"][:4])
    assert all(row["grid"] == [4, 4] and row["n"] == io["blocks.0.norm2"]["n"] for row in io.values())
    cli.analyze(run_dir, ["tokens"], images=3, seed=0, token_slot="blocks.0.attn.q_norm")
    [tokens] = json.loads((run_dir / "analysis" / "tokens.json").read_text())
    assert tokens["heads"] == 4 and tokens["grid"] == [4, 4] and len(tokens["input"]["maps"]) == 4


def test_analyze_a_trained_dyt_run_from_the_command_line(dyt_run):
    rows = [r for r in read_metrics(dyt_run) if "val/top1" in r]
    assert rows[-1][ALPHA_KEY + "blocks.0.norm1"] > 0 and rows[-1][STD_KEY + "norm"] > 0
    final = read_summary(dyt_run)["metrics"]["final"]  # the last epoch's probe values are final metrics too
    assert final[ALPHA_KEY + "blocks.0.norm1"] == rows[-1][ALPHA_KEY + "blocks.0.norm1"]
    result = run_cli("analyze", str(dyt_run), "--images", "4", "--figures", "alpha,attention")
    assert result.returncode == 0, result.stderr[-2000:]
    out = dyt_run / "analysis"
    assert {p.name for p in out.iterdir()} == {"alpha.png", "alpha.csv", "alpha_history.csv", "attention.png",
                                              "attention.csv", "summary.json"}
    history = (out / "alpha_history.csv").read_text().splitlines()
    assert history[0].startswith("run,slot,epoch,alpha,input_std") and len(history) == 1 + 13  # 13 DyT slots
    summary = json.loads((out / "summary.json").read_text())
    assert summary["images"]["count"] == 4 and summary["weights"] == "model"
    assert "class / distillation tokens are left out" in result.stdout
    # the same images again: the same numbers
    first = (out / "attention.csv").read_text()
    cli.analyze(dyt_run, ["attention"], images=4, seed=0)
    assert (out / "attention.csv").read_text() == first


def test_a_dyt_run_in_its_first_epoch_says_its_alpha_log_is_still_empty(tmp_path):
    """Its checkpoint is from the middle of epoch 1: no epoch row has logged alpha yet -- not an old run."""
    run_dir = fake_run(tmp_path / "run", "norm=dyt", status="running", epoch=0)
    _, summary = cli.analyze(run_dir, ["alpha"], images=2, seed=0)
    assert summary["notes"]["alpha"] == ["no epoch of this run has ended yet (alpha is logged at the end of "
                                         "each epoch): the over-training panel fills in as epochs end"]


def one_line_error(result) -> str:
    lines = result.err.strip().splitlines()
    assert len(lines) == 1, result.err
    return lines[0]


def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, capsys, monkeypatch):
    good = fake_run(tmp_path / "good")
    cli.analyze(good, ["tokens"], images=2, seed=0)
    previous = {p.name: p.read_bytes() for p in (good / "analysis").iterdir()}
    cases = {
        "no checkpoint": (fake_run(tmp_path / "nockpt", checkpoint=False), [], "has no checkpoint.pth"),
        "diverged": (fake_run(tmp_path / "div", status="diverged"), [], "diverged (diverged at step 3"),
        "not a run": (tmp_path, [], "is not a run directory"),
        "unknown figure": (good, ["--figures", "io,curves"], "unknown figure(s) ['curves']"),
    }
    for name, (run_dir, extra, says) in cases.items():
        with pytest.raises(SystemExit) as exit_info:
            cli.main([str(run_dir), "--images", "2", *extra])
        assert exit_info.value.code == 2, name
        line = one_line_error(capsys.readouterr())
        assert line.startswith("error: ") and says in line, (name, line)
    assert not (tmp_path / "nockpt" / "analysis").exists() and not (tmp_path / "div" / "analysis").exists()

    # a failure while rendering leaves the previous analysis whole and no temporary directory behind
    def broken(*_args, **_kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(cli, "plot_tokens", broken)
    with pytest.raises(RuntimeError):
        cli.analyze(good, ["io", "tokens"], images=2, seed=0)
    assert {p.name: p.read_bytes() for p in (good / "analysis").iterdir()} == previous
    assert not [p for p in good.iterdir() if p.name.startswith(".analysis")]
    monkeypatch.undo()
    cli.analyze(good, ["io"], images=2, seed=0)  # a good analysis replaces the previous one whole
    assert {p.name for p in (good / "analysis").iterdir()} == {"io.png", "io_channels.png", "io.json",
                                                              "io_points.csv", "summary.json"}
    shutil.rmtree(good / "analysis")


def test_out_never_removes_a_users_directory(tmp_path, capsys, monkeypatch):
    """``--out <existing dir>`` writes a new ``<run name>-analysis`` folder in it (``--out .`` too); a rerun
    replaces only that analysis; a run's ``analysis/`` holding a file of the user's is refused in one line."""
    run_dir = fake_run(tmp_path / "run")
    thesis = tmp_path / "thesis"
    (thesis / "sub").mkdir(parents=True)
    (thesis / "thesis.tex").write_text("\\documentclass{article}")
    (thesis / "sub" / "data.csv").write_text("a,b\n1,2\n")
    for _ in range(2):  # the second time replaces the first analysis, and only it
        cli.main([str(run_dir), "--images", "2", "--figures", "tokens", "--out", str(thesis)])
        assert sorted(p.name for p in thesis.iterdir()) == ["run-analysis", "sub", "thesis.tex"]
        assert {p.name for p in (thesis / "run-analysis").iterdir()} == {"tokens.png", "tokens.json",
                                                                         "summary.json"}
    assert (thesis / "sub" / "data.csv").read_text() == "a,b\n1,2\n"
    monkeypatch.chdir(thesis / "sub")
    cli.main([str(run_dir), "--images", "2", "--figures", "tokens", "--out", "."])
    assert sorted(p.name for p in (thesis / "sub").iterdir()) == ["data.csv", "run-analysis"]
    capsys.readouterr()

    (run_dir / "analysis").mkdir()
    (run_dir / "analysis" / "notes.md").write_text("mine")
    with pytest.raises(SystemExit) as exit_info:
        cli.main([str(run_dir), "--images", "2", "--figures", "tokens"])
    assert exit_info.value.code == 2
    assert "holds files analyze did not write" in one_line_error(capsys.readouterr())
    assert [p.name for p in (run_dir / "analysis").iterdir()] == ["notes.md"]
