"""Frechet distance and Inception Score from features (Heusel et al. 2017, arXiv 1706.08500; Salimans et al.
2016, arXiv 1606.03498) through torch-fidelity's implementations, statistics in float64 as ADM's evaluator
and reference batches keep them."""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import UserError


def statistics(features: np.ndarray) -> dict[str, np.ndarray]:
    """Mean and (unbiased) covariance of (N, D) features, float64."""
    features = np.asarray(features, dtype=np.float64)
    if features.ndim != 2 or len(features) < 2:
        raise ValueError(f"need (N >= 2, D) features, got shape {features.shape}")
    return {"mu": features.mean(axis=0), "sigma": np.cov(features, rowvar=False)}


def frechet_distance(first: dict[str, np.ndarray], second: dict[str, np.ndarray]) -> float:
    """||mu1 - mu2||^2 + tr(S1 + S2 - 2 (S1 S2)^(1/2)) of two feature statistics."""
    from torch_fidelity.metric_fid import KEY_METRIC_FID, fid_statistics_to_metric

    as64 = [{k: np.asarray(s[k], dtype=np.float64) for k in ("mu", "sigma")} for s in (first, second)]
    if as64[0]["mu"].shape != as64[1]["mu"].shape:
        raise UserError(f"feature statistics of different sizes: {as64[0]['mu'].shape[0]} and "
                        f"{as64[1]['mu'].shape[0]} features")
    return float(fid_statistics_to_metric(as64[0], as64[1], verbose=False)[KEY_METRIC_FID])


def inception_score(logits: np.ndarray, splits: int = 10) -> tuple[float, float]:
    """Inception Score (mean, std over ``splits`` unshuffled splits, as ADM's evaluator) of (N, K) logits."""
    import torch
    from torch_fidelity.metric_isc import KEY_METRIC_ISC_MEAN, KEY_METRIC_ISC_STD, isc_features_to_metric

    out = isc_features_to_metric(torch.as_tensor(logits, dtype=torch.float64), splits=splits, shuffle=False)
    return float(out[KEY_METRIC_ISC_MEAN]), float(out[KEY_METRIC_ISC_STD])


def load_reference(path: str | Path, resolution: int, features: int) -> dict[str, Any]:
    """Reference statistics from an ``.npz`` (ADM's reference batches, or the suite's own); one line when the
    file is missing, unreadable, or of another resolution or feature size."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"reference statistics {path} do not exist: give ADM's reference batch (e.g. "
                        "VIRTUAL_imagenet256_labeled.npz) or an ImageFolder to compute them from")
    try:
        with np.load(path, allow_pickle=False) as npz:
            if "mu" not in npz or "sigma" not in npz:
                raise UserError(f"{path} holds no 'mu' and 'sigma' (found {sorted(npz.files)}): not "
                                "reference statistics")
            stats: dict[str, Any] = {"mu": npz["mu"], "sigma": npz["sigma"]}
            if "resolution" in npz:
                found = int(npz["resolution"])
            elif "arr_0" in npz:
                found = int(_stored_shape(npz.zip, "arr_0")[1])  # ADM's batches: (N, H, W, 3) uint8 images
            else:
                raise UserError(f"{path} does not say its resolution (no 'arr_0' images, no 'resolution')")
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
        said = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        raise UserError(f"cannot read reference statistics {path} ({type(e).__name__}: {said}): the file is "
                        "damaged or no .npz: restore it from a copy or make it again") from None
    if found != resolution:
        raise UserError(f"reference statistics {path} are of {found} px images, the samples of "
                        f"{resolution} px: use a reference of {resolution} px "
                        f"(ADM: VIRTUAL_imagenet{resolution}_labeled.npz)")
    problem = statistics_problem(stats["mu"], stats["sigma"], features)
    if problem:
        raise UserError(f"reference statistics {path} are no mean and covariance of {features} features "
                        f"({problem}): remake them, or give ADM's reference batch")
    return stats


def _stored_shape(archive: zipfile.ZipFile, name: str) -> tuple[int, ...]:
    """The shape of array ``name`` in an ``.npz`` from its header alone (ADM's reference images are 2 GB)."""
    with archive.open(f"{name}.npy") as f:
        header = np.lib.format
        major, _ = header.read_magic(f)
        return (header.read_array_header_1_0 if major == 1 else header.read_array_header_2_0)(f)[0]


def statistics_problem(mu: np.ndarray, sigma: np.ndarray, features: int) -> str | None:
    """What makes ``mu`` and ``sigma`` no mean and covariance of ``features`` features (shapes, non-finite
    values, a sigma not symmetric or not positive semi-definite up to rounding), or None."""
    if mu.shape != (features,) or sigma.shape != (features, features):
        return (f"mu has shape {mu.shape} and sigma {sigma.shape}, ours ({features},) and "
                f"({features}, {features})")
    if not (np.isfinite(mu).all() and np.isfinite(sigma).all()):
        return "they hold NaN or infinite values"
    sigma = sigma.astype(np.float64)
    scale = float(np.abs(sigma).max()) or 1.0
    if not np.allclose(sigma, sigma.T, rtol=1e-5, atol=1e-8 * scale):
        return "sigma is not symmetric"
    lowest = float(np.linalg.eigvalsh(sigma).min())
    if lowest < -1e-6 * scale:  # a covariance's eigenvalues are >= 0, here up to float rounding
        return f"sigma has a negative eigenvalue, {lowest:.3g}"
    return None
