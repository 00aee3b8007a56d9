"""Robustness: a classifier's errors on corrupted images (ImageNet-C protocol) -> CE, mCE, relative mCE.
``task=robustness task.checkpoint=<run>`` evaluates a trained checkpoint (its model rebuilt from that run's
config before the record is written); ``task=classification task.robustness.enabled=true`` the model just
trained. CE is normalised by ``reference_run`` when given, else AlexNet's published ImageNet errors, else not
at all (the output says so)."""

from __future__ import annotations

import copy
import logging
import math
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict
from torch import nn

from .. import distributed
from ..data.corruptions import CorruptionSuite, build_corruption_suite
from ..data.loaders import default_cache_dir, make_loader
from ..engine.checkpoint import load_checkpoint, load_model_state
from ..engine.evaluate import count_predictions, show_progress
from ..engine.precision import Precision, resolve_device
from ..errors import UserError
from ..metrics.robustness import (
    ALEXNET,
    CORRUPTIONS,
    EXTRA_CORRUPTIONS,
    GROUP_OF,
    SEVERITIES,
    ErrorTable,
    Normaliser,
    benchmark_mean,
    corruption_errors,
    group_errors,
    mean_errors,
    relative_corruption_errors,
)
from ..models import build_backbone
from ..models.stats import count_params
from ..tracking.records import RunRecord, read_config, read_summary
from . import Task, register_task
from .pretrained import source_config

log = logging.getLogger(__name__)

# Data settings that say where images are and how they are loaded, or act in training only: free to differ
# from the checkpoint's run (anything else that differs is reported).
LOADING_KEYS = {"root", "imagenet_c_root", "batch_size", "eval_batch_size", "num_workers", "pin_memory",
                "train_split", "auto_augment", "color_jitter", "reprob", "remode", "recount"}


# ---------------------------------------------------------------- which corruptions, which normaliser
def selected_corruptions(settings: Any) -> list[str]:
    chosen = settings.corruptions
    names = list(CORRUPTIONS) if chosen == "all" else list(chosen)
    unknown = [c for c in names if c not in CORRUPTIONS + EXTRA_CORRUPTIONS]
    if unknown:
        raise UserError(f"unknown corruption(s) {unknown}; use 'all' or a list of {', '.join(CORRUPTIONS)} "
                        f"(extra: {', '.join(EXTRA_CORRUPTIONS)})")
    if settings.extra:
        names += [c for c in EXTRA_CORRUPTIONS if c not in names]
    return names


def selected_severities(settings: Any) -> list[int]:
    severities = sorted(set(settings.severities))
    if not severities or any(s not in SEVERITIES for s in severities):
        raise UserError(f"severities must be a non-empty subset of {list(SEVERITIES)}, "
                        f"got {settings.severities}")
    return severities


def reference_normaliser(run_dir: str | Path, data_name: str, corruptions: list[str],
                         severities: list[int]) -> Normaliser:
    """A run's own errors (averaged over ``severities``) as the CE normaliser."""
    run_dir = Path(run_dir)
    try:
        summary, config = read_summary(run_dir), read_config(run_dir)  # damaged: one line saying why
    except FileNotFoundError as e:
        missing = Path(e.filename).name
        raise UserError(f"reference_run '{run_dir}' is not a run directory (no {missing})") from e
    results = summary.get("metrics", {}).get("robustness")
    if not results:
        raise UserError(f"reference_run '{run_dir}' has no robustness results (status "
                        f"{summary.get('status')}): evaluate it with task=robustness first")
    if config["data"]["name"] != data_name:
        raise UserError(f"reference_run '{run_dir}' was evaluated on data={config['data']['name']}, "
                        f"this run on data={data_name}")
    errors = {}
    for c in corruptions:
        found = [results.get(f"err/{c}/s{s}") for s in severities]
        if None in found:
            if c in CORRUPTIONS:  # extras may go unnormalised, the benchmark may not
                missing = severities[found.index(None)]
                raise UserError(f"reference_run '{run_dir}' has no error for {c} severity {missing}: "
                                "evaluate it on the same corruptions and severities")
            continue
        errors[c] = sum(found) / len(found) / 100
    clean = results.get("clean_err")
    return Normaliser(f"reference run {run_dir} ({summary.get('name')})", errors,
                      None if clean is None else clean / 100)


