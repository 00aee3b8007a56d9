"""The one training loop (DeiT/timm style): train_one_epoch, evaluate, fit.

Uses timm's utilities rather than re-writing them: optimizer factory (no weight decay on 1-D params,
biases and the model's ``no_weight_decay()`` names), per-iteration cosine schedule with linear warm-up,
Mixup/CutMix, label smoothing, model EMA, gradient clipping and top-k accuracy. AMP only on CUDA.
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
import sys
import time
from typing import Any

import numpy as np
import torch
from timm.data import Mixup
from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
from timm.optim import create_optimizer_v2
from timm.scheduler import create_scheduler_v2
from timm.utils import ModelEmaV3, dispatch_clip_grad
from torch import nn
from tqdm import tqdm

from ..errors import UserError
from ..tracking.records import RunRecord
from .checkpoint import load_checkpoint, load_model_state, save_checkpoint

log = logging.getLogger(__name__)

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"trainer.device={name} but CUDA is not available; use trainer.device=cpu or auto")
    return torch.device(name)


def to_device(batch: Any, device: torch.device) -> Any:
    """Tensors, or lists / dicts of them (detection targets), on ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


def show_progress(setting: str | bool) -> bool:
    return sys.stderr.isatty() if setting == "auto" else bool(setting)


class Trainer:
    def __init__(self, cfg: Any, model: nn.Module, data: Any, record: RunRecord) -> None:
        self.cfg, self.data, self.record = cfg, data, record
        self.device = resolve_device(cfg.device)
        self.model = model.to(self.device)
        self.amp_dtype = AMP_DTYPES.get(cfg.amp) if cfg.amp else None
        if self.amp_dtype is not None and self.device.type != "cuda":
            log.warning("trainer.amp=%s is CUDA-only; training in float32 on %s", cfg.amp, self.device)
            self.amp_dtype = None
        self.scaler = torch.amp.GradScaler("cuda") if self.amp_dtype is torch.float16 else None
        self.progress = show_progress(cfg.progress)

        # the module: timm exempts 1-D params, biases and no_weight_decay() names; its parameters: all decay
        params = self.model.parameters() if cfg.decay_norm_and_bias else self.model
        self.optimizer = create_optimizer_v2(
            params, opt=cfg.opt, lr=self.scaled_lr(cfg.lr), weight_decay=cfg.weight_decay,
            eps=cfg.opt_eps, betas=tuple(cfg.betas),
        )
        self.updates_per_epoch = len(data.train)
        if self.updates_per_epoch == 0:
            raise UserError("the training set is smaller than one batch: lower data.batch_size")
        warmup_epochs = cfg.warmup_iters / self.updates_per_epoch if cfg.warmup_iters else cfg.warmup_epochs
        milestones = {"decay_milestones": tuple(cfg.decay_milestones)} if cfg.decay_milestones else {}
        # lr_scale_warmup_min: false keeps warmup_lr and min_lr absolute (DTN's train.py scales only the peak)
        floor_lr = self.scaled_lr if cfg.get("lr_scale_warmup_min", True) else float
        self.scheduler, _ = create_scheduler_v2(
            self.optimizer, sched=cfg.sched, num_epochs=cfg.epochs, warmup_epochs=warmup_epochs,
            warmup_lr=floor_lr(cfg.warmup_lr), min_lr=floor_lr(cfg.min_lr),
            decay_rate=cfg.decay_rate, step_on_epochs=False, updates_per_epoch=self.updates_per_epoch,
            **milestones,
        )
        self.mixup = Mixup(
            mixup_alpha=cfg.mixup.mixup_alpha, cutmix_alpha=cfg.mixup.cutmix_alpha, prob=cfg.mixup.prob,
            switch_prob=cfg.mixup.switch_prob, mode=cfg.mixup.mode, label_smoothing=cfg.smoothing,
            num_classes=data.num_classes,
        ) if cfg.mixup.mixup_alpha > 0 or cfg.mixup.cutmix_alpha > 0 else None
        if self.mixup is not None:  # Mixup already smooths the soft targets
            self.train_loss = SoftTargetCrossEntropy()
        elif cfg.smoothing > 0:
            self.train_loss = LabelSmoothingCrossEntropy(smoothing=cfg.smoothing)
        else:
            self.train_loss = nn.CrossEntropyLoss()
        self.ema = ModelEmaV3(self.model, decay=cfg.ema.decay, use_warmup=cfg.ema.warmup) \
            if cfg.ema.enabled else None
        self.start_epoch = 0
        self.train_images, self.train_seconds = 0, 0.0
        if cfg.resume:
            self.resume(cfg.resume)

    def scaled_lr(self, lr: float) -> float:
        """DeiT's linear rule: ``lr * global_batch / lr_base_size`` (``lr_base_size: null`` = absolute)."""
        base = self.cfg.lr_base_size
        return lr * self.data.train.batch_size / base if base else lr

    def autocast(self):
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

    # ---------------------------------------------------------------- loop
    def fit(self) -> dict[str, Any]:
        best: dict[str, Any] = {}
        final: dict[str, Any] = {}
        for epoch in range(self.start_epoch, self.cfg.epochs):
            train_stats = self.train_one_epoch(epoch)
            row = {"epoch": epoch + 1, "step": (epoch + 1) * self.updates_per_epoch, **train_stats}
            if (epoch + 1) % self.cfg.eval_interval == 0 or epoch + 1 == self.cfg.epochs:
                row.update(self.evaluate(self.model, "val"))
                if self.ema is not None:
                    row.update(self.evaluate(self.ema.module, "ema/val"))
                final = {k: v for k, v in row.items() if "/" in k and not k.startswith("train/")}
                final["epoch"] = epoch + 1
                if not best or final[self.cfg.best_metric] > best[self.cfg.best_metric]:
                    best = dict(final)
                log.info("epoch %d/%d  %s", epoch + 1, self.cfg.epochs,
                         "  ".join(f"{k}={v:.4g}" for k, v in row.items() if isinstance(v, float)))
            self.record.log(row)
            if self.cfg.checkpoint:
                self.save(epoch + 1)
        return {"final": final, "best": best}

    def train_one_epoch(self, epoch: int) -> dict[str, float]:
        self.model.train()
        loss_sum, seen, start = 0.0, 0, time.perf_counter()
        bar = tqdm(self.data.train, desc=f"train {epoch + 1}/{self.cfg.epochs}", disable=not self.progress,
                   leave=False)
        for i, (images, targets) in enumerate(bar):
            step = epoch * self.updates_per_epoch + i
            images, targets = to_device(images, self.device), to_device(targets, self.device)
            loss = self.compute_loss(images, targets)
            if not math.isfinite(loss.item()):
                raise FloatingPointError(f"loss is {loss.item()} at epoch {epoch + 1}, step {step}")
            self.optimizer.zero_grad(set_to_none=True)
            if self.scaler is not None:
                self.scaler.scale(loss).backward()
                self.scaler.unscale_(self.optimizer)
            else:
                loss.backward()
            if self.cfg.clip_grad:
                dispatch_clip_grad(self.model.parameters(), self.cfg.clip_grad, mode=self.cfg.clip_mode)
            if self.scaler is not None:
                self.scaler.step(self.optimizer)
                self.scaler.update()
            else:
                self.optimizer.step()
            self.scheduler.step_update(step + 1)
            if self.ema is not None:
                self.ema.update(self.model, step=step)
            loss_sum += loss.item() * len(images)
            seen += len(images)
            lr = self.optimizer.param_groups[0]["lr"]
            bar.set_postfix(loss=f"{loss.item():.3f}", lr=f"{lr:.2e}")
            if self.cfg.log_interval and (step + 1) % self.cfg.log_interval == 0:
                self.record.log({"step": step + 1, "epoch": epoch + 1, "train/loss": loss.item(), "lr": lr})
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        self.train_images += seen
        self.train_seconds += seconds
        return {"train/loss": loss_sum / seen, "train/images_per_s": seen / seconds,
                "lr": self.optimizer.param_groups[0]["lr"]}

    def compute_loss(self, images: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The training loss of one batch (tasks with other models override this and ``evaluate``)."""
        if self.mixup is not None:
            images, targets = self.mixup(images, targets)
        with self.autocast():
            return self.train_loss(self.model(images), targets)

    @torch.no_grad()
    def evaluate(self, model: nn.Module, prefix: str) -> dict[str, float]:
        model.eval()
        criterion = nn.CrossEntropyLoss(reduction="sum")
        loss_sum, correct1, correct5, seen = 0.0, 0, 0, 0
        topk = (1, min(5, self.data.num_classes))
        for images, targets in tqdm(self.data.val, desc=prefix, disable=not self.progress, leave=False):
            images = images.to(self.device, non_blocking=True)
            targets = targets.to(self.device, non_blocking=True)
            with self.autocast():
                logits = model(images)
            loss_sum += criterion(logits.float(), targets).item()
            hits = logits.topk(max(topk), dim=1).indices == targets[:, None]  # exact counts, no rounding
            correct1 += hits[:, : topk[0]].any(dim=1).sum().item()
            correct5 += hits[:, : topk[1]].any(dim=1).sum().item()
            seen += images.shape[0]
        return {f"{prefix}/loss": loss_sum / seen, f"{prefix}/top1": 100 * correct1 / seen,
                f"{prefix}/top5": 100 * correct5 / seen}

    @property
    def images_per_s(self) -> float:
        return self.train_images / self.train_seconds if self.train_seconds else float("nan")

    # ---------------------------------------------------------------- state
    def save(self, epoch: int) -> None:
        save_checkpoint(self.record.checkpoint_path, {
            "epoch": epoch,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "ema": self.ema.module.state_dict() if self.ema is not None else None,
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "config": self.record.config,
            "rng": {  # so a resumed run continues exactly as an uninterrupted one
                "torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
                "numpy": np.random.get_state(),
                "python": random.getstate(),
                "loader": self.data.train.generator.get_state() if self.data.train.generator else None,
            },
        })

    def resume(self, source: str) -> None:
        state = load_checkpoint(source)
        load_model_state(self.model, state["model"], source)
        self.optimizer.load_state_dict(state["optimizer"])
        if self.ema is not None and state.get("ema") is not None:
            self.ema.module.load_state_dict(state["ema"])
        if self.scaler is not None and state.get("scaler") is not None:
            self.scaler.load_state_dict(state["scaler"])
        self.start_epoch = state["epoch"]
        # The schedule comes from the current config (as timm does), so a resumed run may extend epochs.
        self.scheduler.step_update(self.start_epoch * self.updates_per_epoch)
        rng = state["rng"]
        torch.set_rng_state(rng["torch"])
        if rng["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
        np.random.set_state(rng["numpy"])
        random.setstate(rng["python"])
        if rng["loader"] is not None and self.data.train.generator is not None:
            self.data.train.generator.set_state(rng["loader"])
        log.info("resumed from %s at epoch %d", source, self.start_epoch)
