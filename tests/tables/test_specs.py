"""Every table spec composes at every scale without data present, and its full-scale runs are the papers'
recipes (values from the official code: facebookresearch/deit main.py, microsoft/Swin-Transformer config.py
and configs/swin/*, whai362/PVT classification/, facebookresearch/LeViT main.py and levit.py,
yitu-opensource/T2T-ViT README and main.py, wqshao126/DTN train.py and configs/ViT/vit.yaml,
jiachenzhu/DyT README and main.py (the ConvNeXt recipe), whai362/PVT detection/configs + mmdet 2.13 1x)."""

from __future__ import annotations

import fnmatch
import json

import pytest
from run_ids import RUN_IDS, run_ids

from normexp.errors import UserError
from normexp.tables import cli
from normexp.tables.plan import hydra_composer, plan_table
from normexp.tables.spec import get_path, list_scales, list_tables, load_scale, load_table

# experiment -> {config path: value} every full-scale run of that recipe must have
RECIPES = {
    "deit_imagenet": {"trainer.epochs": 300, "trainer.lr": 5e-4, "trainer.lr_base_size": 512,
                      "trainer.weight_decay": 0.05, "trainer.warmup_epochs": 5, "trainer.warmup_lr": 1e-6,
                      "trainer.min_lr": 1e-5, "trainer.smoothing": 0.1, "trainer.mixup.mixup_alpha": 0.8,
                      "trainer.mixup.cutmix_alpha": 1.0, "data.auto_augment": "rand-m9-mstd0.5-inc1",
                      "data.reprob": 0.25, "data.color_jitter": 0.3, "trainer.ema.decay": 0.99996,
                      "trainer.ema.reported": False},
    "dtn_imagenet": {"trainer.epochs": 300, "trainer.lr": 5e-4, "trainer.lr_base_size": 512,
                     "trainer.weight_decay": 0.05, "trainer.warmup_epochs": 5, "trainer.warmup_lr": 1e-6,
                     "trainer.min_lr": 1e-5, "trainer.smoothing": 0.1, "trainer.mixup.mixup_alpha": 0.0,
                     "trainer.mixup.cutmix_alpha": 0.0, "data.reprob": 0.0, "data.color_jitter": 0.4,
                     "trainer.ema.enabled": True, "trainer.ema.decay": 0.99996, "trainer.ema.reported": True,
                     "backbone.drop_path_rate": 0.1},
    "dtn_pvt_imagenet": {"trainer.epochs": 300, "trainer.lr": 5e-4, "trainer.lr_base_size": 512,
                         "trainer.mixup.mixup_alpha": 0.0, "data.reprob": 0.0,
                         "backbone.num_heads": [4, 4, 5, 8], "backbone.dtn_stages": 3,
                         "backbone.drop_path_rate": 0.1, "trainer.ema.enabled": True,
                         "trainer.ema.reported": True},
    "swin_imagenet": {"trainer.epochs": 300, "trainer.lr": 5e-4, "trainer.lr_base_size": 512,
                      "trainer.weight_decay": 0.05, "trainer.warmup_epochs": 20, "trainer.warmup_lr": 5e-7,
                      "trainer.min_lr": 5e-6, "trainer.clip_grad": 5.0, "trainer.mixup.mixup_alpha": 0.8,
                      "trainer.mixup.cutmix_alpha": 1.0, "data.reprob": 0.25, "data.color_jitter": 0.4,
                      "trainer.ema.enabled": False},
    "pvt_imagenet": {"trainer.epochs": 300, "trainer.lr": 5e-4, "trainer.lr_base_size": 512,
                     "trainer.weight_decay": 0.05, "trainer.warmup_epochs": 5,
                     "trainer.mixup.mixup_alpha": 0.8, "trainer.mixup.cutmix_alpha": 1.0,
                     "data.reprob": 0.25, "data.color_jitter": 0.4,
                     "trainer.ema.enabled": False},
    "levit_imagenet": {"trainer.epochs": 1000, "trainer.lr": 5e-4, "trainer.lr_base_size": 512,
                       "trainer.weight_decay": 0.025, "trainer.clip_grad": 0.01, "trainer.clip_mode": "agc",
                       "trainer.warmup_epochs": 5, "trainer.ema.decay": 0.99996,
                       "trainer.mixup.mixup_alpha": 0.8},
    "t2t_imagenet": {"trainer.epochs": 310, "trainer.cooldown_epochs": 10, "trainer.lr": 5e-4,
                     "trainer.lr_base_size": None, "trainer.weight_decay": 0.05, "trainer.warmup_epochs": 10,
                     "trainer.ema.enabled": True, "trainer.ema.reported": True,
                     "trainer.mixup.mixup_alpha": 0.8},
    "dyt_imagenet": {"trainer.epochs": 300, "trainer.lr": 4e-3, "trainer.lr_base_size": 4096,
                     "trainer.weight_decay": 0.05, "trainer.warmup_epochs": 20, "trainer.min_lr": 1e-6,
                     "trainer.ema.decay": 0.9999, "trainer.ema.reported": True,
                     "trainer.mixup.mixup_alpha": 0.8, "trainer.mixup.cutmix_alpha": 1.0,
                     "trainer.smoothing": 0.1, "data.reprob": 0.25, "trainer.amp": None},
    "retinanet_pvt_1x": {"task.detector": "retinanet", "trainer.epochs": 12, "trainer.lr": 1e-4,
                         "trainer.weight_decay": 1e-4, "trainer.decay_milestones": [8, 11],
                         "trainer.warmup_iters": 500, "data.name": "coco"},
    "mask_rcnn_pvt_1x": {"task.detector": "mask_rcnn", "trainer.epochs": 12, "trainer.lr": 2e-4,
                         "trainer.weight_decay": 1e-4, "trainer.decay_milestones": [8, 11],
                         "trainer.warmup_iters": 500, "data.name": "coco"},
    # facebookresearch/mae PRETRAIN.md, FINETUNE.md
    "mae_pretrain": {"task.name": "mae", "task.mask_ratio": 0.75, "task.norm_pix_loss": True,
                     "task.decoder.dim": 512, "task.decoder.depth": 8, "task.decoder.heads": 16,
                     "trainer.epochs": 800, "trainer.lr": 1.5e-4, "trainer.lr_base_size": 256,
                     "trainer.warmup_epochs": 40, "trainer.weight_decay": 0.05, "trainer.betas": [0.9, 0.95],
                     "backbone.drop_path_rate": 0.0},
    "mae_finetune": {"trainer.epochs": 100, "trainer.lr": 5e-4, "trainer.lr_base_size": 256,
                     "trainer.layer_decay": 0.65, "trainer.warmup_epochs": 5, "trainer.min_lr": 1e-6,
                     "trainer.mixup.mixup_alpha": 0.8, "trainer.mixup.cutmix_alpha": 1.0,
                     "trainer.smoothing": 0.1, "data.reprob": 0.25, "backbone.global_pool": "avg",
                     "task.head_init_std": 2e-5},
    "mae_finetune_large": {"trainer.epochs": 50, "trainer.lr": 1e-3, "trainer.layer_decay": 0.75,
                           "backbone.drop_path_rate": 0.2, "backbone.global_pool": "avg"},
    # MAE's fine-tuning shortened to arXiv 2605.14047's 20 epochs, the source's head and pooling kept
    "convert_finetune": {"trainer.epochs": 20, "trainer.warmup_epochs": 1, "trainer.lr": 5e-4,
                         "trainer.layer_decay": 0.65, "backbone.global_pool": "token",
                         "task.head_init_std": None,
                         "task.keep_pretrained_norm": False, "task.evaluate_start": True},
    # DyT's DINO commands (jiachenzhu/DyT other_tasks/DINO/README.md)
    "dino_vitb16": {"task.name": "dino", "trainer.epochs": 400, "trainer.lr": 7.5e-4, "trainer.min_lr": 2e-6,
                    "trainer.clip_grad": 0.3, "trainer.clip_mode": "param", "task.teacher_temp": 0.07,
                    "task.warmup_teacher_temp": 0.04, "task.warmup_teacher_temp_epochs": 50,
                    "task.local_crops": 10, "task.out_dim": 65536, "backbone.patch_size": 16},
    "dino_vitb8": {"task.name": "dino", "trainer.epochs": 300, "trainer.lr": 5e-4, "trainer.clip_grad": 3.0,
                   "task.warmup_teacher_temp": 0.03, "backbone.patch_size": 8},
    # facebookresearch/DiT train.py, sample_ddp.py; DyT's learning-rate-fix.patch; the Derf README's length
    "dit_imagenet": {"task.name": "dit", "trainer.epochs": 80, "trainer.lr": 4e-4,
                     "trainer.weight_decay": 0.0, "trainer.global_batch": 256, "trainer.ema.decay": 0.9999,
                     "trainer.warmup_epochs": 0,
                     "trainer.clip_grad": None, "task.vae": "stabilityai/sd-vae-ft-ema", "task.hflip": 0.5,
                     "task.sampling_steps": 250, "task.guidance": 1.0, "task.fid.samples": 50000,
                     "data.img_size": 256, "backbone.class_dropout": 0.1, "backbone.learn_sigma": True,
                     "task.fid.reference": "adm", "trainer.tf32": True, "trainer.ema.warmup": False},
    # pytorch/vision references/classification train.py defaults (DyT Table 16)
    "torchvision_imagenet": {"trainer.epochs": 90, "trainer.opt": "momentum", "trainer.lr": 0.1,
                             "trainer.lr_base_size": 256, "trainer.global_batch": 256,
                             "trainer.weight_decay": 1e-4, "trainer.decay_norm_and_bias": True,
                             "trainer.sched": "step", "trainer.decay_epochs": 30, "trainer.decay_rate": 0.1,
                             "trainer.sched_on": "epoch", "trainer.warmup_epochs": 0,
                             "trainer.smoothing": 0.0,
                             "trainer.mixup.mixup_alpha": 0.0, "trainer.mixup.cutmix_alpha": 0.0,
                             "trainer.ema.enabled": False, "trainer.clip_grad": None, "data.reprob": 0.0,
                             "data.auto_augment": None, "data.color_jitter": None,
                             "data.interpolation": "bilinear", "data.crop_pct": 0.875},
}
# per backbone (fnmatch), within a recipe: stochastic depth of the official configs
DROP_PATH = {
    "deit_imagenet": {"vit_*": 0.1}, "swin_imagenet": {"swin_tiny": 0.2}, "pvt_imagenet": {"pvt_tiny": 0.1},
    "levit_imagenet": {"levit_128s": 0.0}, "t2t_imagenet": {"t2t_vit_14": 0.1},
    "dyt_imagenet": {"vit_small": 0.1, "vit_base": 0.1, "vit_large": 0.4, "convnext_tiny": 0.1,
                     "convnext_base": 0.5, "convnext_large": 0.5},  # ConvNeXt's per-size values
}


