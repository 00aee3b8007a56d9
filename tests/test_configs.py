"""The config tree: every group option composes, the CLI prints and rejects as Hydra does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import CONFIG_DIR, compose_cfg, run_cli
from omegaconf import OmegaConf

from normexp.models import build_backbone
from normexp.preflight import validate

GROUPS = ("backbone", "norm", "task", "data", "logger", "trainer", "experiment", "launcher")


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (Path(CONFIG_DIR) / group).glob("*.yaml"))


def test_default_is_the_embedded_demo():
    cfg = compose_cfg()
    assert (cfg.backbone.name, cfg.norm.name, cfg.data.name, cfg.task.name) == \
        ("vit_micro", "ln", "digits", "classification")
    assert list(cfg.logger) == ["wandb"] and cfg.logger.wandb.mode == "offline"
    assert cfg.backbone.num_classes == 10 and cfg.backbone.img_size == cfg.data.img_size


def shipped(group: str, option: str) -> list[str]:
    """The overrides that run a shipped option with the data and task it is made for."""
    overrides = [f"{group}={option}"]
    if group == "backbone" and option.startswith("dit_"):
        overrides.append("task=dit")  # a diffusion model
    elif group == "backbone" and not option.endswith("_micro"):
        overrides.append("data=imagenet")  # the published sizes take ImageNet's 224 px
    if group == "data" and option.startswith("coco"):
        overrides.append("task=detection")  # the task that reads that data
    prefix = option.split("_")[0]
    if group == "trainer" and prefix in options("task"):
        overrides.append(f"task={prefix}")  # a task's recipe (detection_1x, mae_digits): its metric
    return overrides


@pytest.mark.parametrize("group", GROUPS)
def test_every_shipped_option_composes_resolves_and_fits_the_schema(group):
    assert options(group), f"no options in configs/{group}/"
    for option in options(group):
        cfg = compose_cfg(*shipped(group, option))
        resolved = OmegaConf.to_container(cfg, resolve=True)
        if group == "logger":  # loggers sit side by side (logger=[wandb,mlflow]) under their names
            assert list(resolved.get("logger", {})) == ([] if option == "none" else [option])
        elif group in ("backbone", "norm", "task", "data"):
            assert resolved[group]["name"] == option
        validate(cfg, environment=False)


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
    """wqshao126/DTN train.py: DeiT's recipe at global batch 1024, only the peak lr scaled."""
    cfg = compose_cfg("experiment=dtn_imagenet")
    t = cfg.trainer
    assert (cfg.backbone.name, cfg.norm.name, cfg.backbone.dtn_blocks) == ("vit_small_dtn", "dtn", 10)
    assert (t.epochs, t.lr, t.lr_base_size, t.weight_decay, t.warmup_epochs) == (300, 5e-4, 512, 0.05, 5)
    assert (t.global_batch, cfg.data.aug_repeats) == (1024, 3)
    assert (t.lr_scale_warmup_min, t.warmup_lr, t.min_lr) == (False, 1e-6, 1e-5)  # absolute
    assert (t.mixup.mixup_alpha, t.mixup.cutmix_alpha) == (0, 0)
    assert (cfg.data.reprob, cfg.data.color_jitter, cfg.seed, t.amp) == (0, 0.4, 42, None)
    assert t.ema.enabled and t.best_metric == "ema/val/top1" and cfg.backbone.drop_path_rate == 0.1
    assert compose_cfg("experiment=dtn_imagenet", "norm=ln").norm.eps == 1e-5  # the DTN code's LN
    assert compose_cfg("experiment=dtn_imagenet", "backbone=vit_base_dtn").backbone.name == "vit_base_dtn"


def test_dtn_pvt_recipe_values():
    """wqshao126/DTN models/pvt_norm.py + train.py on top of dtn_imagenet."""
    cfg = compose_cfg("experiment=dtn_pvt_imagenet", "backbone=pvt_tiny")
    b = cfg.backbone
    assert (list(b.num_heads), b.dtn_stages) == ([4, 4, 5, 8], 3)
    assert b.drop_path_rate == 0.1 and cfg.trainer.global_batch == 1024
    assert (cfg.data.crop_pct, cfg.norm.name, cfg.norm.pool_size) == (0.9, "dtn", 14)
    assert build_backbone(b, cfg.norm).no_weight_decay() == {"cls_token"}  # pos_embed{s} decay