def choose_normaliser(settings: Any, data_cfg: Any, corruptions: list[str],
                      severities: list[int]) -> tuple[Normaliser | None, str]:
    """The CE normaliser and, when there is none, why."""
    if settings.reference_run:
        return reference_normaliser(settings.reference_run, data_cfg.name, corruptions, severities), ""
    if data_cfg.name != "imagenet":
        return None, (f"no AlexNet errors exist for data={data_cfg.name}: set task.reference_run=<run dir> "
                      "(e.g. the LN baseline's robustness run) to get CE and mCE")
    if severities != list(SEVERITIES):
        return None, "AlexNet's published errors average severities 1-5: CE needs all five"
    return ALEXNET, ""


def check_robustness_settings(settings: Any, data_cfg: Any) -> None:
    """Fail on bad settings (names, severities, reference run) before any long work."""
    corruptions, severities = selected_corruptions(settings), selected_severities(settings)
    choose_normaliser(settings, data_cfg, corruptions, severities)


def require_checkpoint(cfg: Any) -> None:
    if not cfg.task.get("checkpoint"):
        raise UserError("task=robustness needs task.checkpoint=<run dir or checkpoint file> (or train and "
                        "evaluate in one run: task=classification task.robustness.enabled=true)")


def check_robustness(cfg: Any) -> None:
    """``task=robustness``: a checkpoint to evaluate, and the corruption settings."""
    require_checkpoint(cfg)
    check_robustness_settings(cfg.task, cfg.data)


# ---------------------------------------------------------------- evaluation
def count_correct(model: nn.Module, suite: CorruptionSuite, batch_size: int, num_workers: int,
                  precision: Precision, progress: bool) -> list[tuple[int, int]]:
    """(top-1 correct, images) per condition of the suite, summed over processes."""
    loader = make_loader(suite, batch_size, train=False, num_workers=num_workers, seed=0,
                         pin_memory=precision.device.type == "cuda")
    counts = count_predictions(model, loader, precision, num_groups=len(suite.conditions), progress=progress,
                               desc="robustness")
    return list(zip(counts.hits[0].tolist(), counts.seen.tolist(), strict=True))


def robustness_metrics(table: ErrorTable, clean_error: float | None,
                       normaliser: Normaliser | None) -> dict[str, Any]:
    """The record's flat metrics, in percent: errors per condition, per corruption, per group, CE, mCE."""
    means = mean_errors(table)
    metrics: dict[str, Any] = {"clean_err": clean_error}
    metrics.update({f"err/{c}/s{s}": e for c, by_s in table.items() for s, e in by_s.items()})
    metrics.update({f"err/{c}": e for c, e in means.items()})
    metrics.update({f"group_err/{g}": e for g, e in group_errors(table).items()})
    metrics["mean_corruption_err"] = benchmark_mean(means)  # mCE "unnormalized" (hendrycks test.py)
    if normaliser is not None:
        ce = corruption_errors(means, normaliser)
        metrics.update({f"ce/{c}": v for c, v in ce.items()})
        metrics["mce"] = benchmark_mean(ce)
        if clean_error is not None and normaliser.clean_error is not None:
            relative = relative_corruption_errors(means, clean_error, normaliser)
            metrics.update({f"relative_ce/{c}": v for c, v in relative.items()})
            metrics["relative_mce"] = benchmark_mean(relative)
    percent = {k: None if v is None or math.isnan(v) else 100 * v for k, v in metrics.items()}
    percent["mce_corruptions"] = sum(c in CORRUPTIONS for c in table)
    percent["normalised_by"] = normaliser.name if normaliser is not None else None
    return percent


def _cell(value: float | None, width: int = 6) -> str:
    return f"{value:{width}.1f}" if value is not None else " " * (width - 1) + "-"