COMMITTED_RUN_IDS = json.loads(RUN_IDS.read_text())


class Plans(dict):
    """(table, scale) -> plan, planned on first use: each pytest worker plans only what its tests read."""

    def __init__(self, compose):
        super().__init__()
        self.compose = compose

    def __missing__(self, key: tuple[str, str]):
        table, scale = key
        self[key] = plan_table(load_table(table), load_scale(scale), None, self.compose)
        return self[key]


@pytest.fixture(scope="module")
def plans():
    with hydra_composer() as compose:
        yield Plans(compose)


def experiment_of(overrides: list[str]) -> str:
    return next(o.partition("=")[2] for o in overrides if o.startswith("experiment="))


def check_full_scale_runs_are_the_papers_recipes(table, plan):
    assert plan.runs
    for run in plan.runs:
        if get_path(run.config, "task.name") == "evaluate":  # nothing trains: its source table's recipe
            assert str(get_path(run.config, "task.checkpoint")).startswith(("table:", "run:"))
            assert get_path(run.config, "data.name") == "imagenet"
            continue
        experiment = experiment_of(run.points[0].overrides)
        assert experiment in RECIPES, f"{table}: no recipe expectations for {experiment}"
        for path, value in RECIPES[experiment].items():
            assert get_path(run.config, path) == pytest.approx(value) if isinstance(value, float) else \
                get_path(run.config, path) == value, f"{table} {experiment}: {path}"
        backbone = get_path(run.config, "backbone.name")
        declared = [o.partition("=")[2] for o in run.points[0].overrides
                    if o.startswith("backbone.drop_path_rate=")]  # a row's own (Derf's recipe)
        for pattern, rate in DROP_PATH.get(experiment, {}).items():
            if fnmatch.fnmatchcase(backbone, pattern):
                expected = float(declared[0]) if declared else rate
                assert get_path(run.config, "backbone.drop_path_rate") == expected, f"{table}: {backbone}"
        assert get_path(run.config, "data.name") in ("imagenet", "coco")


