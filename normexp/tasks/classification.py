"""ImageNet-style classification as DeiT's ``main.py`` / ``engine.py`` train it (and timm's ``train.py``):
Mixup/CutMix, label smoothing, top-1 / top-5. ``task.pretrained=<run>`` fine-tunes from another run's backbone
(``normexp.tasks.pretrained``); ``task.linear_probe`` trains a head on frozen, batch-normalised features
(MAE's ``main_linprobe.py``); ``task.robustness.enabled=true`` evaluates the final model on corruptions."""

from __future__ import annotations

import copy
import itertools
import logging
from collections.abc import Sequence
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf, open_dict
from timm.data import Mixup
from timm.layers import trunc_normal_
from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
from torch import nn
from torch.nn.utils import parametrize

from .. import distributed
from ..data import build_classification_data
from ..data.loaders import set_epoch
from ..engine.checkpoint import checkpoint_run_config, reported_weights
from ..engine.evaluate import classification_metrics, count_predictions
from ..engine.precision import resolve_device
from ..engine.probes import Probe, get_probes
from ..engine.trainer import Trainer
from ..errors import UserError
from ..models import build_backbone
from ..models.foreign import is_foreign, read_foreign
from ..models.stats import count_gmacs, count_params
from ..tracking.records import RunRecord, read_summary
from ..tracking.run_dir import resolve_source
from . import Task, evaluated, fit_and_record, register_task
from .conversion import calibrate_and_compare, check_calibration, converted_layers
from .pretrained import (
    HEAD,
    foreign_source_config,
    load_starting_weights,
    resized_position_embedding,
    source_config,
    starting_weights,
    without_source_norm,
)
from .robustness import check_robustness_settings, evaluate_robustness

log = logging.getLogger(__name__)


def build_mixup(cfg: Any, num_classes: int) -> Mixup | None:
    """timm's Mixup/CutMix from ``trainer.mixup``; None when both alphas are 0."""
    mix = cfg.mixup
    if mix.mixup_alpha <= 0 and mix.cutmix_alpha <= 0:
        return None
    return Mixup(mixup_alpha=mix.mixup_alpha, cutmix_alpha=mix.cutmix_alpha, prob=mix.prob,
                 switch_prob=mix.switch_prob, mode=mix.mode, label_smoothing=cfg.smoothing,
                 num_classes=num_classes)


def training_loss(smoothing: float, mixup: Mixup | None) -> nn.Module:
    """DeiT's choice: soft-target cross-entropy after Mixup, else label smoothing, else cross-entropy."""
    if mixup is not None:
        return SoftTargetCrossEntropy()
    if smoothing > 0:
        return LabelSmoothingCrossEntropy(smoothing=smoothing)
    return nn.CrossEntropyLoss()