# DyT App. A / jiachenzhu/DyT README, per model: drop path, AdamW betas
DYT_MODELS = {"vit_base": (0.1, [0.9, 0.999]), "vit_large": (0.4, [0.9, 0.95]),
              "convnext_base": (0.5, [0.9, 0.999]), "convnext_large": (0.5, [0.9, 0.999])}


@pytest.mark.parametrize("backbone", sorted(DYT_MODELS))
def test_dyt_recipe_values(backbone):
    cfg = compose_cfg("experiment=dyt_imagenet", f"backbone={backbone}")
    t, d = cfg.trainer, cfg.data
    assert (t.opt, t.lr, t.lr_base_size, t.global_batch, t.weight_decay) == ("adamw", 4e-3, 4096, 4096, 0.05)
    assert (t.epochs, t.warmup_epochs, t.warmup_lr, t.min_lr) == (300, 20, 0, 1e-6)
    assert not t.lr_scale_warmup_min  # ConvNeXt's main.py: only lr is "for total batch size 4096"
    assert (t.ema.enabled, t.ema.decay, t.amp, t.clip_grad, t.smoothing) == (True, 0.9999, None, None, 0.1)
    mixup = t.mixup
    assert (mixup.mixup_alpha, mixup.cutmix_alpha, mixup.prob, mixup.switch_prob) == (0.8, 1.0, 1.0, 0.5)
    assert (d.auto_augment, d.reprob, d.aug_repeats, d.color_jitter, d.crop_pct) == \
        ("rand-m9-mstd0.5-inc1", 0.25, 0, 0.4, 0.875)
    assert cfg.norm.name == "dyt" and cfg.backbone.global_pool == "avg"
    assert (cfg.backbone.drop_path_rate, list(t.betas)) == DYT_MODELS[backbone]
    with torch.device("meta"):  # builds as configured: ViT with fc_norm after pooling, DyT in every slot
        model = build_backbone(cfg.backbone, cfg.norm)
    assert not any(isinstance(m, torch.nn.LayerNorm) for m in model.modules())
    if backbone.startswith("vit"):
        assert type(model.fc_norm).__name__ == "DyT" and isinstance(model.norm, torch.nn.Identity)


# global batch and repeated augmentation of each paper's recipe (its main.py / launch scripts)
RECIPE_BATCH = {"deit_imagenet": (1024, 3), "dtn_imagenet": (1024, 3), "dtn_pvt_imagenet": (1024, 3),
                "pvt_imagenet": (1024, 3), "levit_imagenet": (2048, 3), "swin_imagenet": (1024, 0),
                "t2t_imagenet": (512, 0), "dyt_imagenet": (4096, 0), "retinanet_pvt_1x": (16, None),
                "mask_rcnn_pvt_1x": (16, None), "mask_rcnn_swin_1x": (16, None),
                # MAE PRETRAIN.md / FINETUNE.md / LINPROBE.md; DyT's DINO commands (32 x 32, 176 x 6)
                "mae_pretrain": (4096, 0), "mae_finetune": (1024, 0), "mae_finetune_large": (1024, 0),
                "mae_linprobe": (16384, 0), "dino_vitb16": (1024, 0), "dino_vitb8": (1056, 0),
                "dit_imagenet": (256, 0),
                "torchvision_imagenet": (256, 0)}  # pytorch/vision references/classification: 32 x 8 GPUs


def test_every_recipe_states_its_global_batch():
    assert set(RECIPE_BATCH) == set(options("experiment"))
    for recipe, (batch, repeats) in RECIPE_BATCH.items():
        cfg = compose_cfg(f"experiment={recipe}")
        assert cfg.trainer.global_batch == batch, recipe
        assert cfg.data.get("aug_repeats") == repeats, recipe
    assert compose_cfg().trainer.global_batch is None and compose_cfg("data=imagenet").data.aug_repeats == 0


