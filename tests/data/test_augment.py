"""Every augmentation of every recipe runs on real JPEGs: each RandAugment op of rand-m9-mstd0.5-inc1 at its
extreme magnitudes, and the recipes' full training transforms (and Mixup/CutMix) over a generated tree.
Unreadable files are skipped and counted, or stop the run with one line naming the file."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import compose_cfg, quick_cfg, run_cli
from PIL import Image
from timm.data import auto_augment
from timm.data.mixup import Mixup

from normexp.data import build_classification_data
from normexp.data.transforms import TFRandomResizedCrop, posterize
from normexp.optim import MAELars
from normexp.run import run

RECIPES = ["deit_imagenet", "dtn_imagenet", "swin_imagenet", "pvt_imagenet", "levit_imagenet", "t2t_imagenet",
           "dyt_imagenet", "mae_linprobe"]


def photo(seed: int, size: tuple[int, int] = (96, 80)) -> Image.Image:
    """A JPEG-decoded image with structure (gradients, a disc) and noise, like a photo's statistics."""
    rng = np.random.default_rng(seed)
    h, w = size[1], size[0]
    y, x = np.mgrid[0:h, 0:w]
    disc = ((x - w / 2) ** 2 + (y - h / 2) ** 2 < (h / 3) ** 2) * 200
    base = np.stack([x * 255 / w, y * 255 / h, disc], -1)
    pixels = np.clip(base + rng.normal(0, 25, base.shape), 0, 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG", quality=85)
    return Image.open(io.BytesIO(buffer.getvalue())).convert("RGB")


def jpeg_tree(root: Path, classes: int = 4, train: int = 16, val: int = 4) -> Path:
    for split, count in (("train", train), ("val", val)):
        for c in range(classes):
            folder = root / split / f"n{c:08d}"
            folder.mkdir(parents=True)
            for i in range(count):
                image = photo(c * 1000 + i, size=(260 + 40 * (i % 3), 240))
                image.save(folder / f"{i}.JPEG", quality=85)
    return root


@pytest.mark.parametrize("name", auto_augment._RAND_INCREASING_TRANSFORMS)
@pytest.mark.parametrize("magnitude", [0, 10])
def test_randaugment_op_at_extreme_magnitudes(name, magnitude):
    op = auto_augment.AugmentOp(name, prob=1.0, magnitude=magnitude,
                                hparams={"img_mean": (124, 116, 104), "magnitude_std": 0})
    out = op(photo(magnitude))
    assert isinstance(out, Image.Image) and out.size == (96, 80) and out.mode == "RGB"


def test_posterize_keeps_what_older_pillow_returned():
    image = photo(1)
    assert not np.asarray(posterize(image, 0)).any()  # 0 bits: black, as Pillow <= 12
    assert np.array_equal(np.asarray(posterize(image, 8)), np.asarray(image))
    assert (np.asarray(posterize(image, 2)) & 0b00111111 == 0).all()
    increasing = auto_augment.AugmentOp("PosterizeIncreasing", prob=1.0, magnitude=10, hparams={})
    assert not np.asarray(increasing(image)).any()  # the inc1 schedule's top magnitude: 0 bits


def tf_crop_box(width: int, height: int, scale: tuple, ratio: tuple) -> tuple[int, int, int, int]:
    """MAE's ``util/crop.py`` box from torch's generator, as that file draws it: the area share, then the
    log aspect ratio, each once; the rounded sides clamped to the image; the top, then the left offset."""
    share = torch.empty(1).uniform_(scale[0], scale[1]).item()
    log_ratio = torch.log(torch.tensor(ratio))
    aspect = torch.exp(torch.empty(1).uniform_(log_ratio[0], log_ratio[1])).item()
    w = min(int(round((width * height * share * aspect) ** 0.5)), width)
    h = min(int(round((width * height * share / aspect) ** 0.5)), height)
    top = torch.randint(0, height - h + 1, size=(1,)).item()
    return top, torch.randint(0, width - w + 1, size=(1,)).item(), h, w


def test_the_tf_crop_draws_maes_box_and_never_falls_back_to_the_centre():
    image = photo(0, size=(120, 90))
    for scale, ratio in (((0.08, 1.0), (3 / 4, 4 / 3)), ((0.9, 1.0), (2.0, 3.0))):
        for seed in range(20):
            torch.manual_seed(seed)
            expected = tf_crop_box(120, 90, scale, ratio)
            torch.manual_seed(seed)
            assert TFRandomResizedCrop.get_params(image, scale, ratio) == expected
    # a box wider than the image: torchvision's draws fail and it crops the centre; TF's is clamped, anywhere
    tops = set()
    for seed in range(20):
        torch.manual_seed(seed)
        top, left, h, w = TFRandomResizedCrop.get_params(image, (0.9, 1.0), (2.0, 3.0))
        assert w == 120 and left == 0
        tops.add(top)
    assert len(tops) > 3


def test_mae_linear_probe_trains_with_lars_and_the_tf_crop_on_jpegs(tmp_path, run_dir, monkeypatch):
    """experiment=mae_linprobe at a micro size on a JPEG tree: MAE's LARS on the head alone, the TF crop."""
    root = jpeg_tree(tmp_path / "imagenet", classes=2, train=8, val=2)
    cfg = quick_cfg("experiment=mae_linprobe", "backbone=vit_micro", f"data.root={root}",
                    "data.num_classes=2", "data.img_size=32", "data.batch_size=4", "data.eval_batch_size=4",
                    "data.num_workers=0", "data.pin_memory=false", "backbone.patch_size=8",
                    "trainer.global_batch=null", "trainer.amp=null", "trainer.warmup_epochs=0")
    data = build_classification_data(cfg.data, seed=0)
    assert isinstance(data.train.dataset.transform.transforms[0], TFRandomResizedCrop)
    seen = {}
    real_step = MAELars.step

    def step(self, closure=None):
        seen["params"] = sum(p.numel() for g in self.param_groups for p in g["params"])
        return real_step(self, closure)

    monkeypatch.setattr(MAELars, "step", step)
    summary = run(cfg, run_dir)
    assert summary["status"] == "completed"
    assert seen["params"] == 96 * 2 + 2  # the linear head alone (the BatchNorm has no affine)


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    return jpeg_tree(tmp_path_factory.mktemp("imagenet"))


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_training_transforms_on_jpegs(tree, recipe):
    """256 training samples (16 iterations of 16) through the recipe's full transforms at 224 px, then its
    Mixup/CutMix: the pipeline a user's first ImageNet epoch runs."""
    cfg = compose_cfg(f"experiment={recipe}", f"data.root={tree}", "data.num_classes=4", "data.batch_size=16",
                      "data.num_workers=0", "data.pin_memory=false")
    data = build_classification_data(cfg.data, seed=0)
    t = cfg.trainer
    mixup = Mixup(mixup_alpha=t.mixup.mixup_alpha, cutmix_alpha=t.mixup.cutmix_alpha, prob=t.mixup.prob,
                  switch_prob=t.mixup.switch_prob, label_smoothing=t.smoothing, num_classes=4) \
        if t.mixup.mixup_alpha or t.mixup.cutmix_alpha else None
    seen = 0
    for epoch in range(8):
        data.train.sampler.set_epoch(epoch)
        for images, targets in data.train:
            assert images.shape == (16, 3, 224, 224) and torch.isfinite(images).all()
            if mixup is not None:
                images, targets = mixup(images, targets)
                assert targets.shape == (16, 4) and torch.allclose(targets.sum(1), torch.ones(16))
            seen += len(images)
    assert seen >= 256
    images, _ = next(iter(data.val))
    assert images.shape[1:] == (3, 224, 224)


def test_unreadable_images_are_skipped_and_counted(tmp_path, run_dir):
    root = jpeg_tree(tmp_path / "imagenet", classes=2, train=8, val=2)
    (root / "train" / "n00000000" / "truncated.JPEG").write_bytes(
        (root / "train" / "n00000000" / "0.JPEG").read_bytes()[:300])
    (root / "train" / "n00000001" / "not_an_image.JPEG").write_text("<html>404</html>")
    cfg = quick_cfg("data=imagenet", f"data.root={root}", "data.num_classes=2", "data.img_size=32",
                    "data.batch_size=4", "data.eval_batch_size=4", "data.pin_memory=false",
                    "backbone.patch_size=8")
    summary = run(cfg, run_dir)
    assert summary["status"] == "completed" and summary["bad_images"] == 2
    assert sorted(Path(f).name for f in summary["bad_image_files"]) == ["not_an_image.JPEG", "truncated.JPEG"]


def test_unreadable_image_can_stop_the_run_with_one_line(tmp_path):
    root = jpeg_tree(tmp_path / "imagenet", classes=2, train=4, val=2)
    bad = root / "train" / "n00000001" / "not_an_image.JPEG"
    bad.write_text("<html>404</html>")
    out = run_cli("data=imagenet", f"data.root={root}", "data.num_classes=2", "data.img_size=32",
                  "data.batch_size=2", "data.num_workers=1", "data.on_bad_image=fail",
                  "backbone.patch_size=8", "trainer.epochs=1", "logger=none",
                  env={"NORMEXP_OUTPUT_DIR": str(tmp_path / "out")})
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1].startswith(f"error: cannot read image '{bad}'")
