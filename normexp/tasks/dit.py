"""Class-conditional diffusion with DiT (``task=dit``; Peebles & Xie 2023, arXiv 2212.09748;
facebookresearch/DiT ``train.py``, ``sample_ddp.py``): train the ``dit_*`` backbone to denoise (ADM's
preprocessing, optionally on SD-VAE latents, ``task.latent_cache`` to encode once), then sample it in seeded
shards with classifier-free guidance and score the samples (FID with Inception-v3, or ``fd_digits``) against
``task.fid.reference`` or the training split. docs/generation.md has the details.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import itertools
import json
import logging
import math
import zipfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf, open_dict
from PIL import Image
from torch import nn
from torchvision.transforms import v2

from .. import distributed
from ..data import ImageSpec, build_classification_data
from ..data.digits import digits_arrays
from ..data.loaders import default_cache_dir, make_loader, set_epoch
from ..diffusion import GaussianDiffusion, guided, spaced_steps
from ..engine.checkpoint import (
    checkpoint_run_config,
    damaged_record,
    load_checkpoint,
    load_model_state,
    reported_weights,
    save_checkpoint,
)
from ..engine.precision import resolve_device
from ..engine.probes import Forward, Probe, get_probes
from ..engine.trainer import Trainer
from ..errors import UserError
from ..metrics.fid import frechet_distance, inception_score, load_reference, statistics
from ..models import build_backbone, check_buildable
from ..models.features import (
    DigitsFeatures,
    InceptionFeatures,
    as_uint8,
    check_inception_weights,
)
from ..models.stats import count_params
from ..models.vae import CHANNELS, DOWNSAMPLE, LatentCodec, check_vae
from ..tracking.records import RunRecord, write_atomic
from . import ModelInput, Task, evaluated, register_task
from .latent_cache import CachedLatents, cache_folder, encode_dataset, shard_sizes

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
            trained = checkpoint_run_config(cfg.task.checkpoint)
            if trained is None or trained.get("task", {}).get("name") != "dit":
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
    """Before any work: sizes, sampling spacing, the weights the run reads, and a buildable model."""
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
    prepared = with_model_input(cfg)
    check_buildable(prepared.backbone, prepared.norm)


ADM_BATCHES = "https://openaipublic.blob.core.windows.net/diffusion/jul-2021/ref_batches/imagenet"


def reference_source(cfg: Any) -> str | None:
    """``task.fid.reference``: a path, None (the training split), or ``adm``: ADM's reference batch of
    ImageNet at ``data.img_size`` (openai/guided-diffusion ``evaluations/README.md``; DiT and DyT score
    against it) in the reference cache (``$NORMEXP_CACHE_DIR``, else ``outputs/fid_reference``)."""
    reference = cfg.task.fid.reference
    if reference != "adm":
        return reference
    size = cfg.data.img_size
    name = f"VIRTUAL_imagenet{size}_labeled.npz"
    if feature_kind(cfg) != "inception":
        raise UserError(f"task.fid.reference=adm is ADM's ImageNet batch {name}, scored with Inception "
                        "features: use it with task.fid.features=inception, or give a reference of your data")
    path = default_cache_dir("fid_reference") / name
    if not path.is_file():
        raise UserError(f"FID is scored against ADM's reference batch {name}, and {path} does not exist: "
                        f"download it from {ADM_BATCHES}/{size}/{name} (openai/guided-diffusion "
                        f"evaluations/README.md) to that path or pass task.fid.reference=<its path> "
                        "(task.fid.reference=null: the training split's statistics instead)")
    return str(path)


def feature_kind(cfg: Any) -> str:
    kind = cfg.task.fid.features
    if kind == "auto":
        return "digits" if cfg.data.name == "digits" else "inception"
    if kind not in ("digits", "inception"):
        raise UserError(f"task.fid.features={kind}: use auto, inception or digits")
    if kind == "digits" and cfg.data.name != "digits":
        raise UserError("task.fid.features=digits scores digits only: use inception for data="
                        f"{cfg.data.name}")
    return kind


# ---------------------------------------------------------------- data
def center_crop_arr(image: Image.Image, size: int) -> Image.Image:
    """ADM's centre crop (guided-diffusion ``image_datasets.py``, DiT's ``center_crop_arr``)."""
    while min(*image.size) >= 2 * size:
        image = image.resize(tuple(x // 2 for x in image.size), resample=Image.BOX)
    scale = size / min(*image.size)
    image = image.resize(tuple(round(x * scale) for x in image.size), resample=Image.BICUBIC)
    array = np.asarray(image)
    top, left = (array.shape[0] - size) // 2, (array.shape[1] - size) // 2
    return Image.fromarray(array[top: top + size, left: left + size])


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
        return torch.Generator().manual_seed((self.seed * 1_000_003 + stream) * 1_009 + rank)

    def evaluate(self, model: nn.Module, prefix: str) -> dict[str, float]:
        loss = self.diffusion_loss(model, self.data.val, self.generator(0))
        return {f"{prefix}/loss": loss["loss"]}

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
class Sampler:
    """Class-balanced samples of a trained model in seeded shards, with their features."""

    def __init__(self, model: nn.Module, settings: Any, num_classes: int, shape: tuple[int, int, int],
                 codec: LatentCodec | None, device: torch.device, seed: int) -> None:
        self.model, self.settings, self.num_classes, self.shape = model.eval(), settings, num_classes, shape
        self.codec, self.device, self.seed = codec, device, seed
        self.diffusion = GaussianDiffusion.create(settings.diffusion_steps, settings.sampling_steps,
                                                  learn_sigma=model.learn_sigma,
                                                  sigma_small=settings.sigma_small)
        self.forward = guided(self.model, settings.guidance, null_label=num_classes, channels=shape[0])

    @torch.no_grad()
    def images(self, labels: torch.Tensor, stream: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed((self.seed * 1_000_003 + 7) * 1_000_033 + stream)
        noise = torch.randn((len(labels), *self.shape), generator=generator).to(self.device)
        # the predicted x0 clipped to the pixels' range (ADM's pixel models); latents unclipped (DiT's)
        x = self.diffusion.p_sample_loop(self.forward, noise, generator, clip_denoised=self.codec is None,
                                         y=labels.to(self.device))
        if self.codec is not None:
            x = self.codec.decode(x)
        return as_uint8(x).cpu()

    def grid(self, classes: int, per_class: int) -> Image.Image:
        chosen = torch.linspace(0, self.num_classes - 1, min(classes, self.num_classes)).round().long()
        images = self.images(chosen.repeat_interleave(per_class), stream=-1)
        c, h, w = images.shape[1:]
        rows = images.view(len(chosen), per_class, c, h, w).permute(0, 3, 1, 4, 2).reshape(len(chosen) * h,
                                                                                             per_class * w, c)
        picture = Image.fromarray(rows.numpy())
        scale = max(1, 64 // h)
        return picture.resize((picture.width * scale, picture.height * scale), Image.NEAREST)


def shard_labels(index: int, size: int, total: int, num_classes: int) -> torch.Tensor:
    """The labels of shard ``index``: sample i is of class i mod classes (class-balanced)."""
    return torch.arange(index * size, min((index + 1) * size, total)) % num_classes


def read_shard(path: Path, count: int, dims: int) -> dict[str, np.ndarray] | None:
    """A finished shard's arrays, or None when it is missing, damaged or not whole."""
    try:
        with np.load(path, allow_pickle=False) as npz:
            shard = {k: npz[k] for k in npz.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile):
        return None
    features = shard.get("features")
    return shard if features is not None and features.shape == (count, dims) else None


