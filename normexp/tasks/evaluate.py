"""Evaluate: a trained classifier's top-1 / top-5 on ImageNet-ReaL, -V2, -A, -R and -Sketch (digits:
stand-ins), one timm-style ``results-*.csv`` per set and ``summary.json`` ``metrics.test_sets.<set>``; the
checkpoint's model is rebuilt as ``task=robustness`` does."""

from __future__ import annotations

import csv
import logging
from typing import Any

import torch
from omegaconf import DictConfig
from torch import nn
from tqdm import tqdm

from .. import distributed
from ..data.imagenet import collate_readable
from ..data.loaders import make_loader
from ..data.test_sets import (
    IMAGENET_CLASSES,
    TEST_SETS,
    LoadedTestSet,
    check_imagenet_test_set,
    digits_stand_in,
    imagenet_test_set,
)
from ..engine.evaluate import show_progress
from ..engine.precision import Precision, resolve_device
from ..errors import UserError
from ..models.stats import count_params
from ..tracking.records import RunRecord
from . import Task, register_task
from .robustness import load_trained_model, with_checkpoint_model

log = logging.getLogger(__name__)

TOPK = (1, 5)
CSV_COLUMNS = ("model", "top1", "top1_err", "top5", "top5_err", "param_count", "img_size", "crop_pct",
               "interpolation", "source")  # timm's validate.py columns, then where the images came from


def selected_sets(cfg: Any) -> list[str]:
    names = list(cfg.task.test_sets)
    unknown = [n for n in names if n not in TEST_SETS]
    if unknown or not names:
        raise UserError(f"task.test_sets={names}: choose from {', '.join(TEST_SETS)}")
    return names


def check_evaluate(cfg: DictConfig) -> None:
    """A checkpoint, known set names, and on ImageNet every chosen set's root with the right classes."""
    if not cfg.task.get("checkpoint"):
        raise UserError("task=evaluate needs task.checkpoint=<run dir or checkpoint file>")
    names = selected_sets(cfg)
    if cfg.data.name != "imagenet":
        return
    if cfg.data.num_classes != IMAGENET_CLASSES:
        raise UserError(f"data.num_classes={cfg.data.num_classes}: the ImageNet test sets score ImageNet-1k "
                        f"classifiers ({IMAGENET_CLASSES} classes)")
    for name in names:
        check_imagenet_test_set(name, cfg.task.roots.get(name), f"task.roots.{name}", cfg.task.real_labels)


def load_test_set(name: str, cfg: Any) -> LoadedTestSet:
    if cfg.data.name == "digits":
        return digits_stand_in(name, cfg.data)
    return imagenet_test_set(name, cfg.task.roots[name], cfg.task.real_labels, cfg.data)


# ---------------------------------------------------------------- scoring
def count_hits(logits: torch.Tensor, targets: torch.Tensor, classes: list[int] | None,
               topk: tuple[int, ...] = TOPK) -> tuple[list[int], int]:
    """(images with a label among their top k, per k; images with a label) of a batch, restricted to
    ``classes`` first."""
    if classes is not None:
        logits, targets = logits[:, classes], targets[:, classes]
    labelled = targets.any(dim=1)
    logits, targets = logits[labelled], targets[labelled]
    ranked = targets.gather(1, logits.topk(min(max(topk), logits.shape[1]), dim=1).indices)
    return [int(ranked[:, :k].any(dim=1).sum()) for k in topk], int(labelled.sum())


@torch.no_grad()
def score(model: nn.Module, test_set: LoadedTestSet, batch_size: int, num_workers: int, precision: Precision,
          progress: bool) -> dict[str, Any]:
    """Top-1 / top-5 accuracy and error in percent, over every process's share of the images."""
    loader = make_loader(test_set.images, batch_size, train=False, num_workers=num_workers, seed=0,
                         pin_memory=precision.device.type == "cuda", collate_fn=collate_readable)
    model.eval()
    counts = torch.zeros(len(TOPK) + 1, dtype=torch.long)
    for batch in tqdm(loader, desc=test_set.spec.name, disable=not progress, leave=False):
        if batch is None:  # none of its images could be read (data.on_bad_image=skip)
            continue
        with precision.autocast():
            logits = model(batch[0].to(precision.device, non_blocking=True))
        hits, seen = count_hits(logits.float().cpu(), batch[1], test_set.classes)
        counts += torch.tensor([*hits, seen])
    *hits, seen = distributed.all_reduce_sum(counts.to(precision.device)).tolist()  # NCCL: on the GPU
    if seen == 0:
        raise UserError(f"{test_set.spec.title}: none of its images could be read or has a label")
    metrics: dict[str, Any] = {}
    for k, hit in zip(TOPK, hits, strict=True):
        metrics[f"top{k}"] = 100 * hit / seen
        metrics[f"top{k}_err"] = 100 - metrics[f"top{k}"]
    classes = test_set.classes
    metrics.update(images=seen, classes=len(classes) if classes else None, source=test_set.source,
                   stand_in=test_set.stand_in)
    return metrics


def csv_row(model_name: str, metrics: dict[str, Any], params: int, data_cfg: Any) -> dict[str, Any]:
    """One row of timm's ``results-*.csv``: accuracies to 3 decimals, parameters in millions."""
    return {"model": model_name, **{k: f"{metrics[k]:.3f}" for k in ("top1", "top1_err", "top5", "top5_err")},
            "param_count": f"{params / 1e6:.2f}", "img_size": data_cfg.img_size,
            "crop_pct": f"{data_cfg.get('crop_pct', 1.0):.3f}",
            "interpolation": data_cfg.get("interpolation", "bilinear"), "source": metrics["source"]}


def run_evaluate(cfg: Any, record: RunRecord) -> dict[str, Any]:
    names = selected_sets(cfg)
    model, state = load_trained_model(cfg.task.checkpoint, cfg.backbone, cfg.norm, cfg.task.ema)
    params = count_params(model)
    record.update(params=params, checkpoint=str(cfg.task.checkpoint))
    precision = Precision(cfg.trainer.amp, resolve_device(cfg.trainer.device, distributed.info().local_rank))
    model.to(precision.device)
    progress = show_progress(cfg.trainer.progress) and record.writes
    results: dict[str, dict[str, Any]] = {}
    for step, name in enumerate(names, start=1):
        test_set = load_test_set(name, cfg)
        results[name] = metrics = score(model, test_set, cfg.task.batch_size, cfg.task.num_workers, precision,
                                        progress)
        record.log({"step": step, "epoch": state.get("epoch"), "test_set": name,
                    **{f"test_set/{k}": metrics[k] for k in ("top1", "top5")}})
        if record.writes:
            with (record.dir / test_set.spec.results_file).open("w", newline="") as f:
                writer = csv.DictWriter(f, CSV_COLUMNS)
                writer.writeheader()
                writer.writerow(csv_row(cfg.name, metrics, params, cfg.data))
            print(f"{test_set.spec.title:<16} top-1 {metrics['top1']:6.2f} %  top-5 "
                  f"{metrics['top5']:6.2f} %  {metrics['images']} images  ({test_set.source})", flush=True)
    record.update(metrics={"test_sets": results})
    return {"test_sets": results}


register_task(Task("evaluate", run_evaluate, data=("digits", "imagenet"), data_root=False,
                   check=check_evaluate, prepare=with_checkpoint_model, starts_from="task.checkpoint"))
