"""The config tree: every group option composes, the CLI prints and rejects as Hydra does."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import CONFIG_DIR, compose_cfg, run_cli
from omegaconf import OmegaConf

GROUPS = ("backbone", "norm", "task", "data", "logger", "trainer", "experiment")


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (Path(CONFIG_DIR) / group).glob("*.yaml"))


def test_default_is_the_embedded_demo():
    cfg = compose_cfg()
    assert (cfg.backbone.name, cfg.norm.name, cfg.data.name, cfg.task.name) == \
        ("vit_micro", "ln", "digits", "classification")
    assert list(cfg.logger) == ["wandb"] and cfg.logger.wandb.mode == "offline"
    assert cfg.backbone.num_classes == 10 and cfg.backbone.img_size == cfg.data.img_size


@pytest.mark.parametrize("group", [g for g in GROUPS if g != "experiment"])
def test_every_option_composes_and_resolves(group):
    for option in options(group):
        cfg = compose_cfg(f"{group}={option}")
        resolved = OmegaConf.to_container(cfg, resolve=True)
        if group == "logger":  # loggers sit side by side (logger=[wandb,mlflow]) under their names
            assert list(resolved.get("logger", {})) == ([] if option == "none" else [option])
        else:
            assert group == "trainer" or resolved[group]["name"] == option


def test_every_experiment_composes():
    assert options("experiment"), "no experiment recipes"
    for option in options("experiment"):
        OmegaConf.to_container(compose_cfg(f"experiment={option}"), resolve=True)


def test_deit_recipe_values():
    cfg = compose_cfg("experiment=deit_imagenet")
    t = cfg.trainer
    assert cfg.data.name == "imagenet" and cfg.backbone.name == "vit_small"
    assert (t.epochs, t.lr, t.lr_base_size, t.weight_decay, t.warmup_epochs) == (300, 5e-4, 512, 0.05, 5)
    assert (t.mixup.mixup_alpha, t.mixup.cutmix_alpha, t.smoothing) == (0.8, 1.0, 0.1)
    assert cfg.data.auto_augment == "rand-m9-mstd0.5-inc1" and cfg.data.reprob == 0.25
    # a group chosen on the command line wins over the recipe's choice
    assert compose_cfg("experiment=deit_imagenet", "backbone=vit_tiny").backbone.name == "vit_tiny"


def test_dtn_recipe_values():
    cfg = compose_cfg("experiment=dtn_imagenet")
    t = cfg.trainer
    assert (cfg.backbone.name, cfg.norm.name, cfg.backbone.dtn_blocks) == ("vit_small_star", "dtn", 10)
    assert (t.epochs, t.lr, t.lr_base_size, t.weight_decay, t.warmup_epochs) == (300, 5e-4, 512, 0.05, 5)
    assert (t.mixup.mixup_alpha, t.mixup.cutmix_alpha) == (0, 0)
    assert (cfg.data.reprob, cfg.data.color_jitter) == (0, 0.4)
    assert t.ema.enabled and t.best_metric == "ema/val/top1" and cfg.backbone.drop_path_rate == 0.1


def test_cfg_job_prints_the_config():
    out = run_cli("--cfg", "job", "--resolve", "norm=dyt")
    assert out.returncode == 0, out.stderr
    cfg = OmegaConf.create(out.stdout)
    assert cfg.norm.name == "dyt" and cfg.backbone.img_size == 16


def test_dyt_alpha0_is_the_papers_unless_the_backbone_suggests_one():
    assert compose_cfg("norm=dyt", "backbone=vit_small").norm.alpha0 == 0.5
    assert compose_cfg("norm=dyt").norm.alpha0 == 1.0  # vit_micro's suggestion
    assert compose_cfg("norm=dyt", "norm.alpha0=0.7").norm.alpha0 == 0.7  # the command line wins


def test_unknown_option_lists_the_available_ones():
    out = run_cli("norm=foo")
    assert out.returncode != 0
    assert "Could not find 'norm/foo'" in out.stderr
    for option in ("ln", "dyt", "rms"):
        assert f"\t{option}\n" in out.stderr