def generate_shards(sampler: Sampler, extractor: nn.Module, folder: Path, settings: Any) -> list[Path]:
    """Every shard of ``settings.samples`` (this process's share made here; finished ones kept), in order."""
    total, size = settings.samples, settings.batch_size
    shards = math.ceil(total / size)
    world = distributed.info()
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / f"shard-{i:05d}.npz" for i in range(shards)]
    made = 0
    for index in range(world.rank, shards, world.world_size):
        for stale in folder.glob(f".{paths[index].name}.*"):  # a killed writer's (this shard is ours alone)
            stale.unlink(missing_ok=True)
        labels = shard_labels(index, size, total, sampler.num_classes)
        if read_shard(paths[index], len(labels), extractor.dims) is not None:
            continue
        images = sampler.images(labels, stream=index)
        scored = extractor(images.to(sampler.device))
        arrays = {"labels": labels.numpy(), "features": scored["features"].cpu().numpy(),
                  "logits": scored["logits"].cpu().numpy()}
        if settings.save_samples:
            arrays["samples"] = images.permute(0, 2, 3, 1).numpy()
        # whole or absent: a kill leaves no half shard; a full disk names it
        write_atomic(paths[index], lambda f, arrays=arrays: np.savez(f, **arrays))
        made += 1
    log.info("sampling: %d of %d shards made by process %d (%d kept from before)", made, shards, world.rank,
             len(range(world.rank, shards, world.world_size)) - made)
    distributed.barrier()
    return paths


