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


# What each recipe's source pins, each value once (the recipe's yaml cites the same source line by line):
# global batch (gb), repeated augmentation (rep), how the lr is stepped (sched_on, sched_lag, warmup_prefix),
# cool-down and total epochs, whether the reported top-1 is the EMA model's (ema), precision (amp), gradient
# clipping (clip), whether warm-up and minimum lr scale with the batch like the peak (lr_min); None: unpinned.
LOOP = ("gb", "rep", "sched_on", "sched_lag", "warmup_prefix", "cooldown", "epochs", "ema", "amp", "clip",
        "lr_min")
RECIPES = {
    # facebookresearch/deit main.py: step(epoch) after each epoch; evaluate(model); AMP autocast
    "deit_imagenet": (1024, 3, "epoch", 1, False, 0, 300, False, "bf16", None, False),
    # wqshao126/DTN train.py (timm's): step(epoch + 1); validates model_ema; amp off in its configs
    "dtn_imagenet": (1024, 3, "epoch", 0, False, 0, 300, True, None, None, False),
    "dtn_pvt_imagenet": (1024, 3, "epoch", 0, False, 0, 300, True, None, None, False),
    # whai362/PVT classification/main.py (DeiT's); configs/pvt/pvt_small.py: clip_grad None
    "pvt_imagenet": (1024, 3, "epoch", 1, False, 0, 300, False, "bf16", None, False),
    # facebookresearch/LeViT main.py: step(epoch); engine.py trains in float32; --clip-grad 0.01
    "levit_imagenet": (2048, 3, "epoch", 1, False, 0, 1000, False, None, 0.01, False),
    # yitu-opensource/T2T-ViT main.py (timm's): step(epoch + 1), 300 + 10 cool-down epochs, model_ema; --amp
    "t2t_imagenet": (512, 0, "epoch", 0, False, 10, 310, True, "bf16", None, None),
    # microsoft/Swin-Transformer lr_scheduler.py as released: per step over all steps; clip 5.0; scales all
    "swin_imagenet": (1024, 0, "update", 0, False, 0, 300, False, "bf16", 5.0, True),
    # jiachenzhu/DyT = facebookresearch/ConvNeXt utils.cosine_scheduler: per iteration after the warm-up
    "dyt_imagenet": (4096, 0, "update", 0, True, 0, 300, True, None, None, False),
    # facebookresearch/mae PRETRAIN.md / FINETUNE.md / LINPROBE.md, util/lr_sched.py; autocast
    "mae_pretrain": (4096, 0, "update", 0, True, 0, 800, False, "fp16", None, None),
    "mae_finetune": (1024, 0, "update", 0, True, 0, 100, False, "fp16", None, None),
    "mae_finetune_large": (1024, 0, "update", 0, True, 0, 50, False, "fp16", None, None),
    "mae_linprobe": (16384, 0, "update", 0, True, 0, 90, False, "fp16", None, None),
    # MAE's fine-tuning loop at arXiv 2605.14047's 20 epochs (the source's head and pooling kept)
    "convert_finetune": (1024, 0, "update", 0, True, 0, 20, False, "fp16", None, None),
    # facebookresearch/dino utils.cosine_scheduler; DyT's DINO commands (32 x 32, 176 x 6); per-param clip
    "dino_vitb16": (1024, 0, "update", 0, True, 0, 400, False, None, 0.3, None),
    "dino_vitb8": (1056, 0, "update", 0, True, 0, 300, False, None, 3.0, None),
    # pytorch/vision references/classification train.py: 32 x 8 GPUs, StepLR per epoch, float32
    "torchvision_imagenet": (256, 0, "epoch", 0, False, 0, 90, False, None, None, None),
    # facebookresearch/DiT train.py; mmdet's 1x schedules (grad_clip=None)
    "dit_imagenet": (256, 0, None, None, None, None, None, None, None, None, None),
    "retinanet_pvt_1x": (16, None, None, None, None, None, None, None, None, None, None),
    "mask_rcnn_pvt_1x": (16, None, None, None, None, None, None, None, None, None, None),
    "mask_rcnn_swin_1x": (16, None, None, None, None, None, None, None, None, None, None),
}