def check_smoke_scale_runs_on_a_laptop(plan):
    """Micro members on the embedded data, 8 epochs -- the pre-training and generative tasks their demos'
    (MAE 30 epochs of a fast step, DINO 10, DiT 100 of 8 px digits)."""
    for run in plan.runs:
        assert get_path(run.config, "backbone.name").endswith(("_micro", "_micro_star")), run.overrides
        assert get_path(run.config, "data.name") in ("digits", "coco_digits")
        task = get_path(run.config, "task.name")
        budget = {"mae": 30, "dino": 10, "dit": 100}.get(task, 8)
        assert task == "evaluate" or get_path(run.config, "trainer.epochs") <= budget  # evaluate: no training


def check_paper_entries_and_baselines_name_existing_rows(table, plan):
    spec = plan.spec
    rows = {tuple(str(p.labels[k]) for k in spec.label_keys) for p, _ in plan.points}
    for entry in spec.paper:
        assert tuple(str(entry.get(k)) for k in spec.label_keys) in rows, f"{table}: paper entry {entry}"
        assert set(entry) - set(spec.label_keys) <= {m.key for m in spec.metrics}, entry
    for point, _ in plan.points:
        base = spec.baseline_of(point.labels)
        assert base is not None and tuple(str(base[k]) for k in spec.label_keys) in rows, point.labels
    assert spec.paper or spec.paper_note or not spec.source, f"{table}: give paper values or say why none"


