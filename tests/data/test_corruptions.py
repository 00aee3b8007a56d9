"""Corruptions rendered on the fly (every corruption, determinism, cache) and the ImageNet-C tree reader."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import compose_cfg
from PIL import Image
from skimage import data as skimage_data
from torch.utils.data import DataLoader

from normexp.data import corruptions as corruptions_module
from normexp.data.corruptions import (
    CorruptionSuite,
    build_corruption_suite,
    corrupt_image,
    corruption_size,
    read_corruption_tree,
)
from normexp.data.digits import build_digits, digits_arrays, standardisation
from normexp.errors import UserError
from normexp.metrics.robustness import CORRUPTIONS, EXTRA_CORRUPTIONS, GROUP_OF, SEVERITIES

# Corruptions that draw random numbers (the others are deterministic functions of the image).
RANDOM = {"gaussian_noise", "shot_noise", "impulse_noise", "glass_blur", "motion_blur", "snow", "frost",
          "fog", "elastic_transform", "speckle_noise", "spatter"}


def photo(size: int) -> np.ndarray:
    """A real photograph (shipped with scikit-image) as uint8 RGB, size x size."""
    return np.asarray(Image.fromarray(skimage_data.astronaut()).resize((size, size), Image.BILINEAR))


@pytest.mark.parametrize("size", [32, 224])
def test_every_corruption_runs_at_every_severity_and_severity_5_changes_more(size):
    image = photo(size)
    names = CORRUPTIONS + (EXTRA_CORRUPTIONS if size == 32 else ())
    for corruption in names:
        change = {}
        for severity in SEVERITIES:
            out = corrupt_image(image, corruption, severity, seed=7)
            assert out.shape == image.shape and out.dtype == np.uint8, (corruption, severity)
            change[severity] = np.abs(out.astype(np.float32) - image).mean()
        if corruption in CORRUPTIONS:  # the extras only have to run
            assert change[5] > change[1], (corruption, size, change)


def test_same_seed_gives_identical_pixels_and_leaves_numpy_alone():
    image = photo(32)
    np.random.seed(123)
    expected_draw = np.random.rand()
    np.random.seed(123)
    for corruption in CORRUPTIONS + EXTRA_CORRUPTIONS:
        a = corrupt_image(image, corruption, 3, seed=1)
        b = corrupt_image(image, corruption, 3, seed=1)
        assert np.array_equal(a, b), corruption
        if corruption in RANDOM:  # the seed reaches every random source (numba's and skimage's included)
            assert not np.array_equal(a, corrupt_image(image, corruption, 3, seed=2)), corruption
    assert np.random.rand() == expected_draw  # the caller's global RNG stream is untouched


def digits_data(*overrides: str):
    return compose_cfg(*overrides).data


def suite_tensors(suite: CorruptionSuite, num_workers: int) -> tuple[torch.Tensor, ...]:
    loader = DataLoader(suite, batch_size=64, num_workers=num_workers)
    images, labels, conditions = zip(*loader, strict=True)
    return torch.cat(images), torch.cat(labels), torch.cat(conditions)


def test_workers_render_the_same_pixels_as_the_main_process():
    cfg = digits_data("data.val_fraction=0.03")  # 54 images
    suite = build_corruption_suite(cfg, ["glass_blur", "elastic_transform"], [1, 5], 0, cache_dir=None)
    assert [(c.corruption, c.severity) for c in suite.conditions] == [
        (None, 0), ("glass_blur", 1), ("glass_blur", 5), ("elastic_transform", 1), ("elastic_transform", 5)]
    serial, parallel = suite_tensors(suite, 0), suite_tensors(suite, 2)
    for a, b in zip(serial, parallel, strict=True):
        assert torch.equal(a, b)
    other_seed = build_corruption_suite(cfg, ["glass_blur"], [5], 1, cache_dir=None)
    assert not torch.equal(suite_tensors(other_seed, 0)[0], serial[0][: 2 * 54])


def test_clean_condition_is_the_evaluation_set_and_corruptions_run_at_32_px():
    cfg = digits_data()
    assert corruption_size(16) == 32 and corruption_size(24) == 48 and corruption_size(224) == 224
    suite = build_corruption_suite(cfg, ["gaussian_noise"], [1], base_seed=0, cache_dir=None)
    images, labels, conditions = suite_tensors(suite, 0)
    val_x, val_y = build_digits(cfg, seed=0).val.dataset.tensors
    clean = conditions == 0
    assert images.shape[1:] == (3, 16, 16) and torch.equal(labels[clean], val_y)
    _, std = standardisation(digits_arrays(cfg.img_size, cfg.val_fraction, cfg.split_seed))
    # the same images up to their uint8 quantisation (the corruptions take uint8)
    assert (images[clean] - val_x).abs().max() <= 0.5 / 255 / std + 1e-6
    assert suite.datasets[1][0][0].shape == (32, 32, 3)


def test_cache_is_the_official_layout_and_is_reused(tmp_path, monkeypatch):
    cfg = digits_data("data.val_fraction=0.03")
    first = suite_tensors(build_corruption_suite(cfg, ["shot_noise"], [2, 4], 0, tmp_path), 0)
    (root,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert root.name.startswith("digits-32px-") and (root / "source.json").is_file()
    files = sorted(root.glob("shot_noise/*/*/*.png"))
    assert len(files) == 2 * 54 and {f.parent.parent.name for f in files} == {"2", "4"}
    assert {f.parent.name for f in files} <= {str(d) for d in range(10)}

    def no_rendering(*args, **kwargs):
        raise AssertionError("rendered although cached")

    monkeypatch.setattr(corruptions_module, "corrupt_image", no_rendering)
    second = suite_tensors(build_corruption_suite(cfg, ["shot_noise"], [2, 4], 0, tmp_path), 0)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)
    # the cache is a valid pre-rendered tree: read back through the ImageNet-C reader, same pixels
    from_tree = build_corruption_suite(digits_data("data.val_fraction=0.03", f"data.imagenet_c_root={root}"),
                                       ["shot_noise"], [2, 4], 0, None)
    tree = suite_tensors(from_tree, 0)
    for severity_index in (1, 2):  # the tree lists images by class folder, then name: compare as sets
        assert torch.equal(fingerprints(tree, severity_index), fingerprints(first, severity_index))


def fingerprints(tensors: tuple[torch.Tensor, ...], condition: int) -> torch.Tensor:
    images, labels, conditions = tensors
    chosen = conditions == condition
    return torch.sort(images[chosen].flatten(1).sum(1) + 1000 * labels[chosen]).values


# ---------------------------------------------------------------- the pre-rendered tree reader
def make_tree(root: Path, corruptions=("gaussian_noise", "glass_blur"), severities=(1, 2, 3),
              classes=("n01440764", "n01443537"), per_class=2, grouped=False) -> Path:
    rng = np.random.default_rng(0)
    for corruption in corruptions:
        base = root / (GROUP_OF[corruption] if grouped else "") / corruption
        for severity in severities:
            for wnid in classes:
                folder = base / str(severity) / wnid
                folder.mkdir(parents=True)
                for i in range(per_class):
                    pixels = rng.integers(0, 255, (36, 36, 3), dtype=np.uint8)
                    Image.fromarray(pixels).save(folder / f"ILSVRC2012_val_{i:08d}.JPEG")
    return root


@pytest.mark.parametrize("grouped", [False, True])
def test_tree_reader_reads_both_layouts(tmp_path, grouped):
    root = make_tree(tmp_path / "imagenet-c", grouped=grouped)
    tree = read_corruption_tree(root, ["gaussian_noise", "glass_blur"], [1, 3], num_classes=2)
    assert set(tree) == {("gaussian_noise", 1), ("gaussian_noise", 3), ("glass_blur", 1), ("glass_blur", 3)}
    samples = tree["glass_blur", 3]
    assert [label for _, label in samples] == [0, 0, 1, 1]
    assert all(path.parent.parent.name == "3" and path.suffix == ".JPEG" for path, _ in samples)
    if grouped:
        assert samples[0][0].parts[-5:-3] == ("blur", "glass_blur")


@pytest.mark.parametrize("breakage,message", [
    ("no_root", "does not exist"),
    ("no_corruption", "has no corruption 'motion_blur'"),
    ("no_severity", "is missing glass_blur severity 3"),
    ("empty_class", "holds no images (glass_blur severity 2 is incomplete)"),
    ("fewer_images", "holds 3 images but"),
    ("other_classes", "have different class folders (glass_blur severity 1"),
    ("class_count", "has 2 class folders but data.num_classes=1000"),
])
def test_incomplete_tree_is_named_in_one_line(tmp_path, breakage, message):
    root = tmp_path / "imagenet-c"
    corruptions, num_classes = ["gaussian_noise", "glass_blur"], 2
    if breakage != "no_root":
        make_tree(root)
    if breakage == "no_corruption":
        corruptions.append("motion_blur")
    elif breakage == "no_severity":
        for f in sorted((root / "glass_blur" / "3").rglob("*"), reverse=True):
            f.unlink() if f.is_file() else f.rmdir()
        (root / "glass_blur" / "3").rmdir()
    elif breakage == "empty_class":
        for f in (root / "glass_blur" / "2" / "n01443537").iterdir():
            f.unlink()
    elif breakage == "fewer_images":
        next((root / "glass_blur" / "2" / "n01443537").iterdir()).unlink()
    elif breakage == "other_classes":
        (root / "glass_blur" / "1" / "n01443537").rename(root / "glass_blur" / "1" / "n99999999")
    elif breakage == "class_count":
        num_classes = 1000
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")) as info:
        read_corruption_tree(root, corruptions, [1, 2, 3], num_classes)
    assert "\n" not in str(info.value)
