"""task=dit's caches and shards: the latent cache's identity (shard layout, the VAE's config and weights),
shards of another length or damaged are encoded again, two runs sharing a cache encode each shard once, a full
disk names the shard; damaged sample shards are remade, a damaged reference is one line, and the cached
reference statistics and digits feature net are integrity-checked and made again."""

from __future__ import annotations

import copy
import errno
import threading
import time

import numpy as np
import pytest
import torch
from conftest import flip_a_byte_inside, quick_cfg
from torch.utils.data import Dataset

from normexp.errors import UserError, storage_error
from normexp.metrics.fid import load_reference
from normexp.models.features import DigitsFeatures
from normexp.models.vae import LatentCodec, random_sd_vae
from normexp.tasks import dit_sampling
from normexp.tasks.latent_cache import CachedLatents, cache_folder, encode_dataset, read_shard, shard_sizes


class Images(Dataset):
    """``count`` labelled 16 px images, image i filled with i."""

    def __init__(self, count: int = 7) -> None:
        self.count = count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int):
        return torch.full((3, 16, 16), float(index)), index % 10


class CountingCodec:
    """The moments of a VAE stand-in (a 2x2 mean of each image), counting the images it encodes."""

    def __init__(self, delay: float = 0.0) -> None:
        self.encoded, self.delay, self.lock = [], delay, threading.Lock()

    def moments(self, images: torch.Tensor) -> torch.Tensor:
        time.sleep(self.delay)
        with self.lock:
            self.encoded += images[:, 0, 0, 0].long().tolist()
        return torch.nn.functional.avg_pool2d(images, 8).repeat(1, 3, 1, 1)[:, :8]


def identity(shard: int = 3) -> dict:
    return {"count": 7, "shard": shard, "mirrors": False, "version": 2}


def encode(folder, codec, shard: int = 3):
    return encode_dataset(Images(), codec, folder, identity(shard), 2, torch.device("cpu"))


def test_the_cache_identity_holds_the_shard_layout_and_the_vaes_weights(tmp_path):
    """Another shard size, or another VAE at the same path, is another cache."""
    torch.manual_seed(0)
    vae = random_sd_vae(block_out_channels=(8, 16, 16, 16), norm_num_groups=8)
    cfg = quick_cfg("task=dit", f"task.vae={tmp_path / 'vae'}", f"task.latent_cache={tmp_path / 'cache'}")
    folder, _ = cache_folder(cfg, Images(), LatentCodec(vae))
    assert cache_folder(cfg, Images(), LatentCodec(vae))[0] == folder
    other_shards = copy.deepcopy(cfg)
    other_shards.task.latent_cache_shard = 500
    assert cache_folder(other_shards, Images(), LatentCodec(vae))[0] != folder
    with torch.no_grad():
        next(vae.parameters()).add_(1e-3)
    assert cache_folder(cfg, Images(), LatentCodec(vae))[0] != folder


def test_shards_of_another_length_or_damaged_are_encoded_again(tmp_path):
    paths = encode(tmp_path, CountingCodec())
    sizes = [len(read_shard(p, n)["labels"]) for p, n in zip(paths, shard_sizes(7, 3), strict=True)]
    assert sizes == [3, 3, 1]
    np.savez(paths[0], moments=np.zeros((2, 8, 2, 2), np.float16), labels=np.zeros(2, np.int64))
    flip_a_byte_inside(paths[1])
    codec = CountingCodec()
    assert encode(tmp_path, codec) == paths
    assert codec.encoded == [0, 1, 2, 3, 4, 5]
    latents = CachedLatents(paths, shard_sizes(7, 3), 0.0)
    assert len(latents) == 7 and latents.labels.tolist() == [0, 1, 2, 3, 4, 5, 6]


def test_two_runs_sharing_a_cache_encode_each_shard_once(tmp_path):
    codec, errors = CountingCodec(delay=0.05), []

    def one_run():
        try:
            encode(tmp_path, codec, shard=1)
        except Exception as e:  # noqa: BLE001 -- the test reports it
            errors.append(e)

    runs = [threading.Thread(target=one_run) for _ in range(2)]
    for thread in runs:
        thread.start()
    for thread in runs:
        thread.join()
    assert not errors and sorted(codec.encoded) == list(range(7))
    assert len(CachedLatents(sorted(tmp_path.glob("shard-*.npz")), [1] * 7, 0.0)) == 7


def test_a_full_disk_while_writing_a_shard_names_the_shard(tmp_path, monkeypatch):
    def full_disk(file, **arrays):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(np, "savez", full_disk)
    with pytest.raises(OSError) as error:
        encode(tmp_path, CountingCodec())
    said = str(storage_error(error.value))
    assert f"No space left on device: '{tmp_path / 'shard-00000.npz'}'" in said and "\n" not in said
    assert not list(tmp_path.glob(".shard-*.tmp"))


def test_a_damaged_sample_shard_is_made_again_and_a_damaged_reference_is_one_line(tmp_path):
    shard = tmp_path / "shard-00000.npz"
    np.savez(shard, labels=np.arange(4), features=np.ones((4, 64)), logits=np.ones((4, 10)))
    flip_a_byte_inside(shard)
    assert dit_sampling.read_shard(shard, 4, 64) is None
    reference = tmp_path / "reference.npz"
    np.savez(reference, mu=np.zeros(64), sigma=np.eye(64), resolution=8)
    flip_a_byte_inside(reference)
    with pytest.raises(UserError) as error:
        load_reference(reference, 8, 64)
    assert f"cannot read reference statistics {reference} (BadZipFile: Bad CRC-32" in str(error.value)
    assert "\n" not in str(error.value)


def test_the_cached_reference_statistics_and_digits_net_are_checked_and_made_again(tmp_path, monkeypatch,
                                                                                     caplog):
    monkeypatch.setenv("NORMEXP_CACHE_DIR", str(tmp_path))
    cfg = quick_cfg("task=dit")
    torch.manual_seed(0)
    extractor = DigitsFeatures().eval().requires_grad_(False)
    stats = dit_sampling.reference_statistics(cfg, extractor, torch.device("cpu"))
    (cached,) = tmp_path.glob("digits-*.npz")
    flip_a_byte_inside(cached)
    again = dit_sampling.reference_statistics(cfg, extractor, torch.device("cpu"))
    np.testing.assert_array_equal(again["sigma"], stats["sigma"])
    net = dit_sampling.digits_features(cfg.data, tmp_path, epochs=1)
    (weights,) = tmp_path.glob("digits-*.pt")
    flip_a_byte_inside(weights)
    retrained = dit_sampling.digits_features(cfg.data, tmp_path, epochs=1)
    for name, tensor in net.state_dict().items():
        assert torch.equal(retrained.state_dict()[name], tensor), name
    assert sum("is damaged" in r.getMessage() for r in caplog.records) == 2
