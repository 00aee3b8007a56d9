"""Sampling and scoring DiT (``task=dit``), as facebookresearch/DiT ``sample_ddp.py`` does apart from its
``train.py``: seeded, sharded sampling with classifier-free guidance; the reference statistics, computed once
and cached; FID and Inception Score with Inception-v3, or ``fd_digits`` with a small digits classifier."""


from __future__ import annotations

import hashlib
import json
import logging
import math
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import OmegaConf
from PIL import Image
from torch import nn
from torchvision.transforms import v2

from .. import distributed
from ..data.digits import digits_arrays
from ..data.loaders import default_cache_dir
from ..diffusion import GaussianDiffusion, guided
from ..engine.checkpoint import (
    damaged_record,
    save_checkpoint,
)
from ..errors import UserError
from ..metrics.fid import frechet_distance, inception_score, load_reference, statistics
from ..models.features import (
    DigitsFeatures,
    InceptionFeatures,
    as_uint8,
    train_digits_features,
)
from ..models.vae import LatentCodec
from ..tracking.provenance import stream_generator
from ..tracking.records import RunRecord, write_atomic

log = logging.getLogger(__name__)
SAMPLING_SPREAD = (1_000_003, 1_000_033)  # the sampling noise's streams (7: sampling), apart from training's


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
        generator = stream_generator(self.seed, 7, stream, spread=SAMPLING_SPREAD)
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
    from ..data.images import center_crop_arr, image_files, load_rgb

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

    net = train_digits_features(*tensors("train"), epochs)
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