def check_dtn_rows_start_their_position_weights_as_the_released_code(plan):
    """wqshao126/DTN's models re-initialise DTN's pos_proj with trunc-normal(0.02) after building it
    (models/vit_norm_mix.py, models/pvt_norm.py): every DTN row, at every scale, runs with pos_init=random."""
    runs = [r for r in plan.runs if get_path(r.config, "norm.name") == "dtn"]
    assert all(get_path(r.config, "norm.pos_init") == "random" for r in runs)


def check_sigma_reparam_rows_are_the_official_build(plan):
    """apple/ml-sigma-reparam: convert_to_sn converts the classifier (vision/layers.py); its ViTs
    (vision/vit.py): ViT-L's patch conv at init gain 0.125, and supervised, the class token, drop path 0.1 /
    0.2."""
    for run in plan.runs:
        if get_path(run.config, "norm.name") != "sigma_reparam":
            continue
        large = get_path(run.config, "backbone.name") == "vit_large"
        assert get_path(run.config, "norm.convert_classifier") is True
        if get_path(run.config, "task.pretrained"):
            continue  # a fine-tuning: the pre-training's normalizer (task.keep_pretrained_norm)
        assert get_path(run.config, "norm.conv_init_gain") == (0.125 if large else 1.0), run.overrides
        if get_path(run.config, "task.name") == "classification":
            assert get_path(run.config, "backbone.global_pool") == "token"
            assert get_path(run.config, "backbone.drop_path_rate") == (0.2 if large else 0.1)


@pytest.mark.parametrize("table", list_tables())
def test_every_table_plans_the_papers_recipes_at_full_scale_and_micro_members_at_smoke(plans, table):
    """One test per table, so that one worker plans each table (planning composes every point: seconds)."""
    full, smoke = plans[table, "full"], plans[table, "smoke"]
    check_full_scale_runs_are_the_papers_recipes(table, full)
    check_paper_entries_and_baselines_name_existing_rows(table, full)
    check_smoke_scale_runs_on_a_laptop(smoke)
    check_dtn_rows_start_their_position_weights_as_the_released_code(full)
    check_dtn_rows_start_their_position_weights_as_the_released_code(smoke)
    check_sigma_reparam_rows_are_the_official_build(full)
    check_run_ids_are_the_committed_ones(table, {"full": full, "smoke": smoke})


def check_run_ids_are_the_committed_ones(table, plans):
    """Every run a table plans keeps its identity (issue 52): a change to the configs, the constructors'
    options or a task's build that moves one fails here, naming the table; ``tests/run_ids.py`` says how to
    write the list again after a deliberate change."""
    committed = COMMITTED_RUN_IDS.get(table)
    assert committed is not None, f"{table}: no committed run identities; python tests/run_ids.py {table}"
    for scale, plan in plans.items():
        assert run_ids(plan) == committed[scale], (
            f"{table} at {scale}: the run identities moved (finished runs would run again); if deliberate, "
            f"python tests/run_ids.py {table}")


def test_classification_tables_read_the_reported_weights():
    """Each row's top-1 is of the weights its paper reports (metrics.reported, trainer.ema.reported)."""
    for table in list_tables():
        spec = load_table(table)
        top1 = next((m for m in spec.metrics if m.key == "top1"), None)
        assert top1 is None or top1.value == ("metrics.reported.top1",), table


