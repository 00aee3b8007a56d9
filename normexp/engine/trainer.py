"""The one training loop (DeiT's engine.py, timm's train.py): fit = train_one_epoch + evaluate, for one
process or many.

Uses timm's utilities rather than re-writing them: optimizer factory (no weight decay on 1-D params, biases
and the model's ``no_weight_decay()`` names), cosine, multi-step or step schedule with linear warm-up (stepped
per update or per epoch, as each recipe's code does), model EMA, gradient clipping. A task subclasses the
trainer with its loss and its evaluation (``tasks/classification.py``, ``tasks/detection.py``).

Distributed (torchrun / SLURM, see ``distributed.py``): the model is wrapped in DDP (with ``trainer.sync_bn``,
BatchNorm layers become SyncBatchNorm first), every process trains on its shard of each global batch, and only
process 0 writes the run record, checkpoints and loggers. The global batch is ``data.batch_size`` x processes
x ``trainer.accum_steps`` (or the accumulation that reaches ``trainer.global_batch``: ``batches.py``), and
the learning-rate rule scales by it.

Around the loop: a checkpoint every ``trainer.checkpoint_interval`` updates and at each epoch end
(``state.py``: ``trainer.resume=auto`` continues mid-epoch with the numbers of an uninterrupted run); stop
signals end the run after the update under way and its checkpoint (``signals.py``); the loss stays on the
device and is checked for divergence every ``log_interval`` updates (``divergence.py``).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from typing import Any

import torch
from timm.optim import create_optimizer_v2
from timm.scheduler import create_scheduler_v2
from timm.utils import ModelEmaV3, dispatch_clip_grad
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from .. import distributed, optim  # noqa: F401  (optim: normexp's optimizers in timm's factory)
from ..data.images import unreadable_files
from ..data.loaders import set_epoch
from ..errors import UserError
from ..tracking.provenance import config_hash
from ..tracking.records import RunRecord
from .batches import accumulation_steps, batch_size_of, to_device
from .checkpoint import load_model_state
from .divergence import LossWindow
from .evaluate import show_progress
from .precision import Precision, resolve_device
from .probes import Forward, Probe
from .signals import StopSignals
from .state import read_resume_state, rng_state, save_training_state, set_rng_state, this_process

log = logging.getLogger(__name__)


class Trainer:
    """The loop; a task's subclass says what a batch's loss is (:meth:`compute_loss`) and how the model is
    scored (:meth:`evaluate`), and may keep state of its own in the checkpoint (:meth:`task_state`).
    ``minimized``: the metrics (last path component, e.g. ``loss``) whose best value is the lowest."""

    minimized: tuple[str, ...] = ()

    def __init__(self, cfg: Any, model: nn.Module, data: Any, record: RunRecord,
                 probes: Sequence[Probe] = ()) -> None:
        self.cfg, self.data, self.record = cfg, data, record
        self.probes = list(probes)  # run at each epoch end, their numbers in the epoch's row
        self.dist = distributed.info()
        self.device = resolve_device(cfg.device, self.dist.local_rank)
        self.precision = Precision(cfg.amp, self.device, tf32=cfg.tf32)
        self.progress = show_progress(cfg.progress) and self.dist.is_main
        model = model.to(self.device)
        self.channels_last = cfg.channels_last
        if self.channels_last:  # NHWC activations: faster convolutions on GPUs (timm's --channels-last)
            model = model.to(memory_format=torch.channels_last)
        if self.dist.enabled and cfg.sync_bn and self.device.type == "cuda":
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)  # BN statistics over the global batch
        self.module = model  # the bare model: EMA, checkpoints, evaluation
        self.model = model
        if self.dist.enabled:
            self.model = DistributedDataParallel(
                model, device_ids=[self.device.index] if self.device.type == "cuda" else None,
                find_unused_parameters=cfg.find_unused_parameters)
        if cfg.compile:  # the training step's graph; evaluation and EMA use the module as it is
            self.model = torch.compile(self.model)

        self.accum_steps = accumulation_steps(cfg.get("global_batch"), data.train.batch_size,
                                              self.dist.world_size, cfg.accum_steps)
        sampler = data.train.sampler
        if hasattr(sampler, "update_multiple"):  # epochs of whole updates
            sampler.update_multiple = self.accum_steps
        self.global_batch = data.train.batch_size * self.dist.world_size * self.accum_steps
        self.updates_per_epoch = len(data.train) // self.accum_steps
        if self.updates_per_epoch == 0:
            raise UserError(f"the training set is smaller than one batch ({self.global_batch} images per "
                            "update): lower data.batch_size or trainer.accum_steps")
        record.update(world_size=self.dist.world_size, global_batch=self.global_batch,
                      accum_steps=self.accum_steps, tf32=self.precision.tf32)

        # the module: timm exempts 1-D params, biases and no_weight_decay() names; its parameters: all decay
        params = self.module.parameters() if cfg.decay_norm_and_bias else self.module
        # layer_decay: each parameter's lr scaled by layer_decay^(depth - its layer), timm's
        # param_groups_layer_decay (the layers of MAE's lr_decay.py; docs/self-supervision.md: fine-tuning)
        self.optimizer = create_optimizer_v2(
            params, opt=cfg.opt, lr=self.scaled_lr(cfg.lr) * cfg.lr_factor, weight_decay=cfg.weight_decay,
            eps=cfg.opt_eps, betas=tuple(cfg.betas), layer_decay=cfg.layer_decay,
        )
        self.scheduler = self.build_scheduler()
        self.ema = ModelEmaV3(self.module, decay=cfg.ema.decay, use_warmup=cfg.ema.warmup) \
            if cfg.ema.enabled else None

        # where the loop is: epochs and batches done, the metrics so far, the epoch's running sums
        self.epoch, self.batch, self.update = 0, 0, 0
        self.metrics: dict[str, Any] = {"final": {}, "best": {}}
        self.epoch_loss = torch.zeros((), dtype=torch.float64, device=self.device)
        self.epoch_seen = 0
        self.train_images, self.train_seconds = 0, 0.0
        self.loss_window = LossWindow(self.device, cfg.get("max_loss"))
        self.stop = StopSignals(self.device, cfg.log_interval)

    # ---------------------------------------------------------------- set-up
    def build_scheduler(self) -> Any:
        """timm's scheduler over ``epochs``: the warm-up inside them (timm, DeiT) or before the decay
        (``warmup_prefix``), the last ``cooldown_epochs`` at ``min_lr``; stepped per update or per epoch
        (``sched_on``, see :meth:`step_epoch_schedule`)."""
        cfg = self.cfg
        warmup_epochs = cfg.warmup_iters / self.updates_per_epoch if cfg.warmup_iters else cfg.warmup_epochs
        # timm's num_epochs excludes a warm-up prefix and the cool-down: what is left for the decay
        decay_span = cfg.epochs - cfg.cooldown_epochs - (warmup_epochs if cfg.warmup_prefix else 0)
        decay_args = {"decay_milestones": tuple(cfg.decay_milestones)} if cfg.decay_milestones else {}
        if cfg.get("decay_epochs"):  # sched=step: x decay_rate every decay_epochs (torchvision's StepLR)
            decay_args["decay_epochs"] = cfg.decay_epochs
        scale_ends = cfg.get("lr_scale_warmup_min", True)
        scheduler, _ = create_scheduler_v2(
            self.optimizer, sched=cfg.sched, num_epochs=decay_span, warmup_epochs=warmup_epochs,
            warmup_prefix=cfg.warmup_prefix,
            warmup_lr=self.scaled_lr(cfg.warmup_lr) if scale_ends else cfg.warmup_lr,
            min_lr=self.scaled_lr(cfg.min_lr) if scale_ends else cfg.min_lr,
            decay_rate=cfg.decay_rate, step_on_epochs=cfg.sched_on == "epoch",
            updates_per_epoch=self.updates_per_epoch, **decay_args,
        )
        return scheduler

    def step_epoch_schedule(self, epoch: int) -> None:
        """``sched_on=epoch``: one lr for the whole epoch, the schedule's value for ``epoch - sched_lag``
        (clamped at 0, the scheduler's initial value). timm's train.py (DTN, T2T-ViT) steps the scheduler
        with the next epoch's index after each epoch (lag 0); DeiT's main.py (DeiT, PVT, LeViT) with the
        index of the epoch just finished, so each epoch trains at the previous one's value (lag 1)."""
        if self.cfg.sched_on == "epoch":
            self.scheduler.step(max(epoch - self.cfg.sched_lag, 0))

    def scaled_lr(self, lr: float) -> float:
        """DeiT's linear rule: ``lr * global_batch / lr_base_size`` (``lr_base_size: null`` = absolute)."""
        base = self.cfg.lr_base_size
        return lr * self.global_batch / base if base else lr

    # ---------------------------------------------------------------- checkpoint (``state.py``)
    def state_dict(self) -> dict[str, Any]:
        """Everything :meth:`load_state_dict` restores (a collective: every process contributes its part)."""
        return {
            "run_id": config_hash(self.record.config),
            "epoch": self.epoch, "batch": self.batch, "update": self.update,
            "model": self.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "ema": self.ema.module.state_dict() if self.ema is not None else None,
            "scaler": self.precision.scaler.state_dict() if self.precision.scaler is not None else None,
            "metrics": self.metrics,
            "task": self.task_state(),
            "train_images": self.train_images, "train_seconds": self.train_seconds,
            "config": self.record.config,
            # what each process holds alone, by rank: RNG states, its share of the epoch's loss, the window
            "processes": distributed.all_gather_objects({
                "rng": rng_state(), "epoch_loss": self.epoch_loss.cpu(), "epoch_seen": self.epoch_seen,
                "window": self.loss_window.state_dict()}),
        }

    def load_state_dict(self, state: dict[str, Any], source: str = "checkpoint") -> None:
        """Continue from ``state`` (:meth:`state_dict` of a run, read from ``source``)."""
        load_model_state(self.module, state["model"], source)
        self.optimizer.load_state_dict(state["optimizer"])
        if self.ema is not None and state["ema"] is not None:
            self.ema.module.load_state_dict(state["ema"])
        if self.precision.scaler is not None and state["scaler"] is not None:
            self.precision.scaler.load_state_dict(state["scaler"])
        self.epoch, self.batch, self.update = state["epoch"], state["batch"], state["update"]
        self.scheduler.load_state_dict(state["scheduler"])
        # the schedule comes from the current config (as timm does), so a resumed run may extend epochs;
        # per epoch, fit() sets the epoch's lr before it continues
        if self.cfg.sched_on == "update":
            self.scheduler.step_update(self.update)
        self.metrics = state["metrics"]
        self.load_task_state(state.get("task"))
        self.train_images, self.train_seconds = state["train_images"], state["train_seconds"]
        mine = this_process(state["processes"], self.dist.rank, self.dist.world_size,
                            mid_epoch=bool(self.batch), source=source)
        if mine is not None:
            set_rng_state(mine["rng"])
            self.epoch_loss = mine["epoch_loss"].to(self.device)
            self.epoch_seen = mine["epoch_seen"]
            self.loss_window.load_state_dict(mine["window"])
        log.info("resumed from %s at epoch %d, update %d", source, self.epoch, self.update)

    def save_state(self) -> None:
        """Checkpoint (process 0 writes; every process contributes its RNG state)."""
        save_training_state(self.record.checkpoint_path, self.state_dict(), self.dist.is_main)

    # ---------------------------------------------------------------- loop
    def fit(self) -> dict[str, Any]:
        """Train and evaluate; returns ``{"final": last evaluation, "best": best evaluation}``.

        On divergence :class:`Diverged` propagates with the metrics reached so far (the last finite ones);
        on a stop signal :class:`Interrupted` propagates after the checkpoint is written. Either way the
        record counts the image files the loaders skipped (``data.on_bad_image=skip``).
        """
        resume = read_resume_state(self.record, self.cfg.resume)
        if resume is not None:  # here, once a task's trainer has set up its own state
            self.load_state_dict(*resume)
        try:
            with self.stop:
                while self.epoch < self.cfg.epochs:
                    self.fit_epoch()
        finally:  # also in a record that ends diverged, interrupted or failed
            bad = unreadable_files(loader.dataset for loader in (self.data.train, self.data.val))
            self.record.update(bad_images=len(bad), **({"bad_image_files": bad[:20]} if bad else {}))
        return self.metrics

    def fit_epoch(self) -> None:
        """One epoch: train, evaluate when due, log the epoch's row, checkpoint; stop here when a signal came
        during the epoch."""
        epoch = self.epoch
        self.step_epoch_schedule(epoch)
        train_stats = self.train_one_epoch(epoch)
        row = {"epoch": epoch + 1, "step": self.update, **train_stats}
        for probe in self.probes:  # the trained model's, into the final metrics too (tables read them)
            row.update(probe(self.module, self.data.val, self.probe_forward()))
        if (epoch + 1) % self.cfg.eval_interval == 0 or epoch + 1 == self.cfg.epochs:
            row.update(self.evaluate(self.module, "val"))
            if self.ema is not None:
                row.update(self.evaluate(self.ema.module, "ema/val"))
            final = {k: v for k, v in row.items() if "/" in k and not k.startswith("train/")}
            final["epoch"] = epoch + 1
            best = self.metrics["best"]
            if not best or self.better(final[self.cfg.best_metric], best[self.cfg.best_metric]):
                best = dict(final)
            self.metrics = {"final": final, "best": best, "reported": self.reported(final)}
            log.info("epoch %d/%d  %s", epoch + 1, self.cfg.epochs,
                     "  ".join(f"{k}={v:.4g}" for k, v in row.items() if isinstance(v, float)))
        self.record.log(row)
        self.epoch, self.batch = epoch + 1, 0
        if self.cfg.checkpoint:
            self.save_state()
        if self.epoch < self.cfg.epochs and self.stop.requested(self.update, every_update=True):
            if not self.cfg.checkpoint:
                self.save_state()
            raise self.stop.interrupted(self.update)

    def train_one_epoch(self, epoch: int) -> dict[str, float]:
        self.model.train()
        loader = self.data.train
        set_epoch(loader, epoch, self.batch)
        if self.batch == 0:
            self.epoch_loss.zero_()
            self.epoch_seen = 0
        start, seen_before = time.perf_counter(), self.epoch_seen
        bar = tqdm(loader, desc=f"train {epoch + 1}/{self.cfg.epochs}", disable=not self.progress,
                   leave=False)
        for images, targets in bar:
            last_micro = (self.batch + 1) % self.accum_steps == 0
            images, targets = to_device(images, self.device), to_device(targets, self.device)
            if self.channels_last and isinstance(images, torch.Tensor) and images.dim() == 4:
                images = images.contiguous(memory_format=torch.channels_last)
            sync = contextlib.nullcontext() if last_micro or not self.dist.enabled else self.model.no_sync()
            with sync:
                loss = self.compute_loss(images, targets)
                self.precision.backward(loss / self.accum_steps)
            n = batch_size_of(images)
            self.epoch_loss += loss.detach().double() * n
            self.epoch_seen += n
            self.loss_window.track(loss.detach(), step=self.update + 1)
            self.batch += 1
            if not last_micro:
                continue
            self.optimizer_step()
            if self.cfg.log_interval and self.update % self.cfg.log_interval == 0:
                self.log_window()
            if self.cfg.checkpoint_interval and self.update % self.cfg.checkpoint_interval == 0:
                self.check_divergence()
                self.save_state()
            if self.stop.requested(self.update):
                self.check_divergence()
                self.save_state()
                raise self.stop.interrupted(self.update)
        self.check_divergence()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        seen = (self.epoch_seen - seen_before) * self.dist.world_size
        self.train_images += seen
        self.train_seconds += seconds
        total = distributed.all_reduce_sum(self.epoch_loss.clone())
        return {"train/loss": float(total) / (self.epoch_seen * self.dist.world_size),
                "train/images_per_s": seen / seconds if seconds else float("nan"),
                "lr": self.optimizer.param_groups[0]["lr"]}

    def optimizer_step(self) -> None:
        self.prepare_step()
        self.precision.step(self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        self.update += 1
        if self.cfg.sched_on == "update":
            self.scheduler.step_update(self.update)
        self.after_update()

    def prepare_step(self) -> None:
        """Before update ``self.update`` is applied: the gradients clipped (``trainer.clip_grad``: the global
        norm, each value, AGC -- timm's modes -- or, ``clip_mode=param``, each parameter's norm, as DINO's
        ``utils.clip_gradients``)."""
        if not self.cfg.clip_grad:
            return
        self.precision.unscale(self.optimizer)
        if self.cfg.clip_mode != "param":
            dispatch_clip_grad(self.module.parameters(), self.cfg.clip_grad, mode=self.cfg.clip_mode)
            return
        for parameter in self.module.parameters():
            if parameter.grad is not None:
                coefficient = self.cfg.clip_grad / (parameter.grad.norm(2) + 1e-6)
                parameter.grad.mul_(coefficient.clamp(max=1.0))

    def after_update(self) -> None:
        """After an update: the EMA model follows (``trainer.ema``): from the copy made at the start, at
        ``decay`` from the first update (DiT's ``update_ema``, timm's and DeiT's ``ModelEma``), or with
        ``ema.warmup`` at timm's warm-up decay for the update's number (timm's train.py)."""
        if self.ema is not None:
            self.ema.update(self.module, step=self.update if self.cfg.ema.warmup else None)

    def check_divergence(self) -> None:
        """Stop with :class:`Diverged` if a loss since the last check was not finite (or over max_loss)."""
        self.loss_window.check(self.epoch + 1, self.metrics)

    def log_window(self) -> None:
        """A ``train/loss`` row every ``log_interval`` updates: the mean over the window's global batches."""
        self.check_divergence()
        mean = self.loss_window.mean()
        lr = self.optimizer.param_groups[0]["lr"]
        self.record.log({"step": self.update, "epoch": self.epoch + 1, "train/loss": mean, "lr": lr})
        self.loss_window.reset()

    def better(self, value: float | None, best: float | None) -> bool:
        """Whether ``value`` of ``trainer.best_metric`` beats the best so far (an undefined one, None, never
        does; any defined one beats it)."""
        if value is None or best is None:
            return best is None and value is not None
        lowest = self.cfg.best_metric.rsplit("/", 1)[-1] in self.minimized
        return value < best if lowest else value > best

    # ---------------------------------------------------------------- what a task defines
    def probe_forward(self) -> Forward | None:
        """How a probe's batch of images goes through the model (None: ``model(images)``); no random number
        drawn from the training streams."""
        return None

    def task_state(self) -> dict[str, Any] | None:
        """What the task keeps beyond the model, optimizer and schedule (a teacher, a centre), for the
        checkpoint; restored by :meth:`load_task_state`."""
        return None

    def load_task_state(self, state: dict[str, Any] | None) -> None:
        """Restore what :meth:`task_state` returned."""

    def compute_loss(self, images: Any, targets: Any) -> torch.Tensor:
        """The training loss of one batch, under ``self.precision.autocast()``."""
        raise NotImplementedError

    def evaluate(self, model: nn.Module, prefix: str) -> dict[str, float]:
        """``<prefix>/<metric>`` of ``model`` on the validation data (every process takes part)."""
        raise NotImplementedError

    fit_metric = "loss"  # which of evaluate_train's numbers evaluate_fitting reports

    def evaluate_train(self, model: nn.Module, prefix: str) -> dict[str, float]:
        """``<prefix>/loss`` (and more) of ``model`` on its training data in eval mode (evaluate_fitting)."""
        raise NotImplementedError

    # ---------------------------------------------------------------- results
    def evaluate_fitting(self) -> dict[str, float]:
        """Derf's evaluation-mode training loss (arXiv 2512.10938v2, App. E, Table 13: test-time transform,
        no drop path, Mixup, CutMix or smoothing) of the model and its EMA, into the final metrics
        (``train_eval/``, ``ema/train_eval/``), and the reported weights' as ``reported.train_eval_loss``."""
        scores = self.evaluate_train(self.module, "train_eval")
        if self.ema is not None:
            scores.update(self.evaluate_train(self.ema.module, "ema/train_eval"))
        self.metrics["final"].update(scores)
        prefix = "ema/train_eval/" if self.ema is not None and self.cfg.ema.reported else "train_eval/"
        self.metrics["reported"]["train_eval_loss"] = scores[prefix + self.fit_metric]
        log.info("evaluation-mode training loss: %s", "  ".join(f"{k}={v:.4g}" for k, v in scores.items()))
        return scores

    def reported(self, final: dict[str, Any]) -> dict[str, Any]:
        """The final evaluation of the weights the recipe's paper reports (``trainer.ema.reported``: the EMA
        model's, else the trained model's), under plain names: ``{"weights": "ema", "top1": ...}``."""
        weights = "ema" if self.cfg.ema.reported else "raw"
        prefix = "ema/val/" if weights == "ema" else "val/"
        return {"weights": weights, "epoch": final["epoch"],
                **{k[len(prefix):]: v for k, v in final.items() if k.startswith(prefix)}}

    @property
    def images_per_s(self) -> float:
        return self.train_images / self.train_seconds if self.train_seconds else float("nan")
