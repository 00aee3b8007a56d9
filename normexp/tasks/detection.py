"""COCO detection: RetinaNet or Mask R-CNN over a normexp backbone, the common loop, COCOeval.
``task.pretrained=<run>`` rebuilds the backbone and norm from that run's config and loads the weights its
task reports strictly; only what detection adds starts fresh."""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf, open_dict
from torch import nn
from tqdm import tqdm

from .. import CONFIG_DIR, distributed
from ..data.coco import DetectionData, build_detection_data
from ..engine.trainer import Trainer
from ..errors import UserError
from ..metrics.coco import STATS, coco_evaluate, coco_results
from ..models import build_backbone
from ..models.base import DENSE_FEATURES
from ..models.detection import DETECTORS, build_detector
from ..models.stats import count_params
from ..tracking.records import RunRecord
from . import Task, evaluated, fit_and_record, register_task
from .pretrained import HEAD, load_starting_weights, source_config, starting_weights

log = logging.getLogger(__name__)


class DetectionTrainer(Trainer):
    """The common loop with a detector: the loss is the sum of the detector's losses; COCOeval scores."""

    data: DetectionData

    def compute_loss(self, images: list[torch.Tensor],
                     targets: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        with self.precision.autocast():
            losses = self.model(images, targets)
        return sum(losses.values())

    @torch.no_grad()
    def evaluate(self, model: nn.Module, prefix: str) -> dict[str, float]:
        """COCOeval of every process's detections, gathered on process 0 (which scores them once)."""
        model.eval()
        masks = hasattr(model, "roi_heads") and model.roi_heads.has_mask()  # Mask R-CNN
        bbox, segm, seen = [], [], []
        for images, targets in tqdm(self.data.val, desc=prefix, disable=not self.progress, leave=False):
            if not images:  # every image of the batch was unreadable (data.on_bad_image=skip)
                continue
            # float32: torchvision decodes boxes in the regression dtype, and bf16 steps by 4 px at 1000 px
            outputs = model([image.to(self.device) for image in images])
            for target, output in zip(targets, outputs, strict=True):
                seen.append(int(target["image_id"]))
                b, s = coco_results(seen[-1], output, self.data.category_ids, masks)
                bbox += b
                segm += s
        gathered = distributed.all_gather_objects((bbox, segm, seen))
        metrics = {}
        if self.dist.is_main:
            bbox = [r for part in gathered for r in part[0]]
            segm = [r for part in gathered for r in part[1]]
            evaluated = sorted({i for part in gathered for i in part[2]})  # the images that were read
            for iou_type, results in (("bbox", bbox), ("segm", segm)) if masks else (("bbox", bbox),):
                stats, table = coco_evaluate(self.data.val_coco, results, iou_type, image_ids=evaluated)
                log.info("%s %s:\n%s", prefix, iou_type, table)
                metrics.update({f"{prefix}/{iou_type}_{k}": v for k, v in stats.items()})
        return distributed.broadcast_object(metrics)


def check_detector(cfg: Any) -> None:
    """A detector torchvision builds."""
    if cfg.task.detector not in DETECTORS:
        raise UserError(f"unknown task.detector '{cfg.task.detector}'; available: {', '.join(DETECTORS)}")


def with_pretrained_backbone(cfg: DictConfig) -> DictConfig:
    """The config with the pretrained run's backbone and norm, at its classification geometry; this run's
    ``drop_path_rate`` and ``dense`` settings stay."""
    check_detector(cfg)
    if not cfg.task.get("pretrained"):
        return cfg
    trained = source_config(cfg.task.pretrained, "task.pretrained")
    if trained is None:
        return cfg
    if (trained["backbone"]["name"], trained["norm"]["name"]) != (cfg.backbone.name, cfg.norm.name):
        log.info("backbone from %s: %s with norm=%s (configured: %s with norm=%s)", cfg.task.pretrained,
                 trained["backbone"]["name"], trained["norm"]["name"], cfg.backbone.name, cfg.norm.name)
    backbone = dict(trained["backbone"])
    if "drop_path_rate" in cfg.backbone:
        backbone["drop_path_rate"] = cfg.backbone.drop_path_rate
    if (CONFIG_DIR / "backbone" / f"{backbone['name']}.yaml").is_file():
        backbone["dense"] = _shipped_backbone(backbone["name"]).get("dense")
    cfg = copy.deepcopy(cfg)
    with open_dict(cfg):
        cfg.backbone = backbone
        cfg.norm = trained["norm"]
    return cfg


def _shipped_backbone(name: str) -> dict[str, Any]:
    """``backbone=<name>`` as the config tree composes it (its family file included), unresolved."""
    from hydra import compose

    from ..code_defaults import config_tree

    with config_tree():
        return OmegaConf.to_container(compose(config_name=f"backbone/{name}").backbone)


def load_backbone_weights(body: nn.Module, cfg: Any) -> str:
    """``task.pretrained``'s weights into the dense backbone ``body`` (on the meta device: checked only);
    returns which of its models they are."""
    weights, which, _ = starting_weights(cfg.task.pretrained)
    fresh = (*getattr(body, "dense_weights", ()), *HEAD)  # only in a dense build; a classifier head: kept
    load_starting_weights(body, weights, cfg.task.pretrained, fresh=fresh)
    return which


def build_detection_model(cfg: Any, num_classes: int, record: RunRecord | None = None) -> nn.Module:
    body = build_backbone(cfg.backbone, cfg.norm, dense=True)
    options = cfg.task.get(cfg.task.detector)  # further torchvision arguments of this detector
    if cfg.task.pretrained:
        which = load_backbone_weights(body, cfg)
        log.info("backbone weights: the %s model of %s", which, cfg.task.pretrained)
        if record is not None:
            record.update(pretrained_weights=which)
    try:
        return build_detector(
            body, cfg.task.detector, num_classes, min_size=cfg.data.min_size, max_size=cfg.data.max_size,
            image_mean=cfg.data.mean, image_std=cfg.data.std, fpn_channels=cfg.task.fpn_channels,
            levels=cfg.task.levels, anchor_scale=cfg.task.anchor_scale, score_thresh=cfg.task.score_thresh,
            detections_per_img=cfg.task.detections_per_img, box_head_dim=cfg.task.box_head_dim,
            rpn_min_pos_iou=cfg.task.rpn_min_pos_iou,
            options=OmegaConf.to_container(options, resolve=True) if options else None)
    except (ValueError, IndexError, TypeError) as e:
        raise UserError(f"cannot build {cfg.task.detector} over {cfg.backbone.name}: {e}") from e


def run_detection(cfg: Any, record: RunRecord) -> dict[str, Any]:
    data = build_detection_data(cfg.data, cfg.seed, masks=cfg.task.detector == "mask_rcnn")
    model = build_detection_model(cfg, data.num_classes, record)
    record.update(params=count_params(model), backbone_params=count_params(model.backbone.body),
                  dataset=str(data.root))
    log.info("%s over %s with norm=%s: %.2fM params (backbone %.2fM); data %s", cfg.task.detector,
             cfg.backbone.name, cfg.norm.name, record.summary["params"] / 1e6,
             record.summary["backbone_params"] / 1e6, data.root)
    trainer = DetectionTrainer(cfg.trainer, model, data, record)
    metrics = fit_and_record(trainer, record, cfg)
    final = metrics["final"]
    if record.writes:
        print(" ".join(f"{k}={v:.3f}" for k, v in final.items() if isinstance(v, float)), flush=True)
    return metrics


def metric_names(values: dict[str, Any]) -> list[str]:
    kinds = ["bbox", *(["segm"] if values["task"].get("detector") == "mask_rcnn" else [])]
    return evaluated(values, [f"{kind}_{stat}" for kind in kinds for stat in STATS])


def detection_settings(values: dict[str, Any]) -> dict[str, Any]:
    return {"detector": values["task"].get("detector"), "pretrained": values["task"].get("pretrained")}


def build_detection(cfg: Any) -> nn.Module:
    """The detector the task trains (the starting run's weights loaded: on the meta device, checked only)."""
    return build_detection_model(cfg, cfg.data.num_classes + 1)  # + background, label 0


register_task(Task("detection", run_detection, data=("coco", "coco_digits"), metrics=metric_names,
                   check=check_detector, prepare=with_pretrained_backbone, build=build_detection,
                   need=DENSE_FEATURES,
                   starts_from="task.pretrained", settings=detection_settings))
