"""The ImageNet code path on a tiny ImageFolder tree generated on the fly."""

from __future__ import annotations

import os
import struct
import zlib
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from conftest import quick_cfg, run_cli
from PIL import Image

from normexp.data import build_classification_data
from normexp.data.imagenet import SafeImageFolder, check_imagefolder_root
from normexp.data.images import load_rgb
from normexp.errors import UserError
from normexp.run import run


def make_imagefolder(root: Path, classes=("n01440764", "n01443537"), per_class=(12, 4), size=40) -> Path:
    rng = np.random.default_rng(0)
    for split, count in zip(("train", "val"), per_class, strict=True):
        for c, wnid in enumerate(classes):
            folder = root / split / wnid
            folder.mkdir(parents=True)
            for i in range(count):
                # class 0 bright, class 1 dark: learnable in one epoch
                base = 200 if c == 0 else 50
                pixels = np.clip(rng.normal(base, 20, (size, size + 8, 3)), 0, 255).astype(np.uint8)
                Image.fromarray(pixels).save(folder / f"{wnid}_{i}.JPEG")
    return root


def decompression_bomb(path: Path) -> Path:
    """A PNG whose header claims 30000 x 30000 px: Pillow refuses it (``DecompressionBombError``, which is no
    ``OSError``) before reading a pixel."""
    Image.new("L", (1, 1)).save(path, "PNG")
    data = bytearray(path.read_bytes())
    struct.pack_into(">II", data, 16, 30000, 30000)  # IHDR's width and height (signature 8, length 4, type 4)
    struct.pack_into(">I", data, 29, zlib.crc32(data[12:29]))
    path.write_bytes(bytes(data))
    return path


def test_one_epoch_on_a_generated_imagefolder(tmp_path, run_dir):
    root = make_imagefolder(tmp_path / "imagenet")
    cfg = quick_cfg("data=imagenet", f"data.root={root}", "data.num_classes=2", "data.img_size=32",
                    "data.batch_size=8", "data.eval_batch_size=8", "data.num_workers=0",
                    "data.pin_memory=false", "backbone.patch_size=8")
    summary = run(cfg, run_dir)
    assert summary["status"] == "completed"
    final = summary["metrics"]["final"]
    assert final["epoch"] == 1 and 0 <= final["val/top1"] <= 100
    assert final["val/top5"] == 100.0  # top-k is capped at the number of classes


def test_deit_recipe_trains_through_unreadable_images_with_mixup(tmp_path, run_dir, monkeypatch):
    """A truncated and a zero-byte JPEG where DeiT's repeated-augmentation order puts them first and last in
    the epoch: skipped, they would leave odd batches, which Mixup refuses; replaced, every batch keeps 8."""
    from timm.data import Mixup
    from torchvision.datasets import ImageFolder

    from normexp.data.samplers import ShardedSampler

    root = make_imagefolder(tmp_path / "imagenet", size=40)
    samples = ImageFolder(root / "train").samples
    order = ShardedSampler(len(samples), shuffle=True, seed=0, batch_size=8, drop_last=True,
                           repeats=3).epoch_order().tolist()  # the recipe's data.aug_repeats=3
    truncated, empty = Path(samples[order[0]][0]), Path(samples[order[-1]][0])
    truncated.write_bytes(truncated.read_bytes()[:200])
    empty.write_bytes(b"")
    bomb = decompression_bomb(root / "val" / "n01443537" / "n01443537_bomb.png")
    mixed = []
    real_call = Mixup.__call__

    def mix(self, x, target):
        mixed.append(len(x))
        return real_call(self, x, target)

    monkeypatch.setattr(Mixup, "__call__", mix)
    cfg = quick_cfg("experiment=deit_imagenet", "backbone=vit_micro", "backbone.patch_size=4",
                    f"data.root={root}", "data.num_classes=2", "data.img_size=32", "data.batch_size=8",
                    "data.eval_batch_size=8", "data.num_workers=0", "data.pin_memory=false",
                    "trainer.global_batch=null")
    summary = run(cfg, run_dir)
    assert summary["status"] == "completed", summary.get("error")
    assert mixed == [8, 8, 8]  # Mixup on every batch, each whole
    assert summary["bad_images"] == 3
    assert set(summary["bad_image_files"]) == {str(truncated), str(empty), str(bomb)}


def test_a_training_image_over_the_size_limit_is_replaced_or_named(tmp_path):
    root = make_imagefolder(tmp_path / "imagenet", per_class=(2, 1), size=8)
    bomb = decompression_bomb(root / "train" / "n01440764" / "n01440764_0.JPEG")
    train = SafeImageFolder(root / "train", None, "skip", replace=True)
    image, label = train[0]  # the next readable image of the folder takes its place
    assert image.size == (16, 8) and label == 0 and train.bad_files() == [str(bomb)]
    with pytest.raises(UserError, match=f"cannot read image '{bomb}' \\(DecompressionBombError: .*"
                                        "data.on_bad_image=skip"):
        SafeImageFolder(root / "train", None, "fail", replace=True)[0]


