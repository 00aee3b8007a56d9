"""Classifier evaluation shared by classification (validation) and robustness (corrupted images): exact counts
summed over the processes of a distributed job."""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader
from tqdm import tqdm

from .. import distributed
from ..errors import UserError
from .precision import Precision


def show_progress(setting: str | bool) -> bool:
    """``trainer.progress``: ``auto`` shows progress bars only on a terminal."""
    return sys.stderr.isatty() if setting == "auto" else bool(setting)


@dataclass
class Counts:
    """Per group (one group, or one per corruption x severity): summed cross-entropy, top-k hits, images."""

    loss: torch.Tensor  # (groups,) float64
    hits: torch.Tensor  # (len(topk), groups) int64
    seen: torch.Tensor  # (groups,) int64


@torch.no_grad()
def count_predictions(model: nn.Module, loader: DataLoader, precision: Precision, *,
                      topk: tuple[int, ...] = (1,), num_groups: int = 1, progress: bool = False,
                      desc: str = "eval") -> Counts:
    """Run ``model`` over ``loader`` -- batches of ``(images, labels)`` or ``(images, labels, group)`` --
    and count, per group, the cross-entropy and the images whose label is in the top-k. Each process counts
    its shard of the data; the counts are summed over processes, so they are exact (every sample once)."""
    model.eval()
    device = precision.device
    loss = torch.zeros(num_groups, dtype=torch.float64, device=device)
    hits = torch.zeros(len(topk), num_groups, dtype=torch.long, device=device)
    seen = torch.zeros(num_groups, dtype=torch.long, device=device)
    for batch in tqdm(loader, desc=desc, disable=not progress, leave=False):
        if batch is None:  # none of its images could be read (data.on_bad_image=skip)
            continue
        images = batch[0].to(device, non_blocking=True)
        labels = batch[1].to(device, non_blocking=True)
        group = batch[2].to(device, non_blocking=True) if len(batch) > 2 else torch.zeros_like(labels)
        with precision.autocast():
            logits = model(images)
        logits = logits.float()
        loss.index_add_(0, group, F.cross_entropy(logits, labels, reduction="none").double())
        ranked = logits.topk(max(topk), dim=1).indices == labels[:, None]
        for i, k in enumerate(topk):
            hits[i].index_add_(0, group, ranked[:, :k].any(dim=1).long())
        seen.index_add_(0, group, torch.ones_like(group))
    for t in (loss, hits, seen):
        distributed.all_reduce_sum(t)
    return Counts(loss.cpu(), hits.cpu(), seen.cpu())


def classification_metrics(counts: Counts, names: tuple[str, ...], prefix: str) -> dict[str, float]:
    """``<prefix>/loss`` and ``<prefix>/<name>`` (percent, one per top-k counted) of a one-group count."""
    seen = int(counts.seen[0])
    if seen == 0:
        raise UserError("none of the evaluation images could be read: check the dataset (the log names each "
                        "unreadable file)")
    metrics = {f"{prefix}/loss": float(counts.loss[0]) / seen}
    metrics.update({f"{prefix}/{name}": 100 * int(counts.hits[i, 0]) / seen for i, name in enumerate(names)})
    return metrics
