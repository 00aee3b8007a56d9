"""Image files as real data sets hold them: :func:`load_rgb` scales 16-bit grayscale instead of clipping it,
:class:`BadImages` is ``data.on_bad_image`` (``skip`` counts unreadable files across workers, ``fail`` stops
with one line), and :func:`class_folders` / :func:`image_files` follow symbolic links as torchvision does,
but list each folder once (a link loop is skipped with a warning)."""

from __future__ import annotations

import logging
import multiprocessing
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
from PIL import Image
from torchvision.datasets.folder import IMG_EXTENSIONS

from .. import distributed
from ..errors import UserError

log = logging.getLogger(__name__)

# what Pillow raises for a file that is not a readable image (DecompressionBombError is no OSError)
UNREADABLE = (OSError, SyntaxError, ValueError, Image.DecompressionBombError)
SIXTEEN_BIT = ("I;16", "I;16B", "I;16L", "I;16N", "I")  # "I": 16-bit PNGs before Pillow 10
T = TypeVar("T")


def load_rgb(path: str | Path) -> Image.Image:
    """The image at ``path`` as 8-bit RGB; 16-bit grayscale scaled by 255/65535."""
    with Image.open(path) as image:
        if image.mode in SIXTEEN_BIT:
            values = np.asarray(image, dtype=np.float64)
            if values.min() < 0 or values.max() > 65535:
                raise ValueError(f"{image.mode} image with values outside 0..65535")
            image = Image.fromarray(np.rint(values * (255 / 65535)).astype(np.uint8), "L")
        return image.convert("RGB")


class BadImages:
    """``data.on_bad_image`` over ``files``."""

    def __init__(self, files: list[str], on_bad_image: str, where: str | Path) -> None:
        self.files, self.on_bad_image, self.where = files, on_bad_image, where
        self.flags = multiprocessing.Array("b", len(files), lock=False)  # 1: this file does not read

    def mark(self, i: int, why: str) -> None:
        """File ``i`` does not read: stop (``fail``), or count it and say so once (``skip``)."""
        if self.on_bad_image == "fail":
            raise UserError(f"cannot read image '{self.files[i]}' ({why}): remove or replace it, or skip "
                            "unreadable images: data.on_bad_image=skip")
        if not self.flags[i]:
            log.warning("skipping unreadable image %s (%s)", self.files[i], why)
        self.flags[i] = 1

    def read(self, index: int, load: Callable[[int], T], replace: bool) -> T | None:
        """``load(index)``; for a file that does not read, the next readable one (``replace``) or None."""
        n = len(self.files)
        for offset in range(n):
            i = (index + offset) % n
            if self.flags[i]:
                if replace:
                    continue
                return None
            try:
                return load(i)
            except UNREADABLE as e:
                self.mark(i, f"{type(e).__name__}: {e}")
                if not replace:
                    return None
        raise UserError(f"none of the {n} images under '{self.where}' can be read")

    def check_present(self) -> None:
        """One ``stat`` per file, before any work: a missing file stops the run or is counted now."""
        missing = [i for i, f in enumerate(self.files) if not os.path.isfile(f)]
        if missing and (self.on_bad_image == "fail" or len(missing) == len(self.files)):
            raise UserError(f"{len(missing)} of the {len(self.files)} images of '{self.where}' are missing "
                            f"(the first: '{self.files[missing[0]]}'): restore them, or skip unreadable "
                            "images: data.on_bad_image=skip")
        if missing:
            log.warning("%d of the %d images of '%s' are missing and will be skipped (the first: %s)",
                        len(missing), len(self.files), self.where, self.files[missing[0]])
        for i in missing:
            self.flags[i] = 1

    def bad_files(self) -> list[str]:
        return [self.files[i] for i, flag in enumerate(self.flags) if flag]


def unreadable_files(datasets: Iterable[Any]) -> list[str]:
    """The files the loaders of every process skipped (datasets with ``bad_files()``), sorted."""
    files = {f for dataset in datasets for f in getattr(dataset, "bad_files", list)()}
    return sorted(set().union(*distributed.all_gather_objects(files)))


# ---------------------------------------------------------------- listing an ImageFolder tree
def class_folders(split_dir: Path) -> list[str]:
    """The class folders of ``split_dir``, sorted; a dangling or looping link among them is one line."""
    classes = []
    for entry in sorted(os.scandir(split_dir), key=lambda e: e.name):
        try:
            is_dir = entry.is_dir()
        except OSError as e:  # a link to itself: ELOOP
            raise UserError(f"class folder '{entry.path}' cannot be opened ({e.strerror}): fix or remove "
                            "that symbolic link") from None
        if is_dir:
            classes.append(entry.name)
        elif entry.is_symlink():
            raise UserError(f"class folder '{entry.path}' is a symbolic link to nothing ("
                            f"{os.readlink(entry.path)}): fix or remove it")
    return classes


def folder_key(path: str | Path) -> tuple[int, int]:
    stat = os.stat(path)
    return stat.st_dev, stat.st_ino


def image_files(folder: Path, seen: set[tuple[int, int]]) -> list[str]:
    """The image files under ``folder``, sorted, following links to folders not yet in ``seen``."""
    found = []
    seen.add(folder_key(folder))
    for entry in sorted(os.scandir(folder), key=lambda e: e.name):
        try:
            is_dir = entry.is_dir()
        except OSError as e:
            log.warning("skipping %s: %s", entry.path, e.strerror)
            continue
        if is_dir:
            if folder_key(entry.path) in seen:
                log.warning("skipping %s: it links to a folder already listed (%s)", entry.path,
                            os.path.realpath(entry.path))
                continue
            found += image_files(Path(entry.path), seen)
        elif entry.name.lower().endswith(IMG_EXTENSIONS):
            found.append(entry.path)
    return found


def center_crop_arr(image: Image.Image, size: int) -> Image.Image:
    """ADM's centre crop (guided-diffusion ``image_datasets.py``, DiT's ``center_crop_arr``)."""
    while min(*image.size) >= 2 * size:
        image = image.resize(tuple(x // 2 for x in image.size), resample=Image.BOX)
    scale = size / min(*image.size)
    image = image.resize(tuple(round(x * scale) for x in image.size), resample=Image.BICUBIC)
    array = np.asarray(image)
    top, left = (array.shape[0] - size) // 2, (array.shape[1] - size) // 2
    return Image.fromarray(array[top: top + size, left: left + size])
