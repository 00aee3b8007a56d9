"""Class-conditional diffusion with DiT (``task=dit``; Peebles & Xie 2023, arXiv 2212.09748), as
facebookresearch/DiT ``train.py``: train the ``dit_*`` backbone to denoise (ADM's preprocessing, optionally
on SD-VAE latents, ``task.latent_cache`` to encode once), then sample and score it (``dit_sampling``, its
``sample_ddp.py``). docs/generation.md has the details.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import logging
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, open_dict
from PIL import Image
from torch import nn
from torchvision.transforms import v2

from .. import distributed
from ..data import ImageSpec, build_classification_data
from ..data.images import center_crop_arr
from ..data.loaders import make_loader, set_epoch
from ..diffusion import GaussianDiffusion, spaced_steps
from ..engine.checkpoint import (
    load_checkpoint,
    load_model_state,
    reported_weights,
)
from ..engine.precision import resolve_device
from ..engine.probes import Forward, Probe, get_probes
from ..engine.trainer import Trainer
from ..errors import UserError
from ..metrics.fid import load_reference
from ..models import build_backbone
from ..models.base import DIFFUSION
from ..models.features import (
    DigitsFeatures,
    InceptionFeatures,
    check_inception_weights,
)
from ..models.stats import count_params
from ..models.vae import CHANNELS, DOWNSAMPLE, LatentCodec, check_vae
from ..tracking.provenance import stream_generator
from ..tracking.records import RunRecord
from . import ModelInput, Task, evaluated, fit_and_record, register_task
from .dit_sampling import feature_kind, reference_source, sample_and_score
from .latent_cache import CachedLatents, cache_folder, encode_dataset, shard_sizes
from .pretrained import source_config

log = logging.getLogger(__name__)


# ---------------------------------------------------------------- configuration
def latent(cfg: Any) -> bool:
    return bool(cfg.task.vae)


def with_model_input(cfg: DictConfig) -> DictConfig:
    """The config the task runs: VAE latents as the model input; with ``task.checkpoint``, that run's
    model."""
    cfg = copy.deepcopy(cfg)
    with open_dict(cfg):
        if cfg.task.checkpoint:
            trained = source_config(cfg.task.checkpoint, "task.checkpoint", DIFFUSION)
            if trained is None:
                raise UserError(f"task.checkpoint={cfg.task.checkpoint} is not a run of task=dit")
            for key in ("img_size", "num_classes"):
                if trained["data"].get(key) != cfg.data.get(key):
                    value = trained["data"].get(key)
                    raise UserError(f"task.checkpoint's run was trained with data.{key}={value}; this run "
                                    f"has {cfg.data.get(key)}: pass data.{key}={value}")
            cfg.backbone, cfg.norm = trained["backbone"], trained["norm"]
            cfg.task.vae = trained["task"]["vae"]
            return cfg
        if latent(cfg):
            cfg.backbone.input_size = cfg.data.img_size // DOWNSAMPLE
            cfg.backbone.in_chans = CHANNELS
    return cfg


def check_dit(cfg: Any) -> None:
    """Before any work: sizes, sampling spacing and the weights the run reads."""
    task = cfg.task
    if latent(cfg) and cfg.data.img_size % DOWNSAMPLE:
        raise UserError(f"data.img_size={cfg.data.img_size}: the VAE needs a multiple of {DOWNSAMPLE} "
                        "(DiT: 256)")
    try:
        spaced_steps(task.diffusion_steps, task.sampling_steps)
    except ValueError as e:
        raise UserError(f"task.sampling_steps={task.sampling_steps}: {e}") from None
    if task.fid.samples < 2 or task.fid.batch_size < 1:
        raise UserError("task.fid.samples must be at least 2 and task.fid.batch_size at least 1")
    if latent(cfg):
        check_vae(str(task.vae))
    elif task.latent_cache:
        raise UserError("task.latent_cache keeps the VAE's latents: set task.vae too (pixel space has none)")
    if task.latent_cache_shard < 1:
        raise UserError(f"task.latent_cache_shard={task.latent_cache_shard}: images per shard, at least 1")
    if feature_kind(cfg) == "inception":
        check_inception_weights(task.fid.inception_weights)
    reference = reference_source(cfg)
    if reference and not Path(reference).exists():
        raise UserError(f"task.fid.reference={reference} does not exist: give ADM's reference batch (.npz) "
                        "or an ImageFolder of the reference images")
    if reference and Path(reference).is_file():
        dims = DigitsFeatures.dims if feature_kind(cfg) == "digits" else InceptionFeatures.dims
        load_reference(reference, cfg.data.img_size, dims)
    if task.checkpoint:
        load_checkpoint(task.checkpoint)


# ---------------------------------------------------------------- data
def dit_views(hflip: float) -> Any:
    """DiT's transform: the ADM crop of PIL images (the digits: tensors at size already), a flip, [-1, 1]."""
    def transform(spec: ImageSpec) -> Any:
        def convert(image: Any) -> torch.Tensor:
            if isinstance(image, Image.Image):
                crop = center_crop_arr(image.convert("RGB"), spec.img_size)
                image = v2.functional.pil_to_tensor(crop) / 255.0
            return image * 2 - 1
        return v2.Compose([v2.Lambda(convert), v2.RandomHorizontalFlip(hflip)]) if hflip else convert
    return transform