class ClassificationTrainer(Trainer):
    """The common loop with a classifier: Mixup/CutMix and the training loss above; top-1 / top-5."""

    def __init__(self, cfg: Any, model: nn.Module, data: Any, record: RunRecord,
                 probes: Sequence[Probe] = ()) -> None:
        super().__init__(cfg, model, data, record, probes)
        self.mixup = build_mixup(cfg, data.num_classes)
        self.train_loss = training_loss(cfg.smoothing, self.mixup)

    def compute_loss(self, images: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.mixup is not None:
            images, targets = self.mixup(images, targets)
        with self.precision.autocast():
            return self.train_loss(self.model(images), targets)

    def evaluate(self, model: nn.Module, prefix: str) -> dict[str, float]:
        """``<prefix>/loss``, ``/top1`` and ``/top5`` (with fewer than 5 classes, top-5 is top-all)."""
        topk = (1, min(5, self.data.num_classes))
        counts = count_predictions(model, self.data.val, self.precision, topk=topk, progress=self.progress,
                                   desc=prefix)
        return classification_metrics(counts, ("top1", "top5"), prefix)

    def evaluate_train(self, model: nn.Module, prefix: str) -> dict[str, float]:
        """The training images through the evaluation transform, scored with plain cross-entropy (Derf,
        arXiv 2512.10938v2, App. E: centre crop and normalisation, averaged over the whole training set)."""
        topk = (1, min(5, self.data.num_classes))
        counts = count_predictions(model, self.data.train_eval, self.precision, topk=topk,
                                   progress=self.progress, desc=prefix)
        return classification_metrics(counts, ("top1", "top5"), prefix)


def check_classification(cfg: Any) -> None:
    """Before any work: the settings of the corruption evaluation after training, when it is on; the
    starting run's weights against the model they go into and the classifier ``task.head_init_std`` and
    ``task.linear_probe`` act on (built on the meta device), so that a mismatch is refused before the run's
    record exists."""
    settings = cfg.task.get("robustness")
    if settings is not None and settings.enabled:
        if settings.ema and not cfg.trainer.ema.enabled:
            raise UserError("task.robustness.ema=true needs trainer.ema.enabled=true")
        check_robustness_settings(settings, cfg.data)
    needs_head = cfg.task.head_init_std or cfg.task.linear_probe
    if cfg.task.get("pretrained") or needs_head or cfg.norm.get("alpha_init") == "calibrate":
        prepared = with_pretrained_model(cfg)
        with torch.device("meta"):
            model = build_backbone(prepared.backbone, prepared.norm)
            if cfg.task.get("pretrained"):
                load_pretrained(model, prepared)
            elif prepared.norm.get("alpha_init") == "calibrate":
                raise UserError("norm.alpha_init=calibrate sets alpha from a pretrained LayerNorm model: "
                                "give task.pretrained (a timm:<name>, a weight file or an LN run)")
        if needs_head:
            linear_head(model)


def with_pretrained_model(cfg: DictConfig) -> DictConfig:
    """With ``task.pretrained``: the starting run's normalizer (unless ``task.keep_pretrained_norm=false``);
    another backbone is refused in one line. Foreign weights (``timm:<name>``, a weight file) go into this
    config's model, its normalizer converted from their LayerNorms."""
    source = cfg.task.get("pretrained")
    if not source or is_foreign(source):
        return cfg
    trained = source_config(source, "task.pretrained")
    if trained is None:
        return cfg
    if trained["backbone"]["name"] != cfg.backbone.name:
        raise UserError(f"task.pretrained '{source}' is a run of backbone={trained['backbone']['name']}; "
                        f"this run builds backbone={cfg.backbone.name}: fine-tune the same backbone")
    if not cfg.task.keep_pretrained_norm:
        return cfg
    cfg = copy.deepcopy(cfg)
    with open_dict(cfg):
        cfg.norm = trained["norm"]
    return cfg


def load_pretrained(model: nn.Module, cfg: Any) -> tuple[dict[str, Any], nn.Module | None]:
    """``task.pretrained``'s backbone weights into ``model`` (on the meta device: checked only), converted
    to this config's normalizer when it is not the source's (``task.keep_pretrained_norm=false``; foreign
    weights: their LayerNorms); returns (the record's ``pretrained``, less the starting run's metrics; the
    source model with its normalizer, when converted)."""
    source = str(cfg.task.pretrained)
    device = next(model.parameters()).device
    if is_foreign(source):
        trained = foreign_source_config(cfg)
        if cfg.norm.name == "ln":  # LayerNorm into LayerNorm: nothing to convert (eps is no weight)
            trained["norm"] = OmegaConf.to_container(cfg.norm, resolve=True)
        with torch.device("cpu"):  # what the file is read into (its family's filter, .npz loading)
            holder = build_backbone(trained["backbone"], trained["norm"])
        weights, provenance = read_foreign(source, holder)
        which, task = "pretrained", provenance["kind"]
    else:
        weights, which, task = starting_weights(source)
        trained, provenance = checkpoint_run_config(source), {"source": source, "kind": "run"}
    fresh, dropped = HEAD, ("norm.",) if isinstance(getattr(model, "norm", None), nn.Identity) else ()
    norm = OmegaConf.to_container(cfg.norm, resolve=True)
    converted, source_model = {}, None
    if trained is not None and trained["norm"] != norm:
        weights, conversion, source_model = without_source_norm(weights, trained, norm, device)
        fresh, dropped = (*fresh, *conversion["fresh"]), (*dropped, *conversion["dropped"])
        converted = {"converted": conversion}
    if norm.get("alpha_init") == "calibrate":
        if source_model is None or not converted_layers(source_model, model):
            raise UserError(f"norm.alpha_init=calibrate sets alpha from a pretrained LayerNorm model, and "
                            f"'{source}' holds no LayerNorm that becomes {norm['name']} here: use "
                            "norm.alpha_init=alpha0")
        check_calibration(model)
    report = load_starting_weights(model, resized_position_embedding(model, weights), source, fresh=fresh,
                                   dropped=dropped)
    return {"run": source, **provenance, "task": task, "weights": which, **report, **converted}, source_model


def linear_head(model: nn.Module) -> nn.Linear:
    """The classifier ``task.head_init_std`` and ``task.linear_probe`` act on."""
    head = getattr(model, "head", None)
    if not isinstance(head, nn.Linear):
        raise UserError(f"task.head_init_std / task.linear_probe need a linear classifier 'head'; "
                        f"{type(model).__name__} has none")
    return head


def start_from(model: nn.Module, cfg: Any, record: RunRecord, data: Any = None) -> dict[str, Any] | None:
    """``task.pretrained``'s backbone weights into ``model`` (with ``data``, a conversion is calibrated and
    compared on ``task.calibration_batches`` training batches: :mod:`normexp.tasks.conversion`),
    ``task.head_init_std``, and for ``task.linear_probe`` a frozen backbone under a batch-normalised linear
    head. Returns the record's ``pretrained`` (None without a source)."""
    source = cfg.task.get("pretrained")
    pretrained = None
    if source:
        report, source_model = load_pretrained(model, cfg)
        if source_model is not None and data is not None:
            report["converted"].update(compare_conversion(source_model, model, cfg, data))
        directory = resolve_source(source)  # a run directory, run:<run_id>, or a checkpoint file
        reached = read_summary(directory)["metrics"].get("final", {}) \
            if not is_foreign(source) and (directory / "summary.json").is_file() else {}
        pretrained = {**report, "final": reached}  # the starting run's final evaluation
        record.update(pretrained=pretrained)
        log.info("backbone weights: the %s weights of %s (%s); afresh: %s; unused: %s", report["weights"],
                 source, report["task"], ", ".join(report["fresh"]) or "none",
                 ", ".join(report["dropped"]) or "none")
    if cfg.task.head_init_std or cfg.task.linear_probe:
        start_head(model, cfg)
    return pretrained


def compare_conversion(source: nn.Module, model: nn.Module, cfg: Any, data: Any) -> dict[str, Any]:
    """Calibrate alpha (``norm.alpha_init=calibrate``) and measure each converted layer's R^2 on the first
    ``task.calibration_batches`` training batches, on the device the run trains on."""
    device = resolve_device(cfg.trainer.device, distributed.info().local_rank)
    source.to(device)
    model.to(device)
    loader = data.train
    set_epoch(loader, 0)
    images = [batch[0].to(device) for batch in itertools.islice(loader, cfg.task.calibration_batches)]
    comparison = calibrate_and_compare(source, model, images)
    for layer in comparison["layers"]:
        log.info("converted %s: input std %.4g, alpha %s, R^2 %.4f", layer["layer"], layer["input_std"],
                 f"{layer['alpha']:.4g}" if "alpha" in layer else "-", layer["r2"])
    return comparison


def start_head(model: nn.Module, cfg: Any) -> None:
    """``task.head_init_std``'s new classifier, and ``task.linear_probe``'s frozen backbone."""
    head = linear_head(model)
    if cfg.task.head_init_std:  # a parametrized head (norm.convert_classifier) is initialised at its source,
        # and a parametrization that read the old weight (sigma-Reparam's gamma and u) restarts from the new
        parametrized = parametrize.is_parametrized(head, "weight")
        weight = head.parametrizations.weight.original if parametrized else head.weight
        trunc_normal_(weight, std=cfg.task.head_init_std)
        nn.init.zeros_(head.bias)
        for parametrization in head.parametrizations.weight if parametrized else ():
            if hasattr(parametrization, "restart"):
                parametrization.restart(weight)
    if cfg.task.linear_probe:
        for parameter in model.parameters():
            parameter.requires_grad_(False)
        model.head = nn.Sequential(nn.BatchNorm1d(head.in_features, affine=False, eps=1e-6), head)
        for parameter in model.head.parameters():
            parameter.requires_grad_(True)


def run_classification(cfg: Any, record: RunRecord) -> dict[str, Any]:
    data = build_classification_data(cfg.data, cfg.seed, eval_train=cfg.task.eval_train_loss)
    model = build_backbone(cfg.backbone, cfg.norm)
    pretrained = start_from(model, cfg, record, data)
    record.update(params=count_params(model),
                  gmacs=round(count_gmacs(model, (data.in_chans, data.img_size, data.img_size)), 4))
    log.info("%s with norm=%s: %.2fM params, %.3f GMACs", cfg.backbone.name, cfg.norm.name,
             record.summary["params"] / 1e6, record.summary["gmacs"])
    settings = cfg.task.get("robustness")
    robustness = settings is not None and settings.enabled
    trainer = ClassificationTrainer(cfg.trainer, model, data, record, get_probes(cfg.task.get("probes")))
    if pretrained is not None and (cfg.task.evaluate_start or "converted" in pretrained):
        # the starting point's accuracy on this run's data, before any update (a converted model's included)
        start = trainer.evaluate(trainer.module, "start")
        record.update(pretrained={**pretrained, "start": {k.split("/", 1)[1]: v for k, v in start.items()}})
        log.info("before fine-tuning: %s", "  ".join(f"{k}={v:.4g}" for k, v in start.items()))
    metrics = fit_and_record(trainer, record, cfg)
    if robustness:  # the final model, into this record
        evaluated = trainer.ema.module if settings.ema else trainer.module
        metrics["robustness"] = evaluate_robustness(
            settings, cfg.data, evaluated, record, trainer.precision, progress=trainer.progress,
            first_step=trainer.update + 1, epoch=cfg.trainer.epochs)
        record.update(metrics=metrics)
    return metrics


def metric_names(values: dict[str, Any]) -> list[str]:
    return evaluated(values, ["top1", "top5", "loss"])


def classification_settings(values: dict[str, Any]) -> dict[str, Any]:
    task = values["task"]
    settings = {"pretrained": task.get("pretrained"), "linear_probe": task.get("linear_probe") or None}
    if (task.get("robustness") or {}).get("enabled"):
        settings["robustness"] = values["data"].get("imagenet_c_root") or "on the fly"
    return settings


register_task(Task("classification", run_classification, data=("digits", "imagenet"),
                   metrics=metric_names, check=check_classification, prepare=with_pretrained_model,
                   starts_from="task.pretrained", backbone_weights=reported_weights,
                   settings=classification_settings))