def test_every_scale_loads():
    assert {"smoke", "full"} <= set(list_scales())
    for scale in list_scales():
        assert load_scale(scale).seeds


def test_a_scale_extends_another(tmp_path):
    """``extends``: the base's patterns after the file's own (first match wins), its task overrides replaced
    task by task."""
    path = tmp_path / "longer.yaml"
    path.write_text("extends: smoke\nseeds: [0, 1]\nreplace:\n  backbone:\n"
                    "    'vit_small': [backbone=vit_tiny]\n"
                    "overrides:\n  classification: [trainer.epochs=30]\n")
    scale, smoke = load_scale(str(path)), load_scale("smoke")
    assert scale.seeds == (0, 1)
    assert scale.apply(["backbone=vit_small"], "classification") == ["backbone=vit_tiny", "trainer.epochs=30"]
    assert scale.apply(["backbone=vit_base"], "classification") == ["backbone=vit_micro", "trainer.epochs=30"]
    assert scale.apply(["experiment=dit_imagenet"], "dit") == smoke.apply(["experiment=dit_imagenet"], "dit")


@pytest.mark.parametrize("seeds, says", [("0,0,1", "--seeds 0,0,1 repeats seed(s) 0: a seed is one run"),
                                         ("a", "--seeds takes comma-separated integers, e.g. 0,1,2; got")])
def test_seeds_are_distinct_integers_or_one_line(capsys, tmp_path, seeds, says):
    """A repeated seed is the same run counted again (``10.28 ± 0.00 (3)`` from one run): refused, as is a
    seed that is not a number, before anything is planned; a scale's seeds too."""
    with pytest.raises(SystemExit) as exited:
        cli.main(["render", "dyt_squash", "--seeds", seeds, "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.startswith(f"error: {says}") and err.count("\n") == 1
    assert not (tmp_path / "out").exists()
    (tmp_path / "twice.yaml").write_text("seeds: [1, 1]\n")
    with pytest.raises(UserError, match="seeds 1,1 repeats seed"):
        load_scale(str(tmp_path / "twice.yaml"))


def test_table_runs_are_named_after_the_rows_they_serve(plans):
    """Dashboards tell a table's runs apart by the rows they serve (both ViT sizes run as one micro member at
    smoke, so one name says both), and plot the table's metric."""
    from omegaconf import OmegaConf

    from normexp.tracking.records import display_name

    plan = plans["dyt_squash", "smoke"]
    names = sorted(plan.run_name(run) for run in plan.runs)
    squashes = ("hardtanh", "identity", "sigmoid", "tanh")
    assert names == [f"dyt_squash/ViT-S,ViT-B/{s}/s0" for s in squashes]
    overrides = plan.job_overrides(plan.runs[0])
    assert "+table.metric=final/val/top1" in overrides
    job = plans.compose([o for o in overrides if not o.startswith("hydra.")])
    assert display_name(OmegaConf.to_container(job, resolve=True)) == plan.run_name(plan.runs[0])


def test_composing_once_per_group_choice_is_hydras_composition(tmp_path):
    """Planning composes once per list of group choices and applies value overrides to a copy: the result
    is Hydra's own composition, for sweeps of values, additions, forced keys, lists, interpolations,
    deletions and a group that only a user's search path has."""
    from hydra import compose
    from omegaconf import OmegaConf

    (tmp_path / "configs" / "extra").mkdir(parents=True)
    (tmp_path / "configs" / "extra" / "short.yaml").write_text("# @package _global_\ntrainer:\n  epochs: 3\n")
    first = [f"hydra.searchpath=[file://{tmp_path}/configs]"]
    cases = [
        ["experiment=dyt_imagenet", "backbone=vit_base", "norm=dyt", "trainer.lr_factor=1.5",
         "+table.lr_factor=${trainer.lr_factor}"],
        ["experiment=dyt_imagenet", "backbone=vit_base", "norm=dyt", "trainer.lr_factor=0.5",
         "+table.lr_factor=${trainer.lr_factor}"],
        ["task=mae", "norm=dyt", "norm.alpha0=2.0", "++trainer.extra=1", "trainer.decay_milestones=[2]"],
        ["experiment=mae_finetune", "task.pretrained=/a/b", "~trainer.ema", "+extra=short"],
    ]
    with hydra_composer(first) as fast:
        for overrides in cases:
            expected = OmegaConf.to_container(compose(config_name="train", overrides=[*first, *overrides]))
            assert OmegaConf.to_container(fast(overrides)) == expected, overrides
