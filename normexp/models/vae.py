"""The latent space DiT trains in: the Stable Diffusion VAE (``stabilityai/sd-vae-ft-ema``, as DiT's
``train.py`` loads it) through ``diffusers.AutoencoderKL``, 8x down-sampling to 4 channels, latents scaled by
0.18215 (the SD VAE's ``scaling_factor``). Training encodes each batch and samples the posterior
(``latent_dist.sample()``), as DiT does; samples are decoded with ``decode(z / 0.18215)``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import UserError
from .features import online

DOWNSAMPLE, CHANNELS = 8, 4


def check_vae(source: str) -> None:
    """Before any work: ``source`` is a diffusers model folder, or a hub id that is cached or downloadable."""
    if Path(source).expanduser().exists() or source.startswith((".", "/", "~")):
        folder = Path(source).expanduser()
        if not (folder / "config.json").is_file():
            raise UserError(f"task.vae={source}: no diffusers AutoencoderKL there (no config.json): give the "
                            "folder of stabilityai/sd-vae-ft-ema (or -mse) as saved by diffusers")
        return
    from huggingface_hub import try_to_load_from_cache

    if not isinstance(try_to_load_from_cache(source, "config.json"), str) and not online("huggingface.co"):
        raise UserError(f"task.vae={source} is not in the Hugging Face cache and this machine is offline: "
                        "download it on an online machine and give its folder as task.vae")


class LatentCodec(nn.Module):
    """[-1, 1] images <-> scaled latents of a frozen ``AutoencoderKL``."""

    def __init__(self, vae: nn.Module, scale: float = 0.18215) -> None:
        super().__init__()
        self.vae, self.scale = vae.eval().requires_grad_(False), scale

    @classmethod
    def load(cls, source: str, scale: float = 0.18215) -> LatentCodec:
        from diffusers import AutoencoderKL

        folder = Path(source).expanduser()
        try:
            return cls(AutoencoderKL.from_pretrained(str(folder) if folder.exists() else source), scale)
        except (OSError, ValueError) as e:
            raise UserError(f"cannot load the VAE task.vae={source}: {str(e).splitlines()[0]}") from e

    @torch.no_grad()
    def encode(self, images: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        return self.vae.encode(images).latent_dist.sample(generator) * self.scale

    @torch.no_grad()
    def moments(self, images: torch.Tensor) -> torch.Tensor:
        """The posterior's parameters (mean and log-variance, 2 x 4 channels): what a latent cache keeps."""
        return self.vae.encode(images).latent_dist.parameters

    @torch.no_grad()
    def sample(self, moments: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """A scaled latent drawn from the posterior with parameters ``moments``."""
        from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

        return DiagonalGaussianDistribution(moments).sample(generator) * self.scale

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return self.vae.decode(latents / self.scale).sample


def random_sd_vae(**overrides: Any) -> nn.Module:
    """The SD VAE's architecture with random weights (no download): for tests and benchmarks."""
    from diffusers import AutoencoderKL

    settings = {"in_channels": 3, "out_channels": 3, "latent_channels": CHANNELS,
                "block_out_channels": (128, 256, 512, 512), "layers_per_block": 2,
                "down_block_types": ("DownEncoderBlock2D",) * 4, "up_block_types": ("UpDecoderBlock2D",) * 4,
                "sample_size": 256}
    return AutoencoderKL(**{**settings, **overrides})
