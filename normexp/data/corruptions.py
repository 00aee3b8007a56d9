"""Corrupted validation images (the ImageNet-C protocol): clean plus each corruption and severity, from a
pre-rendered tree in the official layout or rendered on the fly by imagecorruptions with a per-image seed
(the same pixels everywhere; optionally cached as PNG). Images under 32 px are enlarged by an integer factor
before corrupting and box-averaged back. docs/robustness.md has the details."""

from __future__ import annotations

import bisect
import contextlib
import functools
import hashlib
import inspect
import json
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset
from torchvision.datasets import ImageFolder
from torchvision.datasets.folder import IMG_EXTENSIONS
from torchvision.transforms import InterpolationMode
from torchvision.transforms import functional as TF

from ..errors import UserError
from ..metrics.robustness import GROUP_OF
from .digits import digits_arrays, standardisation
from .imagenet import check_imagefolder_root

MIN_CORRUPTION_SIZE = 32  # imagecorruptions refuses smaller images
PACKAGE = "imagecorruptions-imaug"
LAYOUT = "<root>/<corruption>/<severity>/<class>/*.JPEG (or grouped: <root>/<group>/<corruption>/...)"


def corruption_size(img_size: int) -> int:
    """The size corruptions are rendered at: the evaluation size times the integer that makes it >= 32 px."""
    return img_size * math.ceil(MIN_CORRUPTION_SIZE / img_size)


def package_version() -> str:
    return f"{PACKAGE} {metadata.version(PACKAGE)}"