def reference_statistics(cfg: Any, extractor: nn.Module, device: torch.device) -> dict[str, np.ndarray]:
    """``task.fid.reference``: ADM's ``.npz`` or an ImageFolder's (cached); default: the training split."""
    size = cfg.data.img_size
    source = reference_source(cfg)
    if source and Path(source).is_file():
        return load_reference(source, size, extractor.dims)
    if source:
        root, name = Path(source), "folder"
    elif cfg.data.name == "digits":
        root, name = None, "digits"
    else:
        root, name = Path(cfg.data.root) / cfg.data.train_split, "imagenet"
    what = str(root.resolve()) if root else OmegaConf.to_container(cfg.data)
    identity = {"images": what, "size": size, "features": type(extractor).__name__, "version": 1}
    key = hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:16]
    cached = default_cache_dir("fid_reference") / f"{name}-{size}-{key}.npz"
    if cached.is_file():
        damage = damaged_record(cached)
        if damage is None:
            return load_reference(cached, size, extractor.dims)
        log.warning("computing the reference statistics again: the cached %s is damaged (%s)", cached, damage)
    features = []
    for images in reference_images(cfg, root):
        features.append(extractor(images.to(device))["features"].cpu().numpy())
    stats = statistics(np.concatenate(features))
    cached.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(cached, lambda f: np.savez(f, mu=stats["mu"], sigma=stats["sigma"], resolution=size))
    log.info("reference statistics of %s cached in %s", root or "the digits' training split", cached)
    return stats


def reference_images(cfg: Any, root: Path | None, batch: int = 256) -> Any:
    if root is None:
        arrays = digits_arrays(cfg.data.img_size, cfg.data.val_fraction, cfg.data.split_seed)
        images = torch.from_numpy(arrays["train_images"])[:, None].expand(-1, 3, -1, -1) * 2 - 1
        yield from as_uint8(images).split(batch)
        return
    from ..data.images import image_files, load_rgb

    files = image_files(root, set())
    if not files:
        raise UserError(f"no images under {root} to compute reference statistics from")
    for start in range(0, len(files), batch):
        crops = [v2.functional.pil_to_tensor(center_crop_arr(load_rgb(f), cfg.data.img_size))
                 for f in files[start: start + batch]]
        yield torch.stack(crops)


