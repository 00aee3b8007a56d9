"""Feature extractors that score generated images: uint8 (N, 3, H, W) -> ``{"features", "logits"}``.
:class:`InceptionFeatures` is torch-fidelity's ``inception-v3-compat`` (``fid``); :class:`DigitsFeatures` the
CPU stand-in on the digits (``fd_digits``, never "FID": its numbers are on another scale)."""

from __future__ import annotations

import logging
import pickle
import socket
from pathlib import Path
from unittest import mock

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
    """Before any work: the Inception weights are a file of Inception-v3's weights (or a cached copy of
    them), or downloadable."""
    if path:
        if not Path(path).is_file():
            raise UserError(f"task.fid.inception_weights={path} does not exist: give the path of "
                            f"torch-fidelity's {INCEPTION_FILE}")
        inception_weights(path)
        return
    cached = Path(torch.hub.get_dir()) / "checkpoints" / INCEPTION_FILE
    if cached.is_file():
        inception_weights(str(cached))
    elif not online():
        raise UserError(f"the Inception weights are not cached ({cached}) and this machine is offline: set "
                        f"task.fid.inception_weights to a copy of torch-fidelity's {INCEPTION_FILE} "
                        "(downloaded on an online machine)")


def inception_weights(path: str | None) -> dict[str, torch.Tensor]:
    """The state of torch-fidelity's Inception-v3 read from ``path`` (None: its cached download) as tensors
    only (``weights_only=True``: a pickle's code never runs), checked against the network's layout; a file
    that is anything else is one line."""
    from torch_fidelity.feature_extractor_inceptionv3 import URL_INCEPTION_V3

    what = f"task.fid.inception_weights={path}" if path else f"the cached Inception weights {INCEPTION_FILE}"
    try:
        state = (torch.load(path, map_location="cpu", weights_only=True) if path else
                 torch.hub.load_state_dict_from_url(URL_INCEPTION_V3, map_location="cpu", check_hash=True,
                                                    weights_only=True))
        if not isinstance(state, dict):
            raise TypeError(f"it holds a {type(state).__name__}, not a state dict")
        inception_network({k: v.to("meta") for k, v in state.items()}, torch.device("meta"))
    except pickle.UnpicklingError:  # torch's advice here is to unpickle anyway: not ours to give
        raise UserError(f"{what} is not torch-fidelity's Inception-v3 weights: it holds objects other than "
                        f"tensors, which are never loaded: give the path of its {INCEPTION_FILE}") from None
    except Exception as e:  # a damaged file, other weights
        said = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise UserError(f"{what} is not torch-fidelity's Inception-v3 weights ({type(e).__name__}: {said}): "
                        f"give the path of its {INCEPTION_FILE}") from None
    return state


def inception_network(state: dict[str, torch.Tensor], device: torch.device) -> nn.Module:
    """torch-fidelity's ``inception-v3-compat`` holding ``state`` (strictly: keys and shapes). Its constructor
    loads weights itself, with ``torch.load(weights_only=False)`` of a path or from its URL: it is handed the
    state read safely instead."""
    from torch_fidelity import feature_extractor_inceptionv3 as fidelity

    with mock.patch.object(fidelity, "load_state_dict_from_url", lambda *_, **__: state), device:
        return fidelity.FeatureExtractorInceptionV3("inception-v3-compat", ["2048", "logits_unbiased"])


class InceptionFeatures(nn.Module):
    """Pool features and unbiased logits of torch-fidelity's Inception-v3 (inputs resized to 299)."""

    distance, dims = "fid", 2048

    def __init__(self, weights: str | None = None) -> None:
        super().__init__()
        self.net = inception_network(inception_weights(weights), torch.device("cpu"))

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


def train_digits_features(images: torch.Tensor, labels: torch.Tensor, epochs: int) -> DigitsFeatures:
    """A :class:`DigitsFeatures` trained on uint8 ``images`` (N, 3, H, W): Adam at 2e-3, batches of 64, its
    own seeded streams (the caller's random state untouched)."""
    generator = torch.Generator().manual_seed(0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        net = DigitsFeatures()
        optimizer = torch.optim.Adam(net.parameters(), lr=2e-3)
        for _ in range(epochs):
            for batch in torch.randperm(len(images), generator=generator).split(64):
                loss = nn.functional.cross_entropy(net(images[batch])["logits"].float(), labels[batch])
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
    return net.eval()


def as_uint8(images: torch.Tensor) -> torch.Tensor:
    """[-1, 1] images to uint8 [0, 255] as DiT saves its samples: ``clamp(127.5 x + 128, 0, 255)``."""
    return (images * 127.5 + 128).clamp(0, 255).to(torch.uint8)