def _loop(cfg) -> tuple:
    t = cfg.trainer
    return (t.global_batch, cfg.data.get("aug_repeats"), t.sched_on, t.sched_lag, t.warmup_prefix,
            t.cooldown_epochs, t.epochs, t.ema.reported, t.amp, t.clip_grad, t.lr_scale_warmup_min)


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_each_recipe_runs_its_sources_loop(recipe):
    cfg = compose_cfg(f"experiment={recipe}")
    pinned = {k: v for k, v in zip(LOOP, RECIPES[recipe], strict=True) if v is not None}
    assert {k: v for k, v in zip(LOOP, _loop(cfg), strict=True) if k in pinned} == pinned
    assert RECIPES[recipe][1] is not None or "aug_repeats" not in cfg.data  # detection data: no RASampler
    assert not cfg.trainer.sync_bn  # BatchNorm with per-GPU statistics: none of these codes passes --sync-bn


def test_every_recipe_cites_its_source_here():
    assert set(RECIPES) == set(options("experiment"))


def test_a_group_on_the_command_line_wins_over_the_recipes_choice():
    assert compose_cfg("experiment=deit_imagenet", "backbone=vit_tiny").backbone.name == "vit_tiny"
    assert compose_cfg("experiment=dtn_imagenet", "backbone=vit_base_dtn").backbone.name == "vit_base_dtn"
    assert compose_cfg("experiment=dtn_imagenet", "norm=ln").norm.eps == 1e-5  # the backbone's suggestion


def test_dtn_pvt_recipe_builds_the_dtn_codes_pvt():
    """wqshao126/DTN models/pvt_norm.py: heads [4, 4, 5, 8], norm in stages 1-3, pos_embeds decayed."""
    cfg = compose_cfg("experiment=dtn_pvt_imagenet", "backbone=pvt_tiny")
    b = cfg.backbone
    assert (list(b.num_heads), b.dtn_stages, cfg.norm.pool_size) == ([4, 4, 5, 8], 3, 14)
    assert build_backbone(cfg.backbone, cfg.norm).no_weight_decay() == {"cls_token"}


# DyT App. A / jiachenzhu/DyT README, per model: drop path, AdamW betas
DYT_MODELS = {"vit_base": (0.1, [0.9, 0.999]), "vit_large": (0.4, [0.9, 0.95]),
              "convnext_base": (0.5, [0.9, 0.999]), "convnext_large": (0.5, [0.9, 0.999])}


@pytest.mark.parametrize("backbone", sorted(DYT_MODELS))
def test_dyt_recipe_builds_each_model_as_its_paper(backbone):
    cfg = compose_cfg("experiment=dyt_imagenet", f"backbone={backbone}")
    assert (cfg.backbone.drop_path_rate, list(cfg.trainer.betas)) == DYT_MODELS[backbone]
    with torch.device("meta"):  # builds as configured: ViT with fc_norm after pooling, DyT in every slot
        model = build_backbone(cfg.backbone, cfg.norm)
    assert not any(isinstance(m, torch.nn.LayerNorm) for m in model.modules())
    if backbone.startswith("vit"):
        assert type(model.fc_norm).__name__ == "DyT" and isinstance(model.norm, torch.nn.Identity)


def test_no_yaml_value_restates_a_code_default():
    """Each value has one source: a normalizer's options are its constructor's defaults (composed as
    ``norm/code/<name>``), a model's the values its constructor builds with (``backbone/code/<name>``), and
    each yaml states what differs; the data schemas hold types and checks, the data yamls every value."""
    from restated_defaults import restatements

    assert restatements() == {"norm": [], "data": [], "backbone": []}


def test_every_normalizer_option_is_in_the_config_at_its_constructors_default():
    """A norm yaml composes ``norm/code/<name>`` first: every option is overridable without ``+`` and holds
    the constructor's default unless the yaml states otherwise."""
    from normexp.code_defaults import norm_defaults

    for path in sorted(Path(CONFIG_DIR, "norm").glob("*.yaml")):
        norm, stated = compose_cfg(f"norm={path.stem}").norm, OmegaConf.load(path)
        for option, default in (norm_defaults(path.stem) or {}).items():
            assert option in stated or norm[option] == default, f"norm={path.stem}: {option}"
    cfg = compose_cfg("norm=ln", "norm.affine=false")  # stated in no yaml
    with torch.device("meta"):
        model = build_backbone(cfg.backbone, cfg.norm)
    norms = [m for m in model.modules() if isinstance(m, torch.nn.LayerNorm)]
    assert norms and all(m.weight is None for m in norms)