def digits_features(data_cfg: Any, cache_root: Path, epochs: int = 12) -> DigitsFeatures:
    """The digits classifier for ``data_cfg``'s images, trained once and cached under ``cache_root``."""
    settings = {"img_size": data_cfg.img_size, "val_fraction": data_cfg.val_fraction,
                "split_seed": data_cfg.split_seed, "epochs": epochs, "version": 1}
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]
    path = cache_root / f"digits-{key}.pt"
    net = DigitsFeatures()
    if path.is_file():  # checked as a checkpoint is (torch.load reads a flipped byte without a word)
        damage = damaged_record(path)
        try:
            if damage is None:
                net.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
                return net.eval()
        except Exception as e:  # truncated, not a state of this net: ours to make again
            damage = f"{type(e).__name__}: {str(e).strip()[:200]}"
        log.warning("retraining the digits feature net: the cached %s is damaged (%s)", path, damage)
    arrays = digits_arrays(data_cfg.img_size, data_cfg.val_fraction, data_cfg.split_seed)

    def tensors(split: str) -> tuple[torch.Tensor, torch.Tensor]:
        images = as_uint8(torch.from_numpy(arrays[f"{split}_images"])[:, None].expand(-1, 3, -1, -1) * 2 - 1)
        return images, torch.from_numpy(arrays[f"{split}_labels"]).long()

    images, labels = tensors("train")
    generator = torch.Generator().manual_seed(0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        net = DigitsFeatures()
        optimizer = torch.optim.Adam(net.parameters(), lr=2e-3)
        for _ in range(epochs):
            for batch in torch.randperm(len(images), generator=generator).split(64):
                loss = F.cross_entropy(net(images[batch])["logits"].float(), labels[batch])
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
    net.eval()
    val_images, val_labels = tensors("val")
    with torch.no_grad():
        accuracy = (net(val_images)["logits"].argmax(1) == val_labels).float().mean().item()
    log.info("trained the digits feature net for fd_digits (val top-1 %.1f %%), cached in %s", 100 * accuracy,
             path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_checkpoint(path, net.state_dict())
    return net


def sample_and_score(cfg: Any, model: nn.Module, codec: LatentCodec | None, record: RunRecord,
                     device: torch.device, step: int = 0, epoch: int = 0) -> dict[str, float]:
    """Sample the model (shards under the run's ``samples/``), score and picture the samples."""
    settings = cfg.task
    kind = feature_kind(cfg)
    extractor = digits_features(cfg.data, default_cache_dir("feature_nets")) if kind == "digits" \
        else InceptionFeatures(settings.fid.inception_weights)
    extractor = extractor.to(device).eval().requires_grad_(False)
    shape = (model.in_chans, model.grid[0] * model.patch, model.grid[1] * model.patch)
    sampler = Sampler(model, settings, cfg.data.num_classes, shape, codec, device, cfg.seed)
    paths = generate_shards(sampler, extractor, record.dir / "shards", settings.fid)
    metrics: dict[str, float] = {}
    if distributed.info().is_main:
        shards = [dict(np.load(p, allow_pickle=False)) for p in paths]
        features = np.concatenate([s["features"] for s in shards])
        logits = np.concatenate([s["logits"] for s in shards])
        labels = np.concatenate([s["labels"] for s in shards])
        metrics[extractor.distance] = frechet_distance(statistics(features),
                                                       reference_statistics(cfg, extractor, device))
        if kind == "inception":
            metrics["is"], _ = inception_score(logits)
        else:  # does each sample look like its class to the digits classifier?
            metrics["class_top1"] = 100.0 * float((logits.argmax(1) == labels).mean())
        if settings.fid.save_samples:
            samples = np.concatenate([s["samples"] for s in shards])
            write_atomic(record.dir / "samples.npz", lambda f: np.savez(f, arr_0=samples))
        record.log_image("samples", sampler.grid(settings.grid_classes, settings.grid_per_class), step=step,
                         epoch=epoch)
    return distributed.broadcast_object(metrics)


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
    metrics = trainer.fit()
    if cfg.task.eval_train_loss:
        trainer.evaluate_fitting()
    weights = trainer.ema.module if trainer.ema is not None and cfg.trainer.ema.reported else trainer.module
    prefix = "ema/val" if weights is not trainer.module else "val"
    scores = sample_and_score(cfg, weights, trainer.codec, record, trainer.device, trainer.update,
                              trainer.epoch)
    metrics["final"].update({f"{prefix}/{k}": v for k, v in scores.items()})
    metrics["reported"].update(scores)
    record.update(metrics=metrics, images_per_s=round(trainer.images_per_s, 2))
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
                   backbone_kind="diffusion", backbone_weights=reported_weights, model_input=noised_input))
