"""Gaussian diffusion as DiT trains and samples it: ADM's formulation (Nichol & Dhariwal 2021, arXiv
2102.09672; Dhariwal & Nichol 2021, arXiv 2105.05233), which facebookresearch/DiT runs through
``create_diffusion`` (openai/guided-diffusion ``gaussian_diffusion.py``, ``respace.py``, ``losses.py``):
linear betas, learned-range variance, the hybrid loss ``MSE(eps) + L_vb`` (``L_vb`` trains the variance only),
respacing and DDPM ancestral sampling. The model is any ``model(x_t, t, **kwargs) -> (B, 2C or C, ...)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

Model = Callable[..., torch.Tensor]


def linear_betas(steps: int = 1000, start: float = 1e-4, end: float = 0.02) -> np.ndarray:
    """ADM's linear schedule: ``start`` and ``end`` scaled by 1000/steps (the same process at any length)."""
    scale = 1000 / steps
    return np.linspace(scale * start, scale * end, steps, dtype=np.float64)


def spaced_steps(num_steps: int, spacing: str | int) -> list[int]:
    """The kept steps of a respaced process (ADM's ``space_timesteps``): ``"ddimN"`` or section counts."""
    spacing = str(spacing)
    if spacing.startswith("ddim"):
        wanted = int(spacing[4:])
        for stride in range(1, num_steps):
            if len(range(0, num_steps, stride)) == wanted:
                return list(range(0, num_steps, stride))
        raise ValueError(f"cannot take exactly {wanted} evenly strided steps of {num_steps}")
    counts = [int(c) for c in spacing.split(",")]
    if min(counts) < 0 or not sum(counts):
        raise ValueError(f"'{spacing}' keeps no steps: give a positive count (or section counts, or ddimN)")
    size, extra = divmod(num_steps, len(counts))
    kept, start = [], 0
    for i, count in enumerate(counts):
        section = size + (1 if i < extra else 0)
        if count > section:
            raise ValueError(f"cannot take {count} steps from a section of {section}")
        stride = 1 if count <= 1 else (section - 1) / (count - 1)
        position = 0.0
        for _ in range(count):  # summed, not multiplied: ADM's float rounding, so the same steps
            kept.append(start + round(position))
            position += stride
        start += section
    return sorted(set(kept))


def normal_kl(mean1: torch.Tensor, logvar1: torch.Tensor, mean2: torch.Tensor,
              logvar2: torch.Tensor) -> torch.Tensor:
    """KL(N(mean1, e^logvar1) || N(mean2, e^logvar2)), elementwise, in nats."""
    return 0.5 * (-1.0 + logvar2 - logvar1 + torch.exp(logvar1 - logvar2)
                  + (mean1 - mean2) ** 2 * torch.exp(-logvar2))


def approx_standard_normal_cdf(x: torch.Tensor) -> torch.Tensor:
    """The tanh approximation of the standard normal CDF that ADM's decoder likelihood uses."""
    return 0.5 * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))


def discretized_gaussian_log_likelihood(x: torch.Tensor, mean: torch.Tensor,
                                        log_scale: torch.Tensor) -> torch.Tensor:
    """log P(x) of [-1, 1] data quantised to 256 bins under N(mean, e^(2 log_scale)), in nats."""
    centred = x - mean
    inv_std = torch.exp(-log_scale)
    cdf_plus = approx_standard_normal_cdf(inv_std * (centred + 1.0 / 255.0))
    cdf_minus = approx_standard_normal_cdf(inv_std * (centred - 1.0 / 255.0))
    log_cdf_plus = torch.log(cdf_plus.clamp(min=1e-12))
    log_one_minus_cdf_minus = torch.log((1.0 - cdf_minus).clamp(min=1e-12))
    log_delta = torch.log((cdf_plus - cdf_minus).clamp(min=1e-12))
    return torch.where(x < -0.999, log_cdf_plus, torch.where(x > 0.999, log_one_minus_cdf_minus, log_delta))


def mean_flat(x: torch.Tensor) -> torch.Tensor:
    return x.mean(dim=tuple(range(1, x.dim())))