# How each recipe's code runs its loop: the lr stepped per update or per epoch and with which index
# (sched_on, sched_lag), the cosine after the warm-up or over it (warmup_prefix), cool-down epochs, epochs in
# all, whether the reported top-1 is the EMA model's, and the precision.
RECIPE_LOOP = {
    # facebookresearch/deit main.py: lr_scheduler.step(epoch) after each epoch; evaluate(model); AMP autocast
    "deit_imagenet": ("epoch", 1, False, 0, 300, False, "bf16"),
    # wqshao126/DTN train.py (timm's train.py): step(epoch + 1); validates model_ema; amp off in its configs
    "dtn_imagenet": ("epoch", 0, False, 0, 300, True, None),
    "dtn_pvt_imagenet": ("epoch", 0, False, 0, 300, True, None),
    # whai362/PVT classification/main.py (DeiT's): step(epoch); no EMA
    "pvt_imagenet": ("epoch", 1, False, 0, 300, False, "bf16"),
    # facebookresearch/LeViT main.py: step(epoch); evaluate(model); engine.py trains in float32
    "levit_imagenet": ("epoch", 1, False, 0, 1000, False, None),
    # yitu-opensource/T2T-ViT main.py (timm's train.py): step(epoch + 1), the num_epochs create_scheduler
    # returns (300 + 10 cool-down), validates model_ema; README: --amp
    "t2t_imagenet": ("epoch", 0, False, 10, 310, True, "bf16"),
    # microsoft/Swin-Transformer lr_scheduler.py as released with the paper: per step, t_initial = all steps
    "swin_imagenet": ("update", 0, False, 0, 300, False, "bf16"),
    # jiachenzhu/DyT = facebookresearch/ConvNeXt utils.cosine_scheduler: per iteration, cosine after warm-up
    "dyt_imagenet": ("update", 0, True, 0, 300, True, None),
    # facebookresearch/mae util/lr_sched.py: per iteration, half-cycle cosine after the warm-up; autocast
    "mae_pretrain": ("update", 0, True, 0, 800, False, "fp16"),
    "mae_finetune": ("update", 0, True, 0, 100, False, "fp16"),
    "mae_finetune_large": ("update", 0, True, 0, 50, False, "fp16"),
    "mae_linprobe": ("update", 0, True, 0, 90, False, "fp16"),
    # facebookresearch/dino utils.cosine_scheduler: per iteration, cosine after the warm-up; fp32 (DyT)
    "dino_vitb16": ("update", 0, True, 0, 400, False, None),
    "dino_vitb8": ("update", 0, True, 0, 300, False, None),
    # pytorch/vision references/classification train.py: lr_scheduler.step() after each epoch (StepLR), no
    # warm-up, the trained model, float32 (no --amp)
    "torchvision_imagenet": ("epoch", 0, False, 0, 90, False, None),
}


@pytest.mark.parametrize("recipe", sorted(RECIPE_LOOP))
def test_each_recipe_runs_its_codes_loop(recipe):
    t = compose_cfg(f"experiment={recipe}").trainer
    assert (t.sched_on, t.sched_lag, t.warmup_prefix, t.cooldown_epochs, t.epochs, t.ema.reported, t.amp) \
        == RECIPE_LOOP[recipe]
    assert not t.sync_bn  # BatchNorm with per-GPU statistics: none of these codes passes --sync-bn


