"""The latent cache of task=dit (``task.latent_cache=<dir>``): the training images encoded by the VAE once (as
the fast-DiT fork's ``extract_features.py``), stored as posterior mean and log-variance (of the mirror too)
so training still samples the posterior and flips. Shards are written whole and shared out between
processes and between runs (a lock per shard: each is encoded once); ``<dir>/<key>/manifest.json`` says what
a cache holds, and a mismatch is one line."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import OmegaConf
from torch.utils.data import Dataset

from .. import distributed
from ..errors import UserError
from ..models.vae import LatentCodec
from ..tracking.records import write_atomic, write_json_atomic

log = logging.getLogger(__name__)


IDENTITY_VERSION = 2  # 2: the shard size and the VAE's config and weights (1: the VAE's path)


def cache_identity(cfg: Any, dataset: Dataset, codec: LatentCodec) -> dict[str, Any]:
    """What the cache's latents depend on: the images, their size and order, the shard layout, and the VAE
    by its config and weights (not its path: another VAE saved there is another cache)."""
    samples = getattr(dataset, "samples", None)  # an ImageFolder's (path, label) list
    data = OmegaConf.to_container(cfg.data, resolve=True)
    images = (hashlib.sha256(json.dumps([(str(p), int(c)) for p, c in samples]).encode()).hexdigest()
              if samples is not None else {k: data.get(k) for k in ("name", "val_fraction", "split_seed")})
    config = {k: v for k, v in dict(codec.vae.config).items() if not k.startswith("_")}  # no path, version
    vae = {"config": config, "weights": weights_digest(codec)}
    identity = {"images": images, "count": len(dataset), "img_size": cfg.data.img_size,
                "shard": cfg.task.latent_cache_shard, "vae": vae,
                "mirrors": cfg.task.hflip > 0, "version": IDENTITY_VERSION}
    return json.loads(json.dumps(identity, default=str))  # as manifest.json reads back (tuples as lists)


def weights_digest(module: torch.nn.Module) -> str:
    """SHA-256 of ``module``'s state (names, dtypes, shapes and bytes, in order)."""
    digest = hashlib.sha256()
    for name, tensor in module.state_dict().items():
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def cache_folder(cfg: Any, dataset: Dataset, codec: LatentCodec) -> tuple[Path, dict[str, Any]]:
    identity = cache_identity(cfg, dataset, codec)
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


def shard_sizes(count: int, shard_size: int) -> list[int]:
    """The number of images in each shard of ``count`` images."""
    return [min(shard_size, count - start) for start in range(0, count, shard_size)]


@contextlib.contextmanager
def shard_lock(path: Path, wait: bool) -> Iterator[bool]:
    """Hold the lock of the shard ``path`` (``flock`` on ``.<stem>.lock``, shared by every process on this
    file system): True once held, False when another holds it and ``wait`` is false."""
    with open(path.with_name(f".{path.stem}.lock"), "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@torch.no_grad()
def encode_dataset(dataset: Dataset, codec: LatentCodec, folder: Path, identity: dict[str, Any],
                   batch_size: int, device: torch.device) -> list[Path]:
    """Encode ``dataset`` into shards under ``folder`` (this process's share); every shard's path, in
    order. Each shard is encoded under its lock, once: runs sharing the cache encode the shards no other
    holds first, then wait for the others' and read them."""
    check_manifest(folder, identity)
    world = distributed.info()
    folder.mkdir(parents=True, exist_ok=True)
    if world.is_main and not (folder / "manifest.json").is_file():
        write_json_atomic(folder / "manifest.json", identity)
    sizes = shard_sizes(len(dataset), identity["shard"])
    paths = [folder / f"shard-{i:05d}.npz" for i in range(len(sizes))]
    mine = [i for i in range(world.rank, len(paths), world.world_size)
            if read_shard(paths[i], sizes[i]) is None]
    made = 0
    for wait in (False, True):  # first the shards no other run encodes, then the rest as they finish
        busy = []
        for index in mine:
            with shard_lock(paths[index], wait) as held:
                if not held:
                    busy.append(index)
                elif read_shard(paths[index], sizes[index]) is None:
                    encode_shard(dataset, codec, paths[index], index * identity["shard"], sizes[index],
                                 identity["mirrors"], batch_size, device)
                    made += 1
        mine = busy
    log.info("latent cache %s: %d of %d shards encoded by process %d", folder, made, len(paths), world.rank)
    distributed.barrier()
    return paths


def encode_shard(dataset: Dataset, codec: LatentCodec, path: Path, first: int, size: int, mirrors: bool,
                 batch_size: int, device: torch.device) -> None:
    """Encode images ``first .. first + size`` into the shard ``path`` (only while holding its lock)."""
    for stale in path.parent.glob(f".{path.name}.*"):  # a killed writer's
        stale.unlink(missing_ok=True)
    moments, mirrored, labels = [], [], []
    for start in range(first, first + size, batch_size):
        items = [dataset[i] for i in range(start, min(start + batch_size, first + size))]
        images = torch.stack([image for image, _ in items]).to(device)
        labels += [int(label) for _, label in items]
        moments.append(codec.moments(images).half().cpu())
        if mirrors:
            mirrored.append(codec.moments(images.flip(-1)).half().cpu())
    arrays = {"moments": torch.cat(moments).numpy(), "labels": np.array(labels, dtype=np.int64)}
    if mirrored:
        arrays["mirrored"] = torch.cat(mirrored).numpy()
    write_atomic(path, lambda f: np.savez(f, **arrays))


def read_shard(path: Path, size: int) -> dict[str, np.ndarray] | None:
    """The shard's arrays, or None when it is missing, damaged or not of ``size`` images."""
    try:
        with np.load(path, allow_pickle=False) as npz:
            shard = {k: npz[k] for k in npz.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile):
        return None
    whole = "moments" in shard and "labels" in shard and all(len(a) == size for a in shard.values())
    return shard if whole else None


class CachedLatents(Dataset):
    """(posterior parameters (2C, h, w), label) of the cached images, the mirror's with probability
    ``hflip``."""

    def __init__(self, paths: list[Path], sizes: list[int], hflip: float) -> None:
        shards = [read_shard(p, size) for p, size in zip(paths, sizes, strict=True)]
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