# ---------------------------------------------------------------- rendering one image
def image_seed(base_seed: int, corruption: str, severity: int, name: str) -> int:
    """A 32-bit seed from a stable hash (Python's hash() changes between processes)."""
    digest = hashlib.sha256(f"{base_seed}|{corruption}|{severity}|{name}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


@contextlib.contextmanager
def numpy_global_seed(seed: int) -> Iterator[None]:
    """Seed numpy's global RNG (the package draws from it); restored after, so callers are unaffected."""
    state = np.random.get_state()
    np.random.seed(seed)
    try:
        yield
    finally:
        np.random.set_state(state)


@functools.cache
def corruption_package() -> Any:
    """imagecorruptions (imported on first use), with OpenCV single-threaded: a thread pool inherited by
    forked loader workers deadlocks them."""
    import cv2
    import imagecorruptions

    cv2.setNumThreads(1)
    return imagecorruptions


@functools.cache
def _takes_seed(corruption: str) -> bool:
    # glass_blur (numba's own RNG) and impulse_noise (skimage's Generator) ignore np.random: they take `seed=`
    function = corruption_package().corruption_dict[corruption]
    return "seed" in inspect.signature(function).parameters


def corrupt_image(pixels: np.ndarray, corruption: str, severity: int, seed: int) -> np.ndarray:
    """``corruption`` at ``severity`` (1-5) of a uint8 RGB HxWx3 image (>= 32 px); same seed, same pixels."""
    kwargs = {"seed": seed} if _takes_seed(corruption) else {}
    # errstate: spatter (an extra) divides 0/0 on small images without droplets; numpy casts the NaNs to 0.
    with numpy_global_seed(seed), np.errstate(divide="ignore", invalid="ignore"):
        return corruption_package().corrupt(pixels, severity=severity, corruption_name=corruption, **kwargs)


def enlarge(pixels: np.ndarray, factor: int) -> np.ndarray:
    return pixels if factor == 1 else pixels.repeat(factor, axis=0).repeat(factor, axis=1)


class ModelInput:
    """uint8 RGB HxWx3 at the evaluation size (or an integer multiple of it) -> the classifier's input."""

    def __init__(self, img_size: int, mean: Sequence[float], std: Sequence[float]) -> None:
        self.img_size = img_size
        self.mean = torch.tensor(mean, dtype=torch.float32)[:, None, None]
        self.std = torch.tensor(std, dtype=torch.float32)[:, None, None]

    def __call__(self, pixels: np.ndarray) -> torch.Tensor:
        height, width = pixels.shape[:2]
        factor = height // self.img_size
        if factor < 1 or height != width or height != factor * self.img_size:
            raise ValueError(f"image of {height}x{width} px for a {self.img_size} px model")
        x = pixels.astype(np.float32)
        if factor > 1:  # box average of integer values: exact, so clean images come back unchanged
            x = x.reshape(self.img_size, factor, self.img_size, factor, 3).mean(axis=(1, 3))
        x = torch.from_numpy(np.ascontiguousarray(x)).permute(2, 0, 1) / 255
        return (x - self.mean) / self.std


def read_rgb(path: str | Path) -> Image.Image:
    with Image.open(path) as image:
        return image.convert("RGB")


def write_png_atomic(path: Path, pixels: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # workers never share an image, but be safe
    Image.fromarray(pixels).save(tmp, format="PNG")
    os.replace(tmp, path)


# ---------------------------------------------------------------- image datasets (uint8 pixels, label)
class ArrayImages(Dataset):
    def __init__(self, pixels: np.ndarray, labels: Sequence[int]) -> None:
        self.pixels, self.labels = pixels, list(labels)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        return self.pixels[i], self.labels[i]


class FileImages(Dataset):
    """Image files, short side resized to ``resize`` when it differs, then centre-cropped to ``crop``."""

    def __init__(self, samples: Sequence[tuple[str | Path, int]], crop: int, resize: int | None = None,
                 interpolation: str = "bilinear") -> None:
        self.samples, self.crop, self.resize = list(samples), crop, resize
        self.interpolation = InterpolationMode(interpolation)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        path, label = self.samples[i]
        image = read_rgb(path)
        if self.resize and min(image.size) != self.resize:
            image = TF.resize(image, self.resize, interpolation=self.interpolation)
        return np.asarray(TF.center_crop(image, self.crop)), label


@dataclass
class CleanImages:
    """The validation images as corruptions take them, and what they are."""

    images: Dataset        # i -> (uint8 RGB at the evaluation size, label)
    labels: list[int]
    names: list[str]       # "<class>/<image>": each image's stable identity (its seed, its cache file)
    identity: dict[str, Any]  # everything that decides the pixels: names the cache


class CorruptedImages(Dataset):
    """One corruption at one severity of the clean images, rendered on demand, optionally cached."""

    def __init__(self, clean: CleanImages, corruption: str, severity: int, base_seed: int, factor: int,
                 cache_root: Path | None = None) -> None:
        self.clean, self.corruption, self.severity = clean, corruption, severity
        self.base_seed, self.factor, self.cache_root = base_seed, factor, cache_root

    def __len__(self) -> int:
        return len(self.clean.labels)

    def cache_path(self, i: int) -> Path | None:
        if self.cache_root is None:
            return None
        return self.cache_root / self.corruption / str(self.severity) / f"{self.clean.names[i]}.png"

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        path = self.cache_path(i)
        if path is not None and path.is_file():
            return np.asarray(read_rgb(path)), self.clean.labels[i]
        pixels, label = self.clean.images[i]
        seed = image_seed(self.base_seed, self.corruption, self.severity, self.clean.names[i])
        corrupted = corrupt_image(enlarge(pixels, self.factor), self.corruption, self.severity, seed)
        if path is not None:
            write_png_atomic(path, corrupted)
        return corrupted, label


# ---------------------------------------------------------------- the clean images of each dataset
@dataclass
class CorruptionSource:
    model_input: ModelInput
    clean: CleanImages | None  # None: no validation images configured (pre-rendered trees only)


def digits_source(cfg: Any) -> CorruptionSource:
    arrays = digits_arrays(cfg.img_size, cfg.val_fraction, cfg.split_seed)
    mean, std = standardisation(arrays)
    gray = np.round(arrays["val_images"] * 255).astype(np.uint8)
    labels = [int(y) for y in arrays["val_labels"]]
    names = [f"{y}/{i:04d}" for y, i in zip(labels, arrays["val_ids"], strict=True)]
    identity = {"data": "digits", "img_size": cfg.img_size, "val_fraction": cfg.val_fraction,
                "split_seed": cfg.split_seed}
    return CorruptionSource(
        ModelInput(cfg.img_size, (mean,) * 3, (std,) * 3),
        CleanImages(ArrayImages(np.repeat(gray[..., None], 3, axis=3), labels), labels, names, identity),
    )


def imagenet_source(cfg: Any) -> CorruptionSource:
    model_input = ModelInput(cfg.img_size, tuple(cfg.mean), tuple(cfg.std))
    if not cfg.root:
        return CorruptionSource(model_input, None)
    check_imagefolder_root(cfg.root, (cfg.val_split,), cfg.num_classes)
    val = ImageFolder(Path(cfg.root) / cfg.val_split)
    # make_imagenet_c.py: resize 256, centre crop 224, corrupt -- the clean evaluation's own resize/crop
    resize = math.floor(cfg.img_size / cfg.crop_pct)
    images = FileImages(val.samples, crop=cfg.img_size, resize=resize, interpolation=cfg.interpolation)
    names = [str(Path(p).relative_to(val.root).with_suffix("")) for p, _ in val.samples]
    identity = {"data": "imagenet", "root": str(Path(cfg.root).resolve()), "val_split": cfg.val_split,
                "img_size": cfg.img_size, "resize": resize, "interpolation": cfg.interpolation}
    return CorruptionSource(model_input, CleanImages(images, list(val.targets), names, identity))


CORRUPTION_SOURCES = {"digits": digits_source, "imagenet": imagenet_source}


def build_corruption_source(cfg: Any) -> CorruptionSource:
    try:
        builder = CORRUPTION_SOURCES[cfg.name]
    except KeyError:
        raise UserError(f"data '{cfg.name}' has no corruption source; available: "
                        f"{', '.join(CORRUPTION_SOURCES)}") from None
    return builder(cfg)


# ---------------------------------------------------------------- pre-rendered trees (ImageNet-C)
def _image_files(folder: Path) -> list[Path]:
    return sorted(Path(e.path) for e in os.scandir(folder)
                  if e.is_file() and e.name.lower().endswith(IMG_EXTENSIONS))


def read_corruption_tree(root: str | Path, corruptions: Sequence[str], severities: Sequence[int],
                         num_classes: int) -> dict[tuple[str, int], list[tuple[Path, int]]]:
    """Every image of each (corruption, severity) with its label; fails with one line on the first missing
    condition, empty class folder, or class set or image count that differs between conditions."""
    root = Path(root)
    if not root.is_dir():
        raise UserError(f"data.imagenet_c_root '{root}' does not exist: expected layout {LAYOUT}")
    tree: dict[tuple[str, int], list[tuple[Path, int]]] = {}
    first: tuple[Path, list[str], int] | None = None
    for corruption in corruptions:
        candidates = (root / corruption, root / GROUP_OF[corruption] / corruption)
        folder = next((c for c in candidates if c.is_dir()), None)
        if folder is None:
            raise UserError(f"ImageNet-C tree '{root}' has no corruption '{corruption}' (looked for "
                            f"{' and '.join(str(c) for c in candidates)}): expected layout {LAYOUT}")
        for severity in severities:
            condition = folder / str(severity)
            if not condition.is_dir():
                raise UserError(f"ImageNet-C tree '{root}' is missing {corruption} severity {severity} "
                                f"('{condition}' does not exist): expected layout {LAYOUT}")
            classes = sorted(d.name for d in os.scandir(condition) if d.is_dir())
            samples = []
            for label, name in enumerate(classes):
                files = _image_files(condition / name)
                if not files:
                    raise UserError(f"ImageNet-C class folder '{condition / name}' holds no images "
                                    f"({corruption} severity {severity} is incomplete)")
                samples.extend((f, label) for f in files)
            if first is None:
                if len(classes) != num_classes:
                    raise UserError(f"'{condition}' has {len(classes)} class folders but data.num_classes="
                                    f"{num_classes}: expected layout {LAYOUT}")
                first = (condition, classes, len(samples))
            elif classes != first[1]:
                raise UserError(f"'{condition}' and '{first[0]}' have different class folders "
                                f"({corruption} severity {severity} is incomplete or from another dataset)")
            elif len(samples) != first[2]:
                raise UserError(f"'{condition}' holds {len(samples)} images but '{first[0]}' holds "
                                f"{first[2]} ({corruption} severity {severity} is incomplete)")
            tree[corruption, severity] = samples
    return tree


# ---------------------------------------------------------------- one dataset for the whole evaluation
@dataclass(frozen=True)
class Condition:
    corruption: str | None  # None: clean
    severity: int = 0


class CorruptionSuite(Dataset):
    """All conditions back to back, item -> (model input, label, condition index), for one loader."""

    def __init__(self, conditions: Sequence[Condition], datasets: Sequence[Dataset],
                 model_input: ModelInput, description: str) -> None:
        self.conditions, self.datasets = list(conditions), list(datasets)
        self.model_input, self.description = model_input, description
        self.ends = np.cumsum([len(d) for d in self.datasets]).tolist()

    def __len__(self) -> int:
        return self.ends[-1] if self.ends else 0

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int, int]:
        k = bisect.bisect_right(self.ends, i)
        pixels, label = self.datasets[k][i - (self.ends[k - 1] if k else 0)]
        return self.model_input(pixels), label, k


def cache_root_for(cache_dir: str | Path, clean: CleanImages, size: int, base_seed: int) -> Path:
    """``<cache_dir>/<data>-<size>px-<hash>``: one tree per set of pixels (images, size, seed, package)."""
    identity = {**clean.identity, "corruption_size": size, "seed": base_seed, "package": package_version()}
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:10]
    root = Path(cache_dir) / f"{clean.identity['data']}-{size}px-{digest}"
    root.mkdir(parents=True, exist_ok=True)
    (root / "source.json").write_text(json.dumps(identity, indent=2) + "\n")
    return root