class GaussianDiffusion:
    """The process for ``betas``; ``timestep_map``: the original index of each (respaced) step."""

    def __init__(self, betas: np.ndarray, learn_sigma: bool = True,
                 timestep_map: list[int] | None = None, sigma_small: bool = False) -> None:
        betas = np.asarray(betas, dtype=np.float64)
        if betas.ndim != 1 or not ((betas > 0) & (betas <= 1)).all():
            raise ValueError("betas must be a 1-D array in (0, 1]")
        self.betas, self.learn_sigma, self.sigma_small = betas, learn_sigma, sigma_small
        self.num_steps = len(betas)
        self.timestep_map = torch.tensor(timestep_map if timestep_map is not None else range(self.num_steps))
        alphas = 1.0 - betas
        self.alphas_cumprod = np.cumprod(alphas)
        self.alphas_cumprod_prev = np.append(1.0, self.alphas_cumprod[:-1])
        self.sqrt_alphas_cumprod = np.sqrt(self.alphas_cumprod)
        self.sqrt_one_minus_alphas_cumprod = np.sqrt(1.0 - self.alphas_cumprod)
        self.sqrt_recip_alphas_cumprod = np.sqrt(1.0 / self.alphas_cumprod)
        self.sqrt_recipm1_alphas_cumprod = np.sqrt(1.0 / self.alphas_cumprod - 1)
        self.posterior_variance = betas * (1.0 - self.alphas_cumprod_prev) / (1.0 - self.alphas_cumprod)
        # zero at t=0: ADM clips its log to the next step's value
        self.posterior_log_variance_clipped = np.log(np.append(self.posterior_variance[1],
                                                               self.posterior_variance[1:]))
        # a model that predicts no variance samples at a fixed one: DiT's create_diffusion takes ADM's
        # FIXED_LARGE (the betas, the first step at the posterior's) unless sigma_small (FIXED_SMALL: the
        # posterior's)
        self.fixed_log_variance = self.posterior_log_variance_clipped if sigma_small else \
            np.log(np.append(self.posterior_variance[1], betas[1:]))
        self.posterior_mean_coef1 = betas * np.sqrt(self.alphas_cumprod_prev) / (1.0 - self.alphas_cumprod)
        self.posterior_mean_coef2 = (1.0 - self.alphas_cumprod_prev) * np.sqrt(alphas) / \
            (1.0 - self.alphas_cumprod)

    @classmethod
    def create(cls, steps: int = 1000, spacing: str | int | None = None, learn_sigma: bool = True,
               sigma_small: bool = False) -> GaussianDiffusion:
        """DiT's ``create_diffusion``: ``steps`` linear betas, respaced to ``spacing`` when given; a learned
        variance range, or (``learn_sigma=False``) a fixed variance and the MSE loss alone."""
        base = cls(linear_betas(steps), learn_sigma, sigma_small=sigma_small)
        return base if spacing in (None, "") else base.respaced(spacing)

    def respaced(self, spacing: str | int) -> GaussianDiffusion:
        """The process on the kept steps of :func:`spaced_steps` (ADM's ``SpacedDiffusion``)."""
        kept = spaced_steps(self.num_steps, spacing)
        betas, last = [], 1.0
        for step in kept:
            betas.append(1.0 - self.alphas_cumprod[step] / last)
            last = self.alphas_cumprod[step]
        return GaussianDiffusion(np.array(betas), self.learn_sigma, [int(self.timestep_map[s]) for s in kept],
                                 self.sigma_small)

    @staticmethod
    def _at(values: np.ndarray, t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        out = torch.from_numpy(values).to(like.device)[t].float()
        return out.view(-1, *([1] * (like.dim() - 1)))

    def q_sample(self, x0: torch.Tensor, t: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """x_t ~ q(x_t | x_0) = N(sqrt(abar_t) x_0, (1 - abar_t) I), for the given noise."""
        return self._at(self.sqrt_alphas_cumprod, t, x0) * x0 + \
            self._at(self.sqrt_one_minus_alphas_cumprod, t, x0) * noise

    def q_posterior(self, x0: torch.Tensor, xt: torch.Tensor,
                    t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Mean, variance and clipped log-variance of q(x_{t-1} | x_t, x_0)."""
        mean = self._at(self.posterior_mean_coef1, t, xt) * x0 + \
            self._at(self.posterior_mean_coef2, t, xt) * xt
        return (mean, self._at(self.posterior_variance, t, xt),
                self._at(self.posterior_log_variance_clipped, t, xt))

    def predict_x0(self, xt: torch.Tensor, t: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
        return self._at(self.sqrt_recip_alphas_cumprod, t, xt) * xt - \
            self._at(self.sqrt_recipm1_alphas_cumprod, t, xt) * eps

    def p_mean_variance(self, output: torch.Tensor, xt: torch.Tensor, t: torch.Tensor,
                        clip_denoised: bool = False) -> dict[str, torch.Tensor]:
        """p(x_{t-1} | x_t): mean, log-variance and the predicted x_0 (clamped with ``clip_denoised``)."""
        if self.learn_sigma:
            eps, v = output.split(xt.shape[1], dim=1)
            low = self._at(self.posterior_log_variance_clipped, t, xt)
            high = self._at(np.log(self.betas), t, xt)
            fraction = (v + 1) / 2
            log_variance = fraction * high + (1 - fraction) * low
        else:
            eps = output
            log_variance = self._at(self.fixed_log_variance, t, xt).expand_as(xt)
        x0 = self.predict_x0(xt, t, eps)
        if clip_denoised:
            x0 = x0.clamp(-1, 1)
        mean = self.q_posterior(x0, xt, t)[0]
        return {"mean": mean, "log_variance": log_variance, "x0": x0}

    def vb_terms_bpd(self, output: torch.Tensor, x0: torch.Tensor, xt: torch.Tensor,
                     t: torch.Tensor) -> torch.Tensor:
        """The variational bound term per sample in bits per dimension (the decoder's NLL at t = 0)."""
        true_mean, _, true_log_variance = self.q_posterior(x0, xt, t)
        p = self.p_mean_variance(output, xt, t)
        kl = mean_flat(normal_kl(true_mean, true_log_variance, p["mean"], p["log_variance"])) / math.log(2.0)
        nll = -mean_flat(discretized_gaussian_log_likelihood(x0, p["mean"], 0.5 * p["log_variance"]))
        return torch.where(t == 0, nll / math.log(2.0), kl)

    def training_losses(self, model: Model, x0: torch.Tensor, t: torch.Tensor,
                        noise: torch.Tensor | None = None, **model_kwargs: Any) -> dict[str, torch.Tensor]:
        """Per-sample ``loss = mse + vb`` (``vb`` only with ``learn_sigma``) at steps ``t``."""
        noise = torch.randn_like(x0) if noise is None else noise
        xt = self.q_sample(x0, t, noise)
        output = model(xt, self.timestep_map.to(t.device)[t], **model_kwargs)
        terms: dict[str, torch.Tensor] = {}
        if self.learn_sigma:
            eps, v = output.split(x0.shape[1], dim=1)
            # the bound trains the variance only: the mean it sees is the detached epsilon's
            terms["vb"] = self.vb_terms_bpd(torch.cat([eps.detach(), v], dim=1), x0, xt, t)
        else:
            eps = output
        terms["mse"] = mean_flat((noise - eps) ** 2)
        terms["loss"] = terms["mse"] + terms.get("vb", 0.0)
        return terms

    def p_sample(self, output: torch.Tensor, xt: torch.Tensor, t: torch.Tensor, noise: torch.Tensor,
                 clip_denoised: bool = False) -> torch.Tensor:
        """One ancestral step x_t -> x_{t-1} (no noise at t = 0)."""
        p = self.p_mean_variance(output, xt, t, clip_denoised)
        nonzero = (t != 0).float().view(-1, *([1] * (xt.dim() - 1)))
        return p["mean"] + nonzero * torch.exp(0.5 * p["log_variance"]) * noise

    def p_sample_loop_progressive(self, model: Model, noise: torch.Tensor,
                                  generator: torch.Generator | None = None, clip_denoised: bool = False,
                                  **model_kwargs: Any) -> Iterator[torch.Tensor]:
        """x_T = ``noise``, then each x_{t-1} down to x_0 (yielded); the step noise from ``generator``."""
        x = noise
        steps = self.timestep_map.to(noise.device)
        for i in reversed(range(self.num_steps)):
            t = torch.full((len(x),), i, device=x.device, dtype=torch.long)
            with torch.no_grad():
                output = model(x, steps[t], **model_kwargs)
            device = generator.device if generator is not None else x.device
            step_noise = torch.randn(x.shape, generator=generator, device=device).to(x.device)
            x = self.p_sample(output, x, t, step_noise, clip_denoised)
            yield x

    def p_sample_loop(self, model: Model, noise: torch.Tensor, generator: torch.Generator | None = None,
                      clip_denoised: bool = False, **model_kwargs: Any) -> torch.Tensor:
        x = noise
        for x_prev in self.p_sample_loop_progressive(model, noise, generator, clip_denoised, **model_kwargs):
            x = x_prev
        return x


def guided(model: Model, scale: float, null_label: int, channels: int) -> Model:
    """Classifier-free guidance (Ho & Salimans 2022, arXiv 2207.12598) on all ``channels`` epsilon channels
    (DiT's ``forward_with_cfg`` guides 3 of 4); scale 1 is the conditional model itself (one forward)."""
    if scale == 1.0:
        return model

    def forward(x: torch.Tensor, t: torch.Tensor, y: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        both = model(torch.cat([x, x]), torch.cat([t, t]), y=torch.cat([y, torch.full_like(y, null_label)]),
                     **kwargs)
        conditional, unconditional = both.chunk(2)
        eps = unconditional[:, :channels] + scale * (conditional[:, :channels] - unconditional[:, :channels])
        return torch.cat([eps, conditional[:, channels:]], dim=1)

    return forward
