"""What a run needs to be reproduced: seeds, package versions, git commit, config identity."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import platform
import random
import subprocess
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import torch

PACKAGES = ("torch", "torchvision", "timm", "hydra-core", "omegaconf", "wandb", "numpy", "scikit-learn",
            "pillow", "imagecorruptions-imaug", "pycocotools", "normexp")

# Config keys that do not change what a run computes; left out of its identity. ``table`` says which table
# and row a run serves: the same run can serve several (e.g. a baseline shared by two tables). ``plugins``
# says where a normalizer's code comes from, not what it is (its name and options are the identity).
# norm.model_defaults: what a normalizer suggests to models; its effect is in the model's own keys
# (backbone.zero_init), and runs of models that read none are the same runs with or without it
NON_IDENTITY_KEYS = ("logger", "table", "launcher", "plugins", "trainer.progress", "trainer.resume",
                     "norm.model_defaults")
# Options added after runs were made, left out of a run's identity while they hold the value that computes
# what was computed before the option existed, so those runs keep theirs: trial (a deliberate repeat),
# trainer.decay_epochs (sched=step's interval; null: timm's default), trainer.lr_factor (1: the recipe's
# lr), the ViTs' norm placement options (configs/backbone/family/vit.yaml) at the plain Pre-LN ViT,
# task.probes at [alpha] (the per-epoch alpha rows every training run logged before probes were per task),
# the options the config shows since it takes them from the constructors (at their defaults): the
# normalizers' and LeViT's stem stride and T2T-ViT's soft split (shown before by their micro sizes only),
# and the fidelity options whose old behaviour is one value (DINO's lr schedule and local-crop positions at
# timm's, torchvision's crop sampler, sigma-Reparam's float32 sigma, TF32 off), and
# task.allow_incomplete_source off (every run before it started from what it was given), the conversion
# settings at what every run computed before them (alpha at alpha0; the starting point not evaluated),
# norm=pointwise's function options (Derf's property studies) at the plain function with a scalar shift, and
# the evaluation-mode training loss off and all of the training data (data.train_fraction 1).
IDENTITY_DEFAULTS: dict[str, Any] = {"trial": 0, "trainer.decay_epochs": None, "trainer.lr_factor": 1.0,
                                     "backbone.norm_position": "pre", "backbone.qk_norm": False,
                                     "backbone.layer_scale": None, "backbone.normformer": False,
                                     "task.probes": ["alpha"], "norm.affine": True,
                                     "norm.track_running_stats": True, "norm.separable": True,
                                     "norm.unbiased": True, "norm.per_channel": True,
                                     "backbone.stem_stride": 16,
                                     "backbone.soft_split": [[7, 4, 2], [3, 2, 1], [3, 2, 1]],
                                     "task.lr_schedule": "timm", "task.pos_interpolation": "timm",
                                     "data.crop_sampler": "torchvision", "norm.float32_sigma": True,
                                     "trainer.tf32": False, "task.sigma_small": False,
                                     "task.allow_incomplete_source": False, "norm.alpha_init": "alpha0",
                                     "task.evaluate_start": False, "task.calibration_batches": 4,
                                     "norm.vector_shift": False, "norm.output_shift": 0.0, "norm.clip": None,
                                     "norm.blend": 0.0, "norm.flat": 0.0, "norm.negate": False,
                                     "norm.prescale": 1.0, "task.eval_train_loss": False,
                                     "data.train_fraction": 1.0}
# Keys taken out of the config after runs were made, put back for the identity at the value those runs had:
# the DiT family's backbone.kind, 'diffusion' (a task's need is checked against the model class's serves).
RETIRED_KEYS: dict[str, Callable[[dict[str, Any]], Any]] = {
    "backbone.kind": lambda c: "diffusion" if str(c.get("backbone", {}).get("name", "")).startswith("dit_")
    else None}


SPREAD = (1_000_003, 1_009)  # primes far apart, so that nearby seeds and streams never share a value


def stream_seed(seed: int, *streams: int, spread: tuple[int, ...] = SPREAD) -> int:
    """The seed of one random stream of a run: ``seed`` folded with each stream index in turn (``value *
    spread[i] + streams[i]``), so that each (epoch, rank, purpose) draws numbers of its own and the same
    ones on every rerun or resume. Every seeded stream of normexp comes from here."""
    value = seed
    for stream, factor in zip(streams, spread, strict=False):
        value = value * factor + stream
    return value


def stream_generator(seed: int, *streams: int, spread: tuple[int, ...] = SPREAD) -> torch.Generator:
    """A CPU generator seeded with :func:`stream_seed`."""
    return torch.Generator().manual_seed(stream_seed(seed, *streams, spread=spread))


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (all devices)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def package_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    versions["cuda"] = torch.version.cuda
    return versions


def hardware() -> dict[str, Any]:
    """The machine a run ran on: accelerator (or cpu), how many, CPU cores, torch's CPU threads, platform."""
    cuda = torch.cuda.is_available()
    return {
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "gpus": torch.cuda.device_count() if cuda else 0,
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "platform": platform.platform(terse=True),
    }


def git_state(path: Path | None = None) -> dict[str, Any]:
    """Commit and dirty flag of the checkout holding this package (None outside a git checkout). Dirty: a
    tracked file differs from the commit, ``results/`` aside -- what the suite renders there (a table made
    in this checkout) does not change the code the next run trains with."""
    cwd = path or Path(__file__).resolve().parent

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no", "--", ":(top)", ":(top,exclude)results") \
        if commit else None
    return {"commit": commit, "dirty": bool(status) if status is not None else None}


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"trainer": {"lr": 1e-3, "ema": {}}}`` -> ``{"trainer.lr": 1e-3, "trainer.ema": {}}``: dotted keys
    for the leaves (an empty mapping is a leaf)."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def config_hash(config: dict[str, Any]) -> str:
    """Identity of a run: sha256 of its resolved config (seed included), less ``NON_IDENTITY_KEYS`` and the
    ``IDENTITY_DEFAULTS`` keys that hold their default, with the ``RETIRED_KEYS`` its runs had."""
    identity = copy.deepcopy(config)
    for key, value_of in RETIRED_KEYS.items():
        *parents, leaf = key.split(".")
        node = identity
        for parent in parents:
            node = node.get(parent) if isinstance(node, dict) else None
        value = value_of(identity)
        if isinstance(node, dict) and leaf not in node and value is not None:
            node[leaf] = value
    for key in (*NON_IDENTITY_KEYS, *IDENTITY_DEFAULTS):
        *parents, leaf = key.split(".")
        node = identity
        for parent in parents:
            node = node.get(parent) if isinstance(node, dict) else None
        if isinstance(node, dict) and leaf in node and (
                key not in IDENTITY_DEFAULTS or node[leaf] == IDENTITY_DEFAULTS[key]):
            node.pop(leaf)
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:16]
