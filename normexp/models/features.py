"""Feature extractors that score generated images: uint8 (N, 3, H, W) -> ``{"features", "logits"}``.
:class:`InceptionFeatures` is torch-fidelity's ``inception-v3-compat`` (``fid``); :class:`DigitsFeatures` the
CPU stand-in on the digits (``fd_digits``, never "FID": its numbers are on another scale)."""

from __future__ import annotations

import logging
import socket
from pathlib import Path

import torch
from torch import nn

from ..errors import UserError

log = logging.getLogger(__name__)

INCEPTION_FILE = "weights-inception-2015-12-05-6726825d.pth"  # torch-fidelity's name for the weights


def online(host: str = "github.com", timeout: float = 3.0) -> bool:
    """Whether ``host`` answers on 443 within ``timeout`` seconds."""
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def check_inception_weights(path: str | None) -> None:
    """Before any work: the Inception weights are a readable file, a cached copy, or downloadable."""
    if path:
        if not Path(path).is_file():
            raise UserError(f"task.fid.inception_weights={path} does not exist: give the path of "
                            f"torch-fidelity's {INCEPTION_FILE}")
        return
    cached = Path(torch.hub.get_dir()) / "checkpoints" / INCEPTION_FILE
    if not cached.is_file() and not online():
        raise UserError(f"the Inception weights are not cached ({cached}) and this machine is offline: set "
                        f"task.fid.inception_weights to a copy of torch-fidelity's {INCEPTION_FILE} "
                        "(downloaded on an online machine)")


class InceptionFeatures(nn.Module):
    """Pool features and unbiased logits of torch-fidelity's Inception-v3 (inputs resized to 299)."""

    distance, dims = "fid", 2048

    def __init__(self, weights: str | None = None) -> None:
        super().__init__()
        from torch_fidelity.feature_extractor_inceptionv3 import FeatureExtractorInceptionV3

        self.net = FeatureExtractorInceptionV3("inception-v3-compat", ["2048", "logits_unbiased"],
                                               feature_extractor_weights_path=weights)

    @torch.no_grad()
    def forward(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        features, logits = self.net(images)
        return {"features": features.double(), "logits": logits.double()}


class DigitsFeatures(nn.Module):
    """Three convolutions, average pooling (64 features) and a linear classifier of the 10 digits."""

    distance, dims = "fd_digits", 64

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 32, 3, stride=2, padding=1), nn.ReLU(),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
            nn.Conv2d(64, 64, 3, stride=2, padding=1), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(64, 10)

    def forward(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        x = images.float() / 127.5 - 1 if images.dtype == torch.uint8 else images
        features = self.body(x)
        return {"features": features.double(), "logits": self.head(features).double()}


def as_uint8(images: torch.Tensor) -> torch.Tensor:
    """[-1, 1] images to uint8 [0, 255] as DiT saves its samples: ``clamp(127.5 x + 128, 0, 255)``."""
    return (images * 127.5 + 128).clamp(0, 255).to(torch.uint8)
