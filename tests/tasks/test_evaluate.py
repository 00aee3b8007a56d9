"""task=evaluate: ReaL's multi-label top-1 against timm's RealLabelsImagenet, the 200-class restriction on a
JPEG tree against a direct computation, one-line refusals, and the digits' stand-ins in the record."""

from __future__ import annotations

import csv
import json
import shutil

import numpy as np
import pytest
import torch
from conftest import compose_cfg, quick_cfg, run_cli
from PIL import Image
from timm.data.real_labels import RealLabelsImagenet

from normexp.data.images import load_rgb
from normexp.data.test_sets import TEST_SETS, LabelledImages, labelled_files, timm_info
from normexp.data.transforms import build_transforms
from normexp.errors import UserError
from normexp.models import build_backbone
from normexp.run import run
from normexp.tasks.evaluate import CSV_COLUMNS, count_hits
from normexp.tracking.records import read_metrics, read_summary


def write_jpeg(path, seed: int, size: int = 20) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path, quality=90)


def test_real_multilabel_accuracy_is_timms(tmp_path):
    rng = np.random.default_rng(0)
    num_classes, count = 12, 40
    labels = [sorted(set(rng.integers(0, num_classes, rng.integers(0, 4)).tolist())) for _ in range(count)]
    labels_file = tmp_path / "real.json"
    labels_file.write_text(json.dumps(labels))
    for i in range(count):  # the validation images, sorted into two class folders as valprep.sh does
        write_jpeg(tmp_path / "val" / f"n{i % 2:08d}" / f"ILSVRC2012_val_{i + 1:08d}.JPEG", i, size=4)
    samples = labelled_files(TEST_SETS["imagenet_real"], tmp_path / "val", str(labels_file))
    files = [f for f, _ in samples]
    targets = torch.stack([LabelledImages(samples, lambda image: 0, num_classes, "fail", tmp_path)[i][1]
                           for i in range(count)])
    logits = torch.randn(count, num_classes, generator=torch.Generator().manual_seed(0))
    timm_real = RealLabelsImagenet(files, real_json=str(labels_file))
    timm_real.add_result(logits)
    hits, seen = count_hits(logits, targets, None)
    assert seen == sum(bool(x) for x in labels) < count  # unlabelled images are left out, as timm does
    assert [100 * h / seen for h in hits] == pytest.approx([timm_real.get_accuracy(k) for k in (1, 5)])
    (tmp_path / "val" / "n00000000" / "stray.JPEG").write_bytes(b"")
    with pytest.raises(UserError, match="stray.JPEG' is not an ImageNet validation image named in the ReaL"):
        labelled_files(TEST_SETS["imagenet_real"], tmp_path / "val", str(labels_file))


# ---------------------------------------------------------------- the real-data path on a JPEG tree
IMG_SIZE = 16


@pytest.fixture(scope="module")
def trees(tmp_path_factory):
    """An ImageNet-A tree (200 WordNet-id folders, 2 images each) and a checkpoint file of a micro ViT with
    random weights; no ImageNet root: data=imagenet names only the preprocessing and the classes."""
    root = tmp_path_factory.mktemp("trees")
    for k, wnid in enumerate(timm_info("imagenet_a_synsets.txt").split()):
        for i in range(2):
            write_jpeg(root / "imagenet_a" / wnid / f"{i}.jpg", 2 * k + i)
    cfg = evaluate_cfg(root)
    torch.manual_seed(0)
    model = build_backbone(cfg.backbone, cfg.norm)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)  # distinct logits: no ties in the top 5
    torch.save({"model": model.state_dict()}, root / "model.pth")
    return root


def evaluate_cfg(root, *overrides):
    return compose_cfg("logger=none", "data=imagenet", f"data.root={root / 'no-imagenet-here'}",
                       f"data.img_size={IMG_SIZE}", "trainer.progress=false", "task=evaluate",
                       f"task.checkpoint={root / 'model.pth'}", "task.test_sets=[imagenet_a]",
                       f"task.roots.imagenet_a={root / 'imagenet_a'}", "task.num_workers=0",
                       "task.batch_size=64", *overrides)