def format_table(metrics: dict[str, Any], corruptions: list[str], severities: list[int]) -> str:
    head = (f"{'corruption':<18} {'group':<8}" + "".join(f"{'s' + str(s):>6}" for s in severities)
            + f"{'mean':>7}{'CE':>7}{'relCE':>7}")
    lines = [head, "-" * len(head)]
    for c in corruptions:
        errors = "".join(_cell(metrics[f"err/{c}/s{s}"]) for s in severities)
        lines.append(f"{c:<18} {GROUP_OF[c]:<8}{errors}" + _cell(metrics[f"err/{c}"], 7)
                     + _cell(metrics.get(f"ce/{c}"), 7) + _cell(metrics.get(f"relative_ce/{c}"), 7))
    groups = "  ".join(f"{k.split('/')[1]} {v:.1f}" for k, v in metrics.items() if k.startswith("group_err/"))
    lines.append("-" * len(head))
    lines.append("top-1 error in %; CE and relative CE in % of the normaliser's")
    lines.append(f"clean error {_cell(metrics['clean_err'], 0).strip()} %   mean error per group: {groups}")
    return "\n".join(lines)


def summary_lines(metrics: dict[str, Any], why_not_normalised: str) -> list[str]:
    k = metrics["mce_corruptions"]
    over = "over the 15 corruptions" if k == 15 else f"over {k} of the 15 corruptions, not the published mCE"
    # hendrycks' test.py prints this as "mCE (unnormalized by AlexNet errors)"
    lines = [f"unnormalised mCE {_cell(metrics['mean_corruption_err'], 0).strip()} % "
             f"(mean corruption error, {over})"]
    if metrics.get("mce") is not None:
        relative = metrics.get("relative_mce")
        relative = (f", relative mCE {relative:.2f} %" if relative is not None
                    else " (relative mCE needs the clean error of both models)")
        lines.append(f"mCE {metrics['mce']:.2f} %{relative} -- CE normalised by {metrics['normalised_by']}, "
                     f"{over}")
    else:
        lines.append(f"no mCE: {why_not_normalised}")
    return lines


def evaluate_robustness(settings: Any, data_cfg: Any, model: nn.Module, record: RunRecord,
                        precision: Precision, *, progress: bool = False, first_step: int = 1,
                        epoch: int | None = None) -> dict[str, Any]:
    """Evaluate ``model`` on the configured corruptions; log and print them, and return the metrics for
    ``summary["metrics"]["robustness"]``."""
    corruptions, severities = selected_corruptions(settings), selected_severities(settings)
    normaliser, why_not = choose_normaliser(settings, data_cfg, corruptions, severities)  # fail fast
    cache_dir = resolve_cache_dir(settings.cache_dir)
    suite = build_corruption_suite(data_cfg, corruptions, severities, settings.corruption_seed, cache_dir)
    if data_cfg.name == "imagenet" and not data_cfg.get("imagenet_c_root"):
        log.warning("ImageNet corrupted on the fly: not the released ImageNet-C (motion_blur and snow are "
                    "reimplemented, no JPEG step); report mCE from data.imagenet_c_root")
    log.info("robustness: %d corruptions x %d severities, %s", len(corruptions), len(severities),
             suite.description)
    counts = count_correct(model, suite, settings.batch_size, settings.num_workers, precision, progress)

    table: dict[str, dict[int, float]] = {}
    clean_error = None
    for condition, (correct, seen) in zip(suite.conditions, counts, strict=True):
        error = 1 - correct / seen
        if condition.corruption is None:
            clean_error = error
        else:
            table.setdefault(condition.corruption, {})[condition.severity] = error
    metrics = robustness_metrics(table, clean_error, normaliser)
    metrics["source"] = suite.description
    for step, (c, s) in enumerate(((c, s) for c in corruptions for s in severities), start=first_step):
        record.log({"step": step, "epoch": epoch, "corruption": c, "severity": s,
                    "robustness/err": metrics[f"err/{c}/s{s}"]})
    text = "\n".join([format_table(metrics, corruptions, severities), *summary_lines(metrics, why_not)])
    if record.writes:
        (record.dir / "robustness.txt").write_text(text + "\n")
        print(text, flush=True)
    return metrics