def test_symbolic_links_are_followed_once_each(tmp_path, caplog):
    """A link back up (a loop) or to another class's folder lists no image twice and labels none wrongly;
    a link to a folder of new images is followed, as torchvision follows it."""
    root = make_imagefolder(tmp_path / "imagenet", per_class=(3, 1), size=8)
    train = root / "train"
    (train / "n01440764" / "up").symlink_to("..")
    (train / "n01440764" / "other_class").symlink_to(train / "n01443537")
    extra = make_imagefolder(tmp_path / "extra", classes=("more",), per_class=(2, 0), size=8)
    (train / "n01443537" / "more").symlink_to(extra / "train" / "more")
    samples = SafeImageFolder(train, None, "skip").samples
    assert sorted(samples) == sorted([(str(p), 0) for p in (train / "n01440764").glob("*.JPEG")]
                                     + [(str(p), 1) for p in (train / "n01443537").glob("*.JPEG")]
                                     + [(str(p), 1) for p in (train / "n01443537" / "more").glob("*.JPEG")])
    assert "up: it links to a folder already listed" in caplog.text
    assert "other_class: it links to a folder already listed" in caplog.text


def test_sixteen_bit_images_are_scaled_not_clipped(tmp_path):
    ramp = np.linspace(0, 65535, 64 * 64).round().astype(np.uint16).reshape(64, 64)
    Image.fromarray(ramp).save(tmp_path / "ramp.png")  # a 16-bit grayscale PNG (Pillow mode I;16)
    assert Image.open(tmp_path / "ramp.png").mode == "I;16"
    rgb = np.asarray(load_rgb(tmp_path / "ramp.png"))
    assert rgb.shape == (64, 64, 3) and rgb.dtype == np.uint8
    assert np.abs(rgb[..., 0].astype(float) - ramp / 257).max() <= 0.5  # 65535 -> 255, proportionally
    assert (rgb == 255).mean() < 0.01


@pytest.mark.parametrize("breakage,message", [
    ("missing", "does not exist"),
    ("no_val", "has no 'val/' folder"),
    ("empty_class", "holds no images"),
    ("class_mismatch", "different class folders"),
    ("wrong_count", "set data.num_classes=2"),
    ("looping_class", r"cannot be opened \(Too many levels of symbolic links\): fix or remove that symbolic"),
    ("dangling_class", r"is a symbolic link to nothing \(/nowhere\): fix or remove it"),
])
def test_malformed_roots_are_named(tmp_path, breakage, message):
    root = tmp_path / "imagenet"
    num_classes = 2
    if breakage != "missing":
        make_imagefolder(root, per_class=(1, 1))
    if breakage == "no_val":
        for f in (root / "val").rglob("*"):
            if f.is_file():
                f.unlink()
        for d in sorted((root / "val").glob("*")):
            d.rmdir()
        (root / "val").rmdir()
    elif breakage == "empty_class":
        for f in (root / "train" / "n01440764").iterdir():
            f.unlink()
    elif breakage == "class_mismatch":
        (root / "val" / "n01443537").rename(root / "val" / "n99999999")
    elif breakage == "wrong_count":
        num_classes = 1000
    elif breakage == "looping_class":
        os.symlink("n01443538", root / "train" / "n01443538")  # a class folder that links to itself
    elif breakage == "dangling_class":
        os.symlink("/nowhere", root / "val" / "n01443538")
    with pytest.raises(UserError, match=message):
        check_imagefolder_root(str(root), ("train", "val"), num_classes)


def test_missing_root_on_the_command_line_is_one_line(tmp_path):
    out = run_cli("data=imagenet", "data.root=/nonexistent", "logger=none",
                  env={"NORMEXP_OUTPUT_DIR": str(tmp_path)})
    assert out.returncode == 2
    assert "Traceback" not in out.stderr and "Traceback" not in out.stdout
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "/nonexistent" in errors[0] and "<root>/train/<wnid>" in errors[0]
    assert not list(Path(tmp_path).rglob("*.*"))  # refused before the run started: nothing written


def test_an_imagefolder_trains_on_its_subset(tmp_path):
    root = make_imagefolder(tmp_path / "imagenet", per_class=(10, 2), size=8)
    cfg = quick_cfg("data=imagenet", f"data.root={root}", "data.num_classes=2", "data.num_workers=0",
                    "data.train_fraction=0.5").data
    first, again = (build_classification_data(cfg, seed=3, eval_train=True) for _ in range(2))
    assert Counter(first.train.dataset.targets) == {0: 5, 1: 5}
    assert first.train.dataset.samples == again.train.dataset.samples  # same seed, same subset
    assert first.train_eval.dataset.samples == first.train.dataset.samples
    assert len(first.val.dataset) == 4
