"""MAE pre-training (``task=mae``; He et al. 2022, arXiv 2111.06377; facebookresearch/mae
``main_pretrain.py``, ``engine_pretrain.py``) of :class:`normexp.models.mae.MaskedAutoencoder` around the
configured backbone. Each evaluation reports ``val/loss`` with fixed masks and writes
``reconstructions/epoch_<n>.png``; fine-tuning starts from the encoder."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image
from timm.models.vision_transformer import VisionTransformer
from torch import nn
from torchvision.transforms import InterpolationMode, v2

from .. import distributed
from ..config import rng
from ..data import ImageSpec, build_classification_data
from ..engine.alpha_probe import probe_batch
from ..engine.probes import Forward, Probe, get_probes
from ..engine.trainer import Trainer
from ..errors import UserError
from ..models import backbone_arguments, build_model, create_model
from ..models.mae import MaskedAutoencoder, unpatchify
from ..models.registry import model_classes
from ..models.stats import count_params
from ..tracking.provenance import stream_generator
from ..tracking.records import RunRecord
from . import Task, evaluated, fit_and_record, register_task

log = logging.getLogger(__name__)

ENCODER = "encoder."


def build_mae(cfg: Any) -> MaskedAutoencoder:
    """The masked autoencoder of ``cfg``: its backbone (no head) as the encoder, ``task.decoder``; a mask
    that keeps none of its patches is one line."""
    name, kwargs = backbone_arguments(cfg.backbone)
    kwargs.update(num_classes=0, global_pool="token")  # an encoder: no head, and its final norm
    decoder = cfg.task.decoder

    def construct() -> MaskedAutoencoder:
        return MaskedAutoencoder(create_model(name, **kwargs), decoder.dim, decoder.depth, decoder.heads,
                                 mask_ratio=cfg.task.mask_ratio, norm_pix_loss=cfg.task.norm_pix_loss)

    model = build_model(construct, cfg.norm, f"MAE over backbone '{name}'")
    patches = model.grid[0] * model.grid[1]
    if int(patches * (1 - cfg.task.mask_ratio)) < 1:
        raise UserError(f"task.mask_ratio={cfg.task.mask_ratio} keeps none of the {patches} patches of "
                        f"backbone={name} at data.img_size={cfg.data.img_size}: use at most "
                        f"{1 - 1 / patches:.4g}")
    return model


def check_mae(cfg: Any) -> None:
    """Before any work (the mask ratio's range: ``RANGES``): a ViT backbone and crops of a real area."""
    name = cfg.backbone.name
    if not all(issubclass(c, VisionTransformer) for c in model_classes(name)):
        raise UserError(f"MAE needs a ViT backbone (got {name}): its encoder sees the visible patches as "
                        "tokens; pick backbone=vit_*")
    scale = list(cfg.task.crop_scale)
    if len(scale) != 2 or not 0 < scale[0] <= scale[1] <= 1:
        raise UserError(f"task.crop_scale={scale}: [min, max] areas of the crop, 0 < min <= max <= 1")


def mae_views(crop_scale: tuple[float, float], hflip: float) -> Any:
    """MAE's training views (``main_pretrain.py``): a random resized crop, bicubic, and a flip."""
    def transform(spec: ImageSpec) -> v2.Compose:
        return v2.Compose([
            v2.RandomResizedCrop(spec.img_size, scale=crop_scale, interpolation=InterpolationMode.BICUBIC,
                                 antialias=True),
            v2.RandomHorizontalFlip(hflip),
            v2.ToImage(), v2.ToDtype(torch.float32, scale=True),
            v2.Normalize(spec.mean, spec.std),
        ])
    return transform


def encoder_weights(state: dict[str, Any], ema: bool | None) -> tuple[dict[str, Any], str]:
    """The encoder's weights in an MAE checkpoint (MAE keeps no EMA)."""
    if ema:
        raise UserError("an MAE run keeps no EMA weights")
    model = state.get("model", state)
    return {k.removeprefix(ENCODER): v for k, v in model.items() if k.startswith(ENCODER)}, "encoder"


def reconstruction_grid(model: MaskedAutoencoder, images: torch.Tensor, mask: torch.Tensor,
                        prediction: torch.Tensor, scale: int) -> Image.Image:
    """Rows of [original | masked | reconstruction | reconstruction + visible patches], enlarged
    ``scale``x."""
    reconstruction = model.reconstruct(images, prediction)
    patch_mask = mask[..., None].expand(-1, -1, model.patch * model.patch * images.shape[1])
    pixel_mask = unpatchify(patch_mask, model.patch, model.grid)
    low = images.amin(dim=(1, 2, 3), keepdim=True)
    high = images.amax(dim=(1, 2, 3), keepdim=True)
    masked = images * (1 - pixel_mask) + low * pixel_mask
    pasted = images * (1 - pixel_mask) + reconstruction * pixel_mask
    rows = [torch.cat([((x - low[i]) / (high[i] - low[i] + 1e-8)).clamp(0, 1)
                       for x in (images[i], masked[i], reconstruction[i], pasted[i])], dim=2)
            for i in range(len(images))]
    grid = torch.cat(rows, dim=1)  # (C, rows * H, 4 * W)
    pixels = (grid.permute(1, 2, 0).float().cpu().numpy() * 255).round().astype(np.uint8)
    picture = Image.fromarray(pixels if pixels.shape[2] == 3 else pixels[..., 0])
    return picture.resize((picture.width * scale, picture.height * scale), Image.NEAREST)


class MAETrainer(Trainer):
    """The common loop with MAE's loss; evaluation: the reconstruction loss with fixed masks, and a
    picture."""

    minimized = ("loss",)
    model: nn.Module

    def __init__(self, cfg: Any, model: MaskedAutoencoder, data: Any, record: RunRecord, settings: Any,
                 seed: int, probes: Sequence[Probe] = ()) -> None:
        super().__init__(cfg, model, data, record, probes)
        self.settings, self.seed = settings, seed

    def masks(self, stream: int) -> torch.Generator:
        """Masking noise from a generator of its own (0: validation, 1: picture, 2: probe), fixed per
        epoch."""
        rank = distributed.info().rank
        return stream_generator(self.seed, stream, rank)

    def compute_loss(self, images: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with self.precision.autocast():
            return self.model(images)[0]

    @torch.no_grad()
    def evaluate(self, model: nn.Module, prefix: str) -> dict[str, float]:
        model.eval()
        generator = self.masks(0)
        tokens = model.grid[0] * model.grid[1]
        total = torch.zeros(2, dtype=torch.float64, device=self.device)
        for batch in self.data.val:
            if batch is None:  # no readable image in it
                continue
            images = batch[0].to(self.device)
            noise = torch.rand(len(images), tokens, generator=generator).to(self.device)
            with self.precision.autocast():
                loss = model(images, noise)[0]
            total += torch.stack([loss.double() * len(images), torch.tensor(len(images), device=self.device,
                                                                             dtype=torch.float64)])
        total = distributed.all_reduce_sum(total)
        if prefix == "val" and self.dist.is_main:
            self.picture(model)
        model.train()
        return {f"{prefix}/loss": float(total[0] / total[1])}

    def picture(self, model: MaskedAutoencoder) -> None:
        images = probe_batch(self.data.val.dataset, self.settings.images)
        if images is None:
            return
        images = images.to(self.device)
        noise = torch.rand(len(images), model.grid[0] * model.grid[1],
                           generator=self.masks(1)).to(self.device)
        _, prediction, mask = model(images, noise)
        scale = max(1, 64 // images.shape[-1])
        self.record.log_image("reconstructions", reconstruction_grid(model, images, mask, prediction, scale),
                              step=self.update, epoch=self.epoch + 1)

    def probe_forward(self) -> Forward:
        """The probe batch masked with fixed noise (no random number drawn)."""
        model = self.module
        generator = self.masks(2)

        def forward(images: torch.Tensor) -> Any:
            noise = torch.rand(len(images), model.grid[0] * model.grid[1], generator=generator)
            return model(images, noise.to(images.device))

        return forward


def run_mae(cfg: Any, record: RunRecord) -> dict[str, Any]:
    views = mae_views(tuple(cfg.task.crop_scale), cfg.task.hflip)
    data = build_classification_data(cfg.data, cfg.seed, train_transform=views)
    model = build_mae(cfg)
    record.update(params=count_params(model), encoder_params=count_params(model.encoder))
    log.info("MAE over %s with norm=%s: %.2fM params (encoder %.2fM), mask ratio %.2f", cfg.backbone.name,
             cfg.norm.name, record.summary["params"] / 1e6, record.summary["encoder_params"] / 1e6,
             cfg.task.mask_ratio)
    trainer = MAETrainer(cfg.trainer, model, data, record, cfg.task, cfg.seed,
                         get_probes(cfg.task.get("probes")))
    return fit_and_record(trainer, record, cfg)


def metric_names(values: dict[str, Any]) -> list[str]:
    return evaluated(values, ["loss"])


def mae_settings(values: dict[str, Any]) -> dict[str, Any]:
    task = values["task"]
    decoder = task["decoder"]
    return {"mask_ratio": task["mask_ratio"], "decoder": f"{decoder['dim']}x{decoder['depth']}",
            "norm_pix_loss": task["norm_pix_loss"]}


# MAE's loss is over the masked patches: some must be masked (and some kept: check_mae)
RANGES = {"mask_ratio": rng(above=0, below=1, type=float), "hflip": rng(0, 1, type=float),
          "images": rng(0, type=int),
          **{f"decoder.{key}": rng(1, type=int) for key in ("dim", "depth", "heads")}}

register_task(Task("mae", run_mae, data=("digits", "imagenet"), metrics=metric_names, check=check_mae,
                   build=build_mae, backbone_weights=encoder_weights,
                   backbone_model=lambda cfg: build_mae(cfg).encoder, settings=mae_settings, ranges=RANGES))