def resolve_cache_dir(setting: str | None) -> Path | None:
    """``auto``: the default cache directory; null: no cache."""
    if setting != "auto":
        return Path(setting) if setting else None
    return default_cache_dir("corruption_cache")


# ---------------------------------------------------------------- the checkpoint's model
def with_checkpoint_model(cfg: DictConfig) -> DictConfig:
    """The config with the checkpoint run's backbone and norm; data must match the run's dataset, size and
    classes (other differences are reported)."""
    require_checkpoint(cfg)
    trained = source_config(cfg.task.checkpoint, "task.checkpoint")
    if trained is None:
        return cfg
    trained_data = trained["data"]
    if trained_data["name"] != cfg.data.name:
        raise UserError(f"checkpoint '{cfg.task.checkpoint}' was trained on data={trained_data['name']}; "
                        f"evaluate it with data={trained_data['name']} (this run has data={cfg.data.name})")
    data = OmegaConf.to_container(cfg.data, resolve=True)
    for key in ("img_size", "num_classes"):
        if data.get(key) != trained_data.get(key):
            raise UserError(f"checkpoint '{cfg.task.checkpoint}' was trained with data.{key}="
                            f"{trained_data.get(key)}; this run has {data.get(key)}: pass data.{key}="
                            f"{trained_data.get(key)}")
    differing = sorted(k for k in set(data) | set(trained_data)
                       if k not in LOADING_KEYS and data.get(k) != trained_data.get(k))
    if differing:
        log.warning("data settings differ from the checkpoint's run: %s",
                    ", ".join(f"{k}={data.get(k)} (trained {trained_data.get(k)})" for k in differing))
    cfg = copy.deepcopy(cfg)
    with open_dict(cfg):
        cfg.backbone = trained["backbone"]
        cfg.norm = trained["norm"]
    return cfg


def load_trained_model(source: str | Path, backbone_cfg: Any, norm_cfg: Any,
                       ema: bool = False) -> tuple[nn.Module, dict[str, Any]]:
    """(model, checkpoint state) of a run directory or checkpoint file, its EMA weights with ``ema``."""
    state = load_checkpoint(source)
    weights = state.get("model", state) if isinstance(state, dict) else state
    if ema:
        weights = state.get("ema") if isinstance(state, dict) else None
        if weights is None:
            raise UserError(f"checkpoint '{source}' has no EMA weights (trained with "
                            "trainer.ema.enabled=false): drop task.ema=true")
    model = build_backbone(backbone_cfg, norm_cfg)
    load_model_state(model, weights, str(source))
    return model, state if isinstance(state, dict) else {}


def run_robustness(cfg: Any, record: RunRecord) -> dict[str, Any]:
    model, state = load_trained_model(cfg.task.checkpoint, cfg.backbone, cfg.norm, cfg.task.ema)
    record.update(params=count_params(model))
    epoch = state.get("epoch")
    log.info("evaluating %s (%s with norm=%s, epoch %s%s)", cfg.task.checkpoint, cfg.backbone.name,
             cfg.norm.name, epoch, ", EMA weights" if cfg.task.ema else "")
    precision = Precision(cfg.trainer.amp, resolve_device(cfg.trainer.device, distributed.info().local_rank))
    progress = show_progress(cfg.trainer.progress) and record.writes
    metrics = {"robustness": evaluate_robustness(
        cfg.task, cfg.data, model.to(precision.device), record, precision, progress=progress, epoch=epoch)}
    record.update(metrics=metrics, checkpoint=str(cfg.task.checkpoint))
    return metrics


register_task(Task("robustness", run_robustness, data=("digits", "imagenet"), check=check_robustness,
                   prepare=with_checkpoint_model, starts_from="task.checkpoint"))