def test_a_backbones_options_are_in_its_config_at_the_values_its_constructor_builds_with():
    """A size yaml composes ``backbone/code/<name>`` after its family: every option its family shows
    (``config_options``) holds the constructor's value unless the size yaml states otherwise, and no family
    yaml states one (the code node, composed after it, would override it unseen)."""
    from restated_defaults import backbone_files

    from normexp.models.registry import config_defaults

    for path, sizes in backbone_files().items():
        stated = OmegaConf.load(path)
        for name in sizes:
            options = config_defaults(name)
            assert options, name
            if path.parent.name == "family":
                assert not set(options) & set(stated), f"{path.name} states {set(options) & set(stated)}"
                continue
            backbone = compose_cfg(f"backbone={name}").backbone
            for option, value in options.items():
                value = [list(v) if isinstance(v, tuple) else v for v in value] \
                    if isinstance(value, tuple) else value
                assert option in stated or backbone[option] == value, f"backbone={name}: {option}"
    overridden = compose_cfg("backbone=vit_small", "backbone.drop_path_rate=0.2")  # the yaml states none
    assert compose_cfg("backbone=vit_small").backbone.drop_path_rate == 0.1
    assert overridden.backbone.drop_path_rate == 0.2


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


def test_a_suggested_option_falls_back_on_the_constructors_default(monkeypatch):
    """``${suggested:<path>}`` (norm alpha0 and eps, DiT's zero_init): the other group's suggestion where
    there is one, else the constructor's own default -- change DyT's default in the code and the config
    follows."""
    from normexp import code_defaults

    dyt = code_defaults.norm_defaults("dyt")
    assert compose_cfg("norm=dyt", "backbone=vit_base").norm.alpha0 == dyt["alpha0"]
    assert compose_cfg("norm=ln", "backbone=dit_micro", "task=dit").backbone.zero_init == "all"
    assert compose_cfg("norm=dyt", "backbone=dit_micro", "task=dit").backbone.zero_init == "none"
    real = code_defaults.norm_defaults
    monkeypatch.setattr(code_defaults, "norm_defaults",
                        lambda name: {**real(name), "alpha0": 0.7} if name == "dyt" else real(name))
    assert OmegaConf.create({"norm": {"name": "dyt", "alpha0": "${suggested:backbone.norm_defaults.alpha0}"},
                             "backbone": {}}).norm.alpha0 == 0.7
    assert OmegaConf.create({"norm": {"name": "dyt", "alpha0": "${suggested:backbone.norm_defaults.alpha0}"},
                             "backbone": {"norm_defaults": {"alpha0": 2.0}}}).norm.alpha0 == 2.0


def test_the_restated_defaults_counter_reads_a_fallback_as_a_statement(tmp_path):
    """An ``oc.select`` fallback restates a default as surely as a plain value (issue 52: the counter skipped
    interpolations and reported 0 over five)."""
    from restated_defaults import _statements

    path = tmp_path / "dyt.yaml"
    path.write_text("name: dyt\nalpha0: ${oc.select:backbone.norm_defaults.alpha0,0.5}\n"
                    "eps: ${oc.select:a.b,1.0e-6}\nkind: ${suggested:x.y}\nwidth: ${data.img_size}\n")
    assert _statements(path) == {"alpha0": 0.5, "eps": 1e-6}


def test_a_new_constructor_option_moves_every_identity_unless_listed(monkeypatch):
    """A normalizer option added to its constructor enters every run's config (``norm/code/<name>``) and so
    its identity; ``IDENTITY_DEFAULTS`` at the option's old-behaviour value keeps finished runs theirs. The
    committed tables' identities (tests/run_ids.json) catch the first case; this shows the mechanism."""
    from hydra import compose

    from normexp import code_defaults
    from normexp.tables.plan import resolved
    from normexp.tracking import provenance
    from normexp.tracking.provenance import config_hash

    def identity() -> str:
        with code_defaults.config_tree():
            return config_hash(resolved(compose(config_name="train", overrides=["norm=dyt"])))

    before = identity()
    real = code_defaults.norm_defaults
    monkeypatch.setattr(code_defaults, "norm_defaults",
                        lambda name: {**real(name), "new_option": 3} if name == "dyt" else real(name))
    try:
        moved = identity()
        monkeypatch.setitem(provenance.IDENTITY_DEFAULTS, "norm.new_option", 3)
        kept = identity()
    finally:
        monkeypatch.undo()
        code_defaults.register()  # the real nodes back in Hydra's ConfigStore
    assert moved != before and kept == before
