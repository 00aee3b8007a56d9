"""The latent cache of task=dit (``task.latent_cache=<dir>``): the training images encoded by the VAE once (as
the fast-DiT fork's ``extract_features.py``), stored as posterior mean and log-variance (of the mirror too)
so training still samples the posterior and flips. Shards are written whole and shared out between
processes; ``<dir>/<key>/manifest.json`` says what a cache holds, and a mismatch is one line."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import OmegaConf
from torch.utils.data import Dataset

from .. import distributed
from ..errors import UserError
from ..models.vae import LatentCodec

log = logging.getLogger(__name__)


def cache_identity(cfg: Any, dataset: Dataset) -> dict[str, Any]:
    """What the cache's latents depend on."""
    samples = getattr(dataset, "samples", None)  # an ImageFolder's (path, label) list
    data = OmegaConf.to_container(cfg.data, resolve=True)
    images = (hashlib.sha256(json.dumps([(str(p), int(c)) for p, c in samples]).encode()).hexdigest()
              if samples is not None else {k: data.get(k) for k in ("name", "val_fraction", "split_seed")})
    return {"images": images, "count": len(dataset), "img_size": cfg.data.img_size, "vae": str(cfg.task.vae),
            "mirrors": cfg.task.hflip > 0, "version": 1}


def cache_folder(cfg: Any, dataset: Dataset) -> tuple[Path, dict[str, Any]]:
    identity = cache_identity(cfg, dataset)
    key = hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return Path(cfg.task.latent_cache).expanduser() / key, identity


def check_manifest(folder: Path, identity: dict[str, Any]) -> None:
    manifest = folder / "manifest.json"
    if not manifest.is_file():
        return
    try:
        found = json.loads(manifest.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"latent cache {folder}: manifest.json is unreadable ({e}): move the folder away to "
                        "encode again") from None
    if found != identity:
        differing = sorted(k for k in set(found) | set(identity) if found.get(k) != identity.get(k))
        raise UserError(f"latent cache {folder} holds other latents (differs in {', '.join(differing)}): "
                        "move it away to encode again")


@torch.no_grad()
def encode_dataset(dataset: Dataset, codec: LatentCodec, folder: Path, identity: dict[str, Any],
                   shard_size: int, batch_size: int, device: torch.device) -> list[Path]:
    """Encode ``dataset`` into shards under ``folder`` (this process's share); every shard's path, in
    order."""
    check_manifest(folder, identity)
    world = distributed.info()
    folder.mkdir(parents=True, exist_ok=True)
    if world.is_main and not (folder / "manifest.json").is_file():
        (folder / "manifest.json").write_text(json.dumps(identity, indent=2, default=str) + "\n")
    count = len(dataset)
    paths = [folder / f"shard-{i:05d}.npz" for i in range(math.ceil(count / shard_size))]
    made = 0
    for index in range(world.rank, len(paths), world.world_size):
        first, last = index * shard_size, min((index + 1) * shard_size, count)
        if read_shard(paths[index]) is not None:
            continue
        for stale in folder.glob(f".{paths[index].name}.*"):  # a killed writer's (this shard is ours alone)
            stale.unlink(missing_ok=True)
        moments, mirrored, labels = [], [], []
        for start in range(first, last, batch_size):
            items = [dataset[i] for i in range(start, min(start + batch_size, last))]
            images = torch.stack([image for image, _ in items]).to(device)
            labels += [int(label) for _, label in items]
            moments.append(codec.moments(images).half().cpu())
            if identity["mirrors"]:
                mirrored.append(codec.moments(images.flip(-1)).half().cpu())
        arrays = {"moments": torch.cat(moments).numpy(), "labels": np.array(labels, dtype=np.int64)}
        if mirrored:
            arrays["mirrored"] = torch.cat(mirrored).numpy()
        temporary = folder / f".{paths[index].name}.{os.getpid()}.npz"
        np.savez(temporary, **arrays)
        temporary.replace(paths[index])
        made += 1
    log.info("latent cache %s: %d of %d shards encoded by process %d", folder, made, len(paths), world.rank)
    distributed.barrier()
    return paths


def read_shard(path: Path) -> dict[str, np.ndarray] | None:
    try:
        with np.load(path, allow_pickle=False) as npz:
            return {k: npz[k] for k in npz.files}
    except (OSError, ValueError, EOFError):
        return None


class CachedLatents(Dataset):
    """(posterior parameters (2C, h, w), label) of the cached images, the mirror's with probability
    ``hflip``."""

    def __init__(self, paths: list[Path], hflip: float) -> None:
        shards = [read_shard(p) for p in paths]
        if any(s is None for s in shards):
            raise UserError(f"latent cache {paths[0].parent}: a shard is unreadable: move the folder away to "
                            "encode again")
        self.moments = torch.from_numpy(np.concatenate([s["moments"] for s in shards]))
        self.mirrored = (torch.from_numpy(np.concatenate([s["mirrored"] for s in shards]))
                         if "mirrored" in shards[0] else None)
        self.labels = torch.from_numpy(np.concatenate([s["labels"] for s in shards]))
        self.hflip = hflip

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        flip = self.mirrored is not None and self.hflip > 0 and torch.rand(()) < self.hflip
        source = self.mirrored if flip else self.moments
        return source[index].float(), self.labels[index]