def build_corruption_suite(data_cfg: Any, corruptions: Sequence[str], severities: Sequence[int],
                           base_seed: int, cache_dir: str | Path | None) -> CorruptionSuite:
    """Clean (when validation images are configured) + every corruption x severity of ``data_cfg``."""
    source = build_corruption_source(data_cfg)
    clean = source.clean
    conditions = [Condition(c, s) for c in corruptions for s in severities]
    size = corruption_size(data_cfg.img_size)
    tree_root = data_cfg.get("imagenet_c_root")
    if tree_root:
        tree = read_corruption_tree(tree_root, corruptions, severities, data_cfg.num_classes)
        datasets = [FileImages(tree[c.corruption, c.severity], crop=size, resize=size) for c in conditions]
        description = f"pre-rendered tree {tree_root}"
    elif clean is None:
        raise UserError(f"data={data_cfg.name} needs data.root (validation images, corrupted on the fly) or "
                        f"data.imagenet_c_root (a pre-rendered tree: {LAYOUT})")
    else:
        corruption_package()  # imported once here, not in every loader worker
        cache_root = cache_root_for(cache_dir, clean, size, base_seed) if cache_dir else None
        factor = size // data_cfg.img_size
        datasets = [CorruptedImages(clean, c.corruption, c.severity, base_seed, factor, cache_root)
                    for c in conditions]
        description = (f"on the fly at {size} px ({package_version()}, seed {base_seed}"
                       + (f", cache {cache_root})" if cache_root else ", no cache)"))
    if clean is not None:
        conditions, datasets = [Condition(None), *conditions], [clean.images, *datasets]
    return CorruptionSuite(conditions, datasets, source.model_input, description)