# ---------------------------------------------------------------- training
FIT_BATCHES = 100  # Derf's evaluation-mode training loss of DiT (arXiv 2512.10938v2, App. E)


class DiTTrainer(Trainer):
    """The common loop with the diffusion loss; evaluation: that loss at fixed steps and noise."""

    minimized = ("loss",)

    def __init__(self, cfg: Any, model: nn.Module, data: Any, record: RunRecord, diffusion: GaussianDiffusion,
                 codec: LatentCodec | None, seed: int, probes: Sequence[Probe] = ()) -> None:
        super().__init__(cfg, model, data, record, probes)
        self.diffusion, self.seed = diffusion, seed
        self.codec = codec.to(self.device) if codec is not None else None

    def to_model_space(self, images: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        if self.codec is None:
            return images
        if images.shape[1] == 2 * CHANNELS:
            return self.codec.sample(images, generator)
        return self.codec.encode(images, generator)

    def compute_loss(self, images: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.to_model_space(images)
        t = torch.randint(0, self.diffusion.num_steps, (len(x),), device=x.device)
        with self.precision.autocast():
            return self.diffusion.training_losses(self.model, x, t, y=targets)["loss"].mean()

    def generator(self, stream: int) -> torch.Generator:
        """Noise of its own (0: the validation loss, 1: the probe), the same every epoch."""
        rank = distributed.info().rank
        return stream_generator(self.seed, stream, rank)

    def evaluate(self, model: nn.Module, prefix: str) -> dict[str, float]:
        loss = self.diffusion_loss(model, self.data.val, self.generator(0))
        return {f"{prefix}/loss": loss["loss"]}

    fit_metric = "mse"  # Derf App. E reports the diffusion MSE, not the variance bound added to it

    def evaluate_train(self, model: nn.Module, prefix: str) -> dict[str, float]:
        """On the first epoch's first ``FIT_BATCHES`` training batches (Derf App. E: the flip is kept)."""
        set_epoch(self.data.train, 0)
        loss = self.diffusion_loss(model, itertools.islice(self.data.train, FIT_BATCHES), self.generator(2))
        return {f"{prefix}/{name}": value for name, value in loss.items()}

    @torch.no_grad()
    def diffusion_loss(self, model: nn.Module, batches: Iterable[Any],
                       generator: torch.Generator) -> dict[str, float]:
        """Mean diffusion loss and MSE over ``batches`` (all processes); steps, noise from ``generator``."""
        model.eval()
        total = torch.zeros(3, dtype=torch.float64, device=self.device)
        for batch in batches:
            if batch is None:
                continue
            x = self.to_model_space(batch[0].to(self.device), generator)
            t = torch.randint(0, self.diffusion.num_steps, (len(x),), generator=generator).to(self.device)
            noise = torch.randn(x.shape, generator=generator).to(self.device)
            with self.precision.autocast():
                terms = self.diffusion.training_losses(model, x, t, noise, y=batch[1].to(self.device))
            total += torch.stack([terms["loss"].double().sum(), terms["mse"].double().sum(),
                                  torch.tensor(float(len(x)), device=self.device, dtype=torch.float64)])
        total = distributed.all_reduce_sum(total)
        model.train()
        return {"loss": float(total[0] / total[2]), "mse": float(total[1] / total[2])}

    def probe_forward(self) -> Forward:
        """The probe images noised halfway with fixed noise."""
        model, generator = self.module, self.generator(1)

        def forward(images: torch.Tensor) -> Any:
            x = self.to_model_space(images, generator)
            t = torch.full((len(x),), self.diffusion.num_steps // 2, device=x.device)
            xt = self.diffusion.q_sample(x, t, torch.randn(x.shape, generator=generator).to(x.device))
            return model(xt, t, torch.zeros(len(x), dtype=torch.long, device=x.device))

        return forward


# ---------------------------------------------------------------- sampling and scoring
def with_latent_cache(cfg: Any, data: Any, codec: LatentCodec) -> Any:
    """``data`` training on the cached latents of its training images (encoded first where missing)."""
    images = build_classification_data(cfg.data, cfg.seed, train_transform=dit_views(0.0)).train.dataset
    folder, identity = cache_folder(cfg, images, codec)
    device = resolve_device(cfg.trainer.device, distributed.info().local_rank)
    paths = encode_dataset(images, codec.to(device), folder, identity, cfg.data.eval_batch_size, device)
    latents = CachedLatents(paths, shard_sizes(len(images), identity["shard"]), cfg.task.hflip)
    train = make_loader(latents, cfg.data.batch_size, True, cfg.data.num_workers, cfg.seed)
    return dataclasses.replace(data, train=train)


# ---------------------------------------------------------------- the task
def run_dit(cfg: Any, record: RunRecord) -> dict[str, Any]:
    model = build_backbone(cfg.backbone, cfg.norm)
    codec = LatentCodec.load(str(cfg.task.vae), cfg.task.latent_scale) if latent(cfg) else None
    record.update(params=count_params(model), trainable_params=count_params(model, trainable=True))
    log.info("%s with norm=%s: %.2fM params, %s space, zero_init=%s", cfg.backbone.name, cfg.norm.name,
             record.summary["params"] / 1e6, "latent" if codec else "pixel", cfg.backbone.zero_init)
    if cfg.task.checkpoint:
        weights, which = reported_weights(load_checkpoint(cfg.task.checkpoint))
        load_model_state(model, weights, str(cfg.task.checkpoint))
        device = resolve_device(cfg.trainer.device, distributed.info().local_rank)
        scores = sample_and_score(cfg, model.to(device), codec.to(device) if codec else None, record, device)
        metrics = {"final": {f"val/{k}": v for k, v in scores.items()}, "best": {},
                   "reported": {"weights": which, **scores}}
        record.update(metrics=metrics)
        return metrics
    views = dit_views(cfg.task.hflip)
    data = build_classification_data(cfg.data, cfg.seed, train_transform=views, eval_transform=dit_views(0.0))
    if cfg.task.latent_cache:
        data = with_latent_cache(cfg, data, codec)
    diffusion = GaussianDiffusion.create(cfg.task.diffusion_steps, learn_sigma=model.learn_sigma,
                                         sigma_small=cfg.task.sigma_small)
    trainer = DiTTrainer(cfg.trainer, model, data, record, diffusion, codec, cfg.seed,
                         get_probes(cfg.task.get("probes")))
    metrics = fit_and_record(trainer, record, cfg)
    weights = trainer.ema.module if trainer.ema is not None and cfg.trainer.ema.reported else trainer.module
    prefix = "ema/val" if weights is not trainer.module else "val"
    scores = sample_and_score(cfg, weights, trainer.codec, record, trainer.device, trainer.update,
                              trainer.epoch)
    metrics["final"].update({f"{prefix}/{k}": v for k, v in scores.items()})
    metrics["reported"].update(scores)
    record.update(metrics=metrics)
    return metrics


def metric_names(values: dict[str, Any]) -> list[str]:
    return evaluated(values, ["loss"])


def noised_input(config: dict[str, Any]) -> ModelInput:
    """What ``normexp analyze`` feeds a trained DiT (DyT Fig. 2's DiT panel): noised validation inputs."""
    task = config["task"]
    codec = LatentCodec.load(str(task["vae"]), task["latent_scale"]) if task["vae"] else None
    diffusion = GaussianDiffusion.create(task["diffusion_steps"])

    def forward(model: nn.Module, images: torch.Tensor, labels: torch.Tensor,
                generator: torch.Generator) -> torch.Tensor:
        x = codec.to(images.device).encode(images, generator) if codec is not None else images
        t = torch.randint(0, diffusion.num_steps, (len(x),), generator=generator).to(x.device)
        noise = torch.randn(x.shape, generator=generator).to(x.device)
        return model(diffusion.q_sample(x, t, noise), t, labels.to(x.device))

    return ModelInput(dit_views(0.0), forward,
                      "noised at uniformly drawn diffusion steps (seeded), with their labels")


def dit_settings(values: dict[str, Any]) -> dict[str, Any]:
    task = values["task"]
    return {"space": "latent" if task["vae"] else "pixel", "zero_init": values["backbone"].get("zero_init"),
            "sampling_steps": task["sampling_steps"], "guidance": task["guidance"],
            "samples": task["fid"]["samples"]}


register_task(Task("dit", run_dit, data=("digits", "imagenet"), metrics=metric_names, check=check_dit,
                   prepare=with_model_input, starts_from="task.checkpoint", settings=dit_settings,
                   need=DIFFUSION, backbone_weights=reported_weights, model_input=noised_input))
