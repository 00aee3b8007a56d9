"""Bad input is refused before any work: one line naming the key, the value and what is allowed; exit 2;
nothing written (the directory Hydra made for the run is removed again)."""

from __future__ import annotations

import pytest
from conftest import quick_cfg, run_cli

from normexp.errors import UserError
from normexp.run import run

# (overrides, the start of the one line that refuses them)
REFUSED = [
    (["data.batch_size=0"], "data.batch_size=0: must be >= 1"),
    (["trainer.epochs=0"], "trainer.epochs=0: must be >= 1"),
    (["seed=abc"], "bad value for seed: Value 'abc' of type 'str' could not be converted to Integer"),
    (["seed=99999999999999999999"], "seed=99999999999999999999: out of range (integers must fit in 64 bits)"),
    (["trainer.lr=nan"], "trainer.lr=nan: must be a finite number"),
    (["trainer.lr=inf"], "trainer.lr=inf: must be a finite number"),
    (["trainer.lr=0"], "trainer.lr=0.0: must be > 0"),
    (["trainer.betas=[2,3]"], "trainer.betas[0]=2.0: must be < 1"),
    (["trainer.betas=[0.9]"], "trainer.betas=[0.9]: must have 2 values"),
    (["trainer.device=nosuch"], "trainer.device=nosuch: must be auto, cpu, cuda, cuda:<index>"),
    (["trainer.opt=adamww"], "trainer.opt=adamww: not an optimizer timm knows (did you mean adamw"),
    (["trainer.amp=fp8"], "trainer.amp=fp8: must be one of bf16, fp16, null"),
    (["trainer.mixup.prob=1.5"], "trainer.mixup.prob=1.5: must be <= 1"),
    (["trainer.best_metric=nosuch"], "trainer.best_metric=nosuch: task=classification reports val/top1, "),
    (["trainer.best_metric=ema/val/top1"], "trainer.best_metric=ema/val/top1: "),  # no EMA model in this run
    (["trainer.lr=${nosuch}"], "config key trainer.lr cannot be resolved: Interpolation key 'nosuch' not"),
    (["+trainer.epoch=3"], "unknown config key trainer.epoch: did you mean trainer.epochs? trainer has "),
    (["+data.bogus=1"], "unknown config key data.bogus: data has name, "),
    (["data.num_workers=-1"], "data.num_workers=-1: must be >= 0"),
    (["data.num_classes=5"], "data.num_classes=5, but data=digits has 10 classes: set data.num_classes=10"),
    (["norm.eps=abc"], "bad value for norm.eps: Value 'abc' of type 'str' could not be converted to Float"),
    (["norm.eps=0"], "norm.eps=0.0: must be > 0"),
    (["norm=dtn", "norm.pool_size=0"], "norm.pool_size=0: must be >= 1"),
    (["norm=dyt", "norm.squash=nosuch"], "norm.squash=nosuch: must be one of hardtanh, identity, sigmoid, "),
    (["norm=dyt", "norm.alpha0=0"], "norm.alpha0=0.0: must be > 0"),
    (["norm=dyt", "+norm.alpha=1"],
     "unknown config key norm.alpha: did you mean norm.alpha0, norm.alpha_init? norm has "),
    (["norm=gn", "norm.groups=7"], "cannot build backbone 'vit_micro' with norm 'gn': GroupNorm: 7 groups "
                                   "must divide dim=96"),
    (["+backbone.depthh=3"], "cannot build backbone 'vit_micro' with norm 'ln': "),
    (["backbone.img_size=17"], "backbone.img_size=17 is not a multiple of backbone.patch_size=2"),
    (["backbone.img_size=18"], "backbone.img_size=18 but the images are data.img_size=8 px"),
    (["task=detection", "data=digits"], "task=detection reads data=coco or data=coco_digits, not data=dig"),
    (["trainer.mixup.mixup_alpha=0.8", "data.batch_size=7"], "data.batch_size=7: Mixup / CutMix "),
    (["trainer.global_batch=100"], "trainer.global_batch=100 is not a whole number of steps of data.batch_"
                                   "size=64 on 1 process: use a data.batch_size that divides 100 (e.g. data."
                                   "batch_size=50)"),
    (["logger=mlflow", "+logger.nosuch={}"], "unknown logger(s) ['nosuch']"),
    (["task=robustness"], "task=robustness needs task.checkpoint="),
    # issue 47 (22): a name its directory cannot hold was ENAMETOOLONG
    ([f"name={'x' * 250}"], f"name={'x' * 250}: 250 bytes long: a run's directory is named <name>-<run id>, "
                            "and a file name holds 255 bytes; give a name of at most 246"),
]


@pytest.mark.parametrize("overrides,message", REFUSED, ids=[" ".join(o) for o, _ in REFUSED])
def test_bad_config_is_refused_before_anything_is_built_or_written(tmp_path, overrides, message):
    with pytest.raises(UserError) as error:
        run(quick_cfg(*overrides), tmp_path / "run")
    assert str(error.value).startswith(message), str(error.value)
    assert "\n" not in str(error.value)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("overrides,message", [
    (["trainer.lrr=1"], "error: unknown config key trainer.lrr: did you mean trainer.lr? trainer has "),
    (["-m", "trainer.lr=1=2"], "error: cannot parse the override 'trainer.lr=1=2': "),  # the override, not -m
    (["norm=gn", "norm.groups=7"], "error: cannot build backbone 'vit_micro' with norm 'gn': "),
])
def test_command_line_mistakes_are_one_line_exit_2_and_leave_nothing(tmp_path, overrides, message):
    """Hydra's own errors (before the run) and ours (in it) alike: one line, no traceback, no directory."""
    out = run_cli(*overrides, "logger=none", env={"NORMEXP_OUTPUT_DIR": str(tmp_path / "out")})
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), out.stderr[-2000:]
    assert not (tmp_path / "out").exists() or not any(p.is_file() for p in (tmp_path / "out").rglob("*"))




def test_an_open_group_that_is_not_a_mapping_is_one_line():
    """The schema pass checks the open groups (backbone, norm, ...) are mappings without converting them."""
    from normexp.config import RunSchema, fit_schema

    with pytest.raises(UserError, match=r"^bad value for backbone: a mapping of options, not int$"):
        fit_schema(RunSchema, {"backbone": 3}, "")
    with pytest.raises(UserError, match=r"^bad value for task: a mapping of options, not NoneType$"):
        fit_schema(RunSchema, {"task": None}, "")
    assert fit_schema(RunSchema, {"table": None, "backbone": {"name": "vit_micro"}}, "").seed == 0