def test_imagenet_a_scores_the_200_classes_like_a_direct_computation(trees, tmp_path):
    summary = run(evaluate_cfg(trees), tmp_path / "eval")
    result = summary["metrics"]["test_sets"]["imagenet_a"]
    # directly: each image's logits at ImageNet-A's 200 ImageNet-1k indices, its label its folder's index
    cfg = evaluate_cfg(trees)
    model = build_backbone(cfg.backbone, cfg.norm)
    model.load_state_dict(torch.load(trees / "model.pth")["model"])
    transform = build_transforms(cfg.data, is_training=False)
    subset = torch.tensor([int(i) for i in timm_info("imagenet_a_indices.txt").split()])
    wnids = timm_info("imagenet_synsets.txt").split()
    files = sorted((trees / "imagenet_a").glob("*/*.jpg"))
    with torch.no_grad():
        logits = model.eval()(torch.stack([transform(load_rgb(f)) for f in files]))
    ranked = subset[logits[:, subset].topk(5, dim=1).indices]
    labels = torch.tensor([wnids.index(f.parent.name) for f in files])
    assert result["images"] == len(files) == 400 and result["classes"] == 200
    assert result["top1"] == pytest.approx(100 * (ranked[:, 0] == labels).float().mean().item())
    assert result["top5"] == pytest.approx(100 * (ranked == labels[:, None]).any(1).float().mean().item())
    assert result["top1_err"] == pytest.approx(100 - result["top1"]) and not result["stand_in"]
    with (tmp_path / "eval" / "results-imagenet-a.csv").open() as f:
        (row,) = list(csv.DictReader(f))
    assert tuple(row) == CSV_COLUMNS and row["model"] == summary["name"]
    assert float(row["top1"]) == pytest.approx(result["top1"], abs=1e-3) and row["img_size"] == str(IMG_SIZE)
    assert row["crop_pct"] == "0.875" and row["interpolation"] == "bicubic"
    assert float(row["param_count"]) == pytest.approx(summary["params"] / 1e6, abs=0.005)
    assert row["source"] == str(trees / "imagenet_a")


def test_a_missing_root_or_wrong_classes_is_one_line_before_any_work(trees, tmp_path):
    with pytest.raises(UserError, match=r"^ImageNet-V2 has no images: set task.roots.imagenet_v2=/path/to/it "
                                        r"\(published at https://github.com/modestyachts/ImageNetV2\)$"):
        run(evaluate_cfg(trees, "task.test_sets=[imagenet_a,imagenet_v2]"), tmp_path / "eval")
    fewer = tmp_path / "imagenet_a"
    shutil.copytree(trees / "imagenet_a", fewer)
    for folder in sorted(fewer.iterdir())[150:]:
        shutil.rmtree(folder)
    with pytest.raises(UserError, match="has 150 class folders, ImageNet-A has 200") as wrong:
        run(evaluate_cfg(trees, f"task.roots.imagenet_a={fewer}"), tmp_path / "eval")
    assert "\n" not in str(wrong.value)
    foreign = tmp_path / "foreign"  # 200 folders, one of them an ImageNet class that is not ImageNet-A's
    shutil.copytree(trees / "imagenet_a", foreign)
    shutil.move(min(foreign.iterdir()), foreign / "n01440764")
    with pytest.raises(UserError, match="class folder 'n01440764' is not one of its 200 classes "
                                        r"\(timm's imagenet_a_indices.txt\)") as wrong:
        run(evaluate_cfg(trees, f"task.roots.imagenet_a={foreign}"), tmp_path / "eval")
    assert "\n" not in str(wrong.value)
    with pytest.raises(UserError, match="task.test_sets=\\['imagenet_c'\\]: choose from imagenet_real, "):
        run(evaluate_cfg(trees, "task.test_sets=[imagenet_c]"), tmp_path / "eval")
    with pytest.raises(UserError, match="task=evaluate needs task.checkpoint=<run dir or checkpoint file>"):
        run(evaluate_cfg(trees, "task.checkpoint=null"), tmp_path / "eval")
    assert not (tmp_path / "eval").exists()


@pytest.mark.slow
def test_the_command_line_exits_2_with_one_line(trees):
    result = run_cli("logger=none", "data=imagenet", f"data.root={trees / 'imagenet'}", "task=evaluate",
                     f"task.checkpoint={trees / 'model.pth'}", "task.test_sets=[imagenet_sketch]",
                     "task.roots.imagenet_sketch=null")
    assert result.returncode == 2
    assert "ImageNet-Sketch has no images" in result.stderr.strip().splitlines()[-1]
    assert "https://github.com/HaohanWang/ImageNet-Sketch" in result.stderr


# ---------------------------------------------------------------- the digits' stand-ins
def test_digits_stand_ins_are_recorded_and_labelled(completed, tmp_path, capsys):
    summary = run(quick_cfg("task=evaluate", f"task.checkpoint={completed}", "task.num_workers=0"),
                  tmp_path / "eval")
    results = summary["metrics"]["test_sets"]
    assert list(results) == list(TEST_SETS)
    assert read_summary(tmp_path / "eval")["metrics"] == summary["metrics"]
    assert all(r["stand_in"] and r["source"].startswith("stand-in: ") for r in results.values())
    # the 360 validation digits; ReaL's stand-in leaves every tenth out; A and R keep 5 of the 10 classes
    assert results["imagenet_v2"]["images"] == 360 and results["imagenet_real"]["images"] == 324
    assert results["imagenet_a"]["classes"] == results["imagenet_r"]["classes"] == 5
    assert results["imagenet_a"]["images"] + results["imagenet_r"]["images"] == 360
    for name, test_set in TEST_SETS.items():
        with (tmp_path / "eval" / test_set.results_file).open() as f:
            (row,) = list(csv.DictReader(f))
        assert row["source"] == results[name]["source"] and float(row["top5"]) == pytest.approx(
            results[name]["top5"], abs=1e-3)
    rows = [r for r in read_metrics(tmp_path / "eval") if "test_set" in r]
    assert [r["test_set"] for r in rows] == list(TEST_SETS)
    assert "ImageNet-A       top-1" in capsys.readouterr().out