# gradient clipping of each recipe's code (None: none); the demo clips at 1.0 (trainer/default.yaml)
RECIPE_CLIP = {
    "deit_imagenet": None, "dtn_imagenet": None, "dtn_pvt_imagenet": None,  # --clip-grad default None
    "pvt_imagenet": None,  # classification/configs/pvt/pvt_small.py: clip_grad None (medium/large: 1.0)
    "levit_imagenet": 0.01, "swin_imagenet": 5.0, "t2t_imagenet": None, "dyt_imagenet": None,
    "retinanet_pvt_1x": None, "mask_rcnn_pvt_1x": None, "mask_rcnn_swin_1x": None,  # grad_clip=None
    "mae_pretrain": None, "mae_finetune": None, "mae_finetune_large": None, "mae_linprobe": None,
    "dino_vitb16": 0.3, "dino_vitb8": 3.0,  # per parameter (clip_mode=param), as DINO's clip_gradients
    "dit_imagenet": None, "torchvision_imagenet": None,  # train.py --clip-grad-norm None
}


def test_only_the_recipes_that_clip_gradients_clip_them():
    assert set(RECIPE_CLIP) == set(options("experiment"))
    for recipe, clip in RECIPE_CLIP.items():
        assert compose_cfg(f"experiment={recipe}").trainer.clip_grad == clip, recipe
    assert compose_cfg().trainer.clip_grad == 1.0 and compose_cfg("task=detection").trainer.clip_grad is None


def test_t2t_data_as_its_code_resolves_it():
    """T2T-ViT main.py: --train-interpolation random; evaluation from models/t2t_vit.py's default_cfg
    (crop_pct 0.9, bicubic)."""
    from normexp.data.transforms import build_transforms

    d = compose_cfg("experiment=t2t_imagenet").data
    assert (d.train_interpolation, d.interpolation, d.crop_pct) == ("random", "bicubic", 0.9)
    crop = build_transforms(d, is_training=True).transforms[0]
    assert [str(m) for m in crop.interpolation] == ["InterpolationMode.BILINEAR", "InterpolationMode.BICUBIC"]
    assert build_transforms(d, is_training=False).transforms[0].size == 248  # 224 / 0.9
    assert compose_cfg("experiment=deit_imagenet").data.train_interpolation is None  # = interpolation


def test_loop_settings_that_contradict_each_other_are_one_line():
    from normexp.errors import UserError
    from normexp.preflight import validate

    for overrides, message in [(["trainer.ema.reported=true"], "needs trainer.ema.enabled=true"),
                               (["trainer.sched_on=epoch", "trainer.warmup_iters=10"], "sched_on=update"),
                               (["trainer.epochs=5", "trainer.cooldown_epochs=5"], "no epochs")]:
        with pytest.raises(UserError, match=message):
            validate(compose_cfg(*overrides))


def test_deit_based_recipes_scale_only_the_peak_lr():
    for recipe in ("deit_imagenet", "dtn_imagenet", "pvt_imagenet", "levit_imagenet"):
        assert not compose_cfg(f"experiment={recipe}").trainer.lr_scale_warmup_min, recipe
    assert compose_cfg("experiment=swin_imagenet").trainer.lr_scale_warmup_min  # Swin scales all three


def test_cfg_job_prints_the_config():
    out = run_cli("--cfg", "job", "--resolve", "norm=dyt")
    assert out.returncode == 0, out.stderr
    cfg = OmegaConf.create(out.stdout)
    assert cfg.norm.name == "dyt" and cfg.backbone.img_size == 16


def test_dyt_alpha0_is_the_papers_unless_the_backbone_suggests_one():
    assert compose_cfg("norm=dyt", "backbone=vit_small").norm.alpha0 == 0.5
    assert compose_cfg("norm=dyt").norm.alpha0 == 1.0  # vit_micro's suggestion
    assert compose_cfg("norm=dyt", "norm.alpha0=0.7").norm.alpha0 == 0.7  # the command line wins


def test_unknown_option_lists_the_available_ones(tmp_path):
    out = run_cli("norm=dytt", env={"NORMEXP_OUTPUT_DIR": str(tmp_path)})
    assert out.returncode == 2 and out.stderr.count("\n") == 1  # one line, no traceback
    assert out.stderr.startswith("error: norm=dytt: no such option; did you mean norm=dyt? the options are ")
    for option in ("ln", "dyt", "rms"):
        assert f" {option}," in out.stderr
    assert not any(tmp_path.iterdir())
