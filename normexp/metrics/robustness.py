"""ImageNet-C metrics (Hendrycks & Dietterich, ICLR 2019, arXiv 1903.12261): CE, mCE, relative CE / mCE and
group means, from top-1 error *fractions*. ``CE_c = sum_s E_{s,c} / sum_s R_{s,c}`` and ``RelCE_c = sum_s
(E_{s,c} - E_clean) / sum_s (R_{s,c} - R_clean)``, R the normalising model (AlexNet's published errors on
ImageNet, or a reference run); mCE averages over the 15 benchmark corruptions."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

# The benchmark order of hendrycks/robustness ImageNet-C/test.py; groups as imagecorruptions defines them.
GROUPS: dict[str, tuple[str, ...]] = {
    "noise": ("gaussian_noise", "shot_noise", "impulse_noise"),
    "blur": ("defocus_blur", "glass_blur", "motion_blur", "zoom_blur"),
    "weather": ("snow", "frost", "fog", "brightness"),
    "digital": ("contrast", "elastic_transform", "pixelate", "jpeg_compression"),
}
CORRUPTIONS: tuple[str, ...] = tuple(c for group in GROUPS.values() for c in group)
# "Validation" corruptions: for model selection, never part of mCE (no AlexNet errors exist for them).
EXTRA_CORRUPTIONS: tuple[str, ...] = ("speckle_noise", "gaussian_blur", "spatter", "saturate")
GROUP_OF: dict[str, str] = {c: g for g, cs in {**GROUPS, "extra": EXTRA_CORRUPTIONS}.items() for c in cs}
SEVERITIES: tuple[int, ...] = (1, 2, 3, 4, 5)

# AlexNet's mean top-1 error over severities 1-5 (paper, Appendix C; as copied by google-research/augmix
# imagenet.py ALEXNET_ERR) and its clean error (robustness_metrics ALEXNET_AVERAGE_ERR_CLEAN; torchvision's
# AlexNet weights: 56.522 % top-1).
ALEXNET_ERRORS: dict[str, float] = {
    "gaussian_noise": 0.886428, "shot_noise": 0.894468, "impulse_noise": 0.922640,
    "defocus_blur": 0.819880, "glass_blur": 0.826268, "motion_blur": 0.785948, "zoom_blur": 0.798360,
    "snow": 0.866816, "frost": 0.826572, "fog": 0.819324, "brightness": 0.564592,
    "contrast": 0.853204, "elastic_transform": 0.646056, "pixelate": 0.717840, "jpeg_compression": 0.606500,
}
ALEXNET_CLEAN_ERROR = 0.4348

# corruption -> severity -> top-1 error fraction
ErrorTable = Mapping[str, Mapping[int, float]]


@dataclass(frozen=True)
class Normaliser:
    """The model CE is relative to: its mean error per corruption (over the evaluated severities)."""

    name: str
    errors: Mapping[str, float]
    clean_error: float | None = None  # needed for relative CE only


ALEXNET = Normaliser("AlexNet (published ImageNet-C errors)", ALEXNET_ERRORS, ALEXNET_CLEAN_ERROR)


def mean_errors(table: ErrorTable) -> dict[str, float]:
    """Each corruption's error averaged over its severities."""
    return {c: sum(by_severity.values()) / len(by_severity) for c, by_severity in table.items()}


def corruption_errors(means: Mapping[str, float], normaliser: Normaliser) -> dict[str, float]:
    """CE of every corruption the normaliser has an error for."""
    return {c: _ratio(e, normaliser.errors[c]) for c, e in means.items() if c in normaliser.errors}


def relative_corruption_errors(means: Mapping[str, float], clean_error: float,
                               normaliser: Normaliser) -> dict[str, float]:
    """Relative CE: the error *added* by each corruption, relative to the normaliser's added error."""
    if normaliser.clean_error is None:
        return {}
    return {c: _ratio(e - clean_error, normaliser.errors[c] - normaliser.clean_error)
            for c, e in means.items() if c in normaliser.errors}


def benchmark_mean(per_corruption: Mapping[str, float]) -> float:
    """Mean over the 15 benchmark corruptions present (extras never count); NaN if none or one is NaN."""
    values = [v for c, v in per_corruption.items() if c in CORRUPTIONS]
    return sum(values) / len(values) if values else math.nan


def group_errors(table: ErrorTable) -> dict[str, float]:
    """Mean error of each group (noise, blur, weather, digital, extra) over its corruptions and severities."""
    by_group: dict[str, list[float]] = {}
    for c, by_severity in table.items():
        by_group.setdefault(GROUP_OF[c], []).extend(by_severity.values())
    return {g: sum(v) / len(v) for g, v in by_group.items()}


def _ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator > 0 else math.nan
