"""The one training loop (DeiT/timm style): fit = train_one_epoch + evaluate, for one process or many.

Uses timm's utilities rather than re-writing them: optimizer factory (no weight decay on 1-D params,
biases and the model's ``no_weight_decay()`` names), cosine or multi-step schedule with linear warm-up
(stepped per update or per epoch, as each recipe's code does), Mixup/CutMix, label smoothing, model EMA,
gradient clipping.

Distributed (torchrun / SLURM, see ``distributed.py``): the model is wrapped in DDP (with ``trainer.sync_bn``,
BatchNorm layers become SyncBatchNorm first), every process trains on its shard of each global batch, and only
process 0 writes the run record, checkpoints and loggers. The global batch is ``data.batch_size`` x processes
x ``trainer.accum_steps`` (or, when the recipe states ``trainer.global_batch``, the accumulation that
reaches it), and the learning-rate rule scales by it.

Preemption: a checkpoint is written every ``trainer.checkpoint_interval`` updates and at each epoch end
(model, EMA, optimizer, scheduler, scaler, position in the epoch, every process's RNG states), so
``trainer.resume=auto`` continues a killed run where it stopped, mid-epoch included, with the numbers an
uninterrupted run has. SIGTERM, SIGUSR1 and SIGUSR2 (submitit's preemption signal) and Ctrl-C (SIGINT) let
the current update finish, checkpoint, and then hand over to the handler that was there before
(submitit's requeue), or end the run as ``interrupted``; a second Ctrl-C stops at once.

Divergence: the loss stays on the device; every ``log_interval`` updates, before each checkpoint and at the
end of an epoch it is read once, and a non-finite loss (or one above ``trainer.max_loss``) anywhere in the
window stops the run with the exact step (:class:`Diverged`).
"""

from __future__ import annotations

import contextlib
import logging
import random
import signal
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
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from .. import distributed
from ..data.loaders import set_epoch
from ..errors import Diverged, Interrupted, UserError
from ..tracking.provenance import config_hash
from ..tracking.records import RunRecord
from .alpha_probe import alpha_probe
from .checkpoint import checkpoint_file, load_checkpoint, load_model_state, save_checkpoint
from .evaluate import classification_metrics, count_predictions, show_progress
from .precision import Precision, resolve_device

log = logging.getLogger(__name__)

STOP_SIGNALS = tuple(getattr(signal, s) for s in ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2")
                     if hasattr(signal, s))


class StopSignals:
    """While installed: remember a stop signal instead of dying at once; restore the handlers afterwards."""

    def __init__(self) -> None:
        self.received: int | None = None
        self.previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        with contextlib.suppress(ValueError):  # only the main thread may install handlers
            for signum in STOP_SIGNALS:
                self.previous[signum] = signal.signal(signum, self._note)
        return self

    def _note(self, signum: int, _frame: Any) -> None:
        if signum == signal.SIGINT and self.received == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: at once, without a checkpoint
        hint = " (Ctrl-C again: stop at once, without it)" if signum == signal.SIGINT else ""
        log.warning("%s: stopping after the current update and saving a checkpoint%s",
                    signal.Signals(signum).name, hint)
        self.received = signum

    def __exit__(self, *exc: Any) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)

    def hand_over(self) -> None:
        """After checkpointing: the previous handler, if any, takes the signal (submitit requeues)."""
        handler = self.previous.get(self.received) if self.received is not None else None
        if callable(handler) and handler is not signal.default_int_handler:  # that one only raises Ctrl-C
            handler(self.received, None)


def accumulation_steps(global_batch: int | None, batch_size: int, world_size: int, accum_steps: int) -> int:
    """Micro-batches per update: ``accum_steps``, or -- when a recipe states ``global_batch`` -- the
    accumulation that reaches it with ``batch_size`` images on each of ``world_size`` processes."""
    if not global_batch:
        return int(accum_steps)
    per_step = batch_size * world_size
    procs = f"{world_size} process{'es' if world_size > 1 else ''}"
    if global_batch % per_step:
        if global_batch % world_size:
            raise UserError(f"trainer.global_batch={global_batch} cannot be split over {procs}: run on a "
                            f"number of processes that divides it, or drop it (trainer.global_batch=null)")
        per_process = global_batch // world_size
        fits = max(d for d in range(1, min(batch_size, per_process) + 1) if per_process % d == 0)
        raise UserError(f"trainer.global_batch={global_batch} is not a whole number of steps of "
                        f"data.batch_size={batch_size} on {procs}: use a data.batch_size that divides "
                        f"{per_process} (e.g. data.batch_size={fits}), or drop the recipe's global batch "
                        "(trainer.global_batch=null; trainer.accum_steps then sets the accumulation)")
    steps = global_batch // per_step
    if accum_steps not in (1, steps):
        raise UserError(f"trainer.accum_steps={accum_steps} contradicts trainer.global_batch={global_batch} "
                        f"at {per_step} images per step (it needs {steps}): set only one of them")
    return steps


def to_device(batch: Any, device: torch.device) -> Any:
    """Tensors, or lists / dicts of them (detection targets), on ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


def batch_size_of(batch: Any) -> int:
    return batch.shape[0] if isinstance(batch, torch.Tensor) else len(batch)


def rng_state() -> dict[str, Any]:
    """This process's RNG states as tensors and plain values (loadable with ``weights_only=True``)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {"torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss),
            "python": random.getstate()}


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    keys = keys.numpy() if isinstance(keys, torch.Tensor) else keys
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))


class Trainer:
    def __init__(self, cfg: Any, model: nn.Module, data: Any, record: RunRecord) -> None:
        self.cfg, self.data, self.record = cfg, data, record
        self.dist = distributed.info()
        self.device = resolve_device(cfg.device, self.dist.local_rank)
        self.precision = Precision(cfg.amp, self.device)
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

        self.accum_steps = self.resolve_accumulation()
        sampler = data.train.sampler
        if hasattr(sampler, "update_multiple"):  # epochs of whole updates
            sampler.update_multiple = self.accum_steps
        self.global_batch = data.train.batch_size * self.dist.world_size * self.accum_steps
        self.updates_per_epoch = len(data.train) // self.accum_steps
        if self.updates_per_epoch == 0:
            raise UserError(f"the training set is smaller than one batch ({self.global_batch} images per "
                            "update): lower data.batch_size or trainer.accum_steps")
        record.update(world_size=self.dist.world_size, global_batch=self.global_batch,
                      accum_steps=self.accum_steps)

        # the module: timm exempts 1-D params, biases and no_weight_decay() names; its parameters: all decay
        params = self.module.parameters() if cfg.decay_norm_and_bias else self.module
        self.optimizer = create_optimizer_v2(
            params, opt=cfg.opt, lr=self.scaled_lr(cfg.lr), weight_decay=cfg.weight_decay,
            eps=cfg.opt_eps, betas=tuple(cfg.betas),
        )
        self.scheduler = self.build_scheduler()
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
        self.ema = ModelEmaV3(self.module, decay=cfg.ema.decay, use_warmup=cfg.ema.warmup) \
            if cfg.ema.enabled else None

        # where the loop is: epochs and batches done, the metrics so far, the epoch's running sums
        self.epoch, self.batch, self.update = 0, 0, 0
        self.metrics: dict[str, Any] = {"final": {}, "best": {}}
        self.epoch_loss = torch.zeros((), dtype=torch.float64, device=self.device)
        self.epoch_seen = 0
        self.train_images, self.train_seconds = 0, 0.0
        self._window = self._new_window()
        self.last_finite_loss: dict[str, Any] | None = None
        self.stop = StopSignals()
        self.resume(cfg.resume)

    # ---------------------------------------------------------------- set-up
    def resolve_accumulation(self) -> int:
        """``accum_steps``, or -- when the recipe states ``global_batch`` -- the accumulation reaching it."""
        return accumulation_steps(self.cfg.get("global_batch"), self.data.train.batch_size,
                                  self.dist.world_size, self.cfg.accum_steps)

    def build_scheduler(self) -> Any:
        """timm's scheduler over ``epochs``: the warm-up inside them (timm, DeiT) or before the decay
        (``warmup_prefix``), the last ``cooldown_epochs`` at ``min_lr``; stepped per update or per epoch
        (``sched_on``, see :meth:`step_epoch_schedule`)."""
        cfg = self.cfg
        warmup_epochs = cfg.warmup_iters / self.updates_per_epoch if cfg.warmup_iters else cfg.warmup_epochs
        # timm's num_epochs excludes a warm-up prefix and the cool-down: what is left for the decay
        decay_epochs = cfg.epochs - cfg.cooldown_epochs - (warmup_epochs if cfg.warmup_prefix else 0)
        milestones = {"decay_milestones": tuple(cfg.decay_milestones)} if cfg.decay_milestones else {}
        scale_ends = cfg.get("lr_scale_warmup_min", True)
        scheduler, _ = create_scheduler_v2(
            self.optimizer, sched=cfg.sched, num_epochs=decay_epochs, warmup_epochs=warmup_epochs,
            warmup_prefix=cfg.warmup_prefix,
            warmup_lr=self.scaled_lr(cfg.warmup_lr) if scale_ends else cfg.warmup_lr,
            min_lr=self.scaled_lr(cfg.min_lr) if scale_ends else cfg.min_lr,
            decay_rate=cfg.decay_rate, step_on_epochs=cfg.sched_on == "epoch",
            updates_per_epoch=self.updates_per_epoch, **milestones,
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

    # ---------------------------------------------------------------- loop
    def fit(self) -> dict[str, Any]:
        """Train and evaluate; returns ``{"final": last evaluation, "best": best evaluation}``.

        On divergence :class:`Diverged` propagates with the metrics reached so far (the last finite ones);
        on a stop signal :class:`Interrupted` propagates after the checkpoint is written.
        """
        with self.stop:
            while self.epoch < self.cfg.epochs:
                epoch = self.epoch
                self.step_epoch_schedule(epoch)
                train_stats = self.train_one_epoch(epoch)
                row = {"epoch": epoch + 1, "step": self.update, **train_stats}
                if (epoch + 1) % self.cfg.eval_interval == 0 or epoch + 1 == self.cfg.epochs:
                    row.update(self.evaluate(self.module, "val"))
                    if self.ema is not None:
                        row.update(self.evaluate(self.ema.module, "ema/val"))
                    final = {k: v for k, v in row.items() if "/" in k and not k.startswith("train/")}
                    final["epoch"] = epoch + 1
                    best = self.metrics["best"]
                    if not best or final[self.cfg.best_metric] > best[self.cfg.best_metric]:
                        best = dict(final)
                    self.metrics = {"final": final, "best": best, "reported": self.reported(final)}
                    log.info("epoch %d/%d  %s", epoch + 1, self.cfg.epochs,
                             "  ".join(f"{k}={v:.4g}" for k, v in row.items() if isinstance(v, float)))
                row.update(alpha_probe(self.module, self.data.val))  # DyT's alpha, its input's std: per layer
                self.record.log(row)
                self.epoch, self.batch = epoch + 1, 0
                if self.cfg.checkpoint:
                    self.save()
                if self.epoch < self.cfg.epochs and self.stop_requested(every_update=True):
                    if not self.cfg.checkpoint:
                        self.save()
                    raise Interrupted(self.stop.received or signal.SIGTERM, self.update, self.stop.hand_over)
        return self.metrics

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
            self._track(loss.detach())
            self.batch += 1
            if not last_micro:
                continue
            self.optimizer_step()
            if self.cfg.log_interval and self.update % self.cfg.log_interval == 0:
                self.log_window()
            if self.cfg.checkpoint_interval and self.update % self.cfg.checkpoint_interval == 0:
                self.check_divergence()
                self.save()
            if self.stop_requested():
                self.check_divergence()
                self.save()
                raise Interrupted(self.stop.received or signal.SIGTERM, self.update, self.stop.hand_over)
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
        if self.cfg.clip_grad:
            self.precision.unscale(self.optimizer)
            dispatch_clip_grad(self.module.parameters(), self.cfg.clip_grad, mode=self.cfg.clip_mode)
        self.precision.step(self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        self.update += 1
        if self.cfg.sched_on == "update":
            self.scheduler.step_update(self.update)
        if self.ema is not None:
            self.ema.update(self.module, step=self.update - 1)

    def reported(self, final: dict[str, Any]) -> dict[str, Any]:
        """The final evaluation of the weights the recipe's paper reports (``trainer.ema.reported``: the EMA
        model's, else the trained model's), under plain names: ``{"weights": "ema", "top1": ...}``."""
        weights = "ema" if self.cfg.ema.reported else "raw"
        prefix = "ema/val/" if weights == "ema" else "val/"
        return {"weights": weights, "epoch": final["epoch"],
                **{k[len(prefix):]: v for k, v in final.items() if k.startswith(prefix)}}

    def compute_loss(self, images: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The training loss of one batch (tasks with other models override this and ``evaluate``)."""
        if self.mixup is not None:
            images, targets = self.mixup(images, targets)
        with self.precision.autocast():
            return self.train_loss(self.model(images), targets)

    def stop_requested(self, every_update: bool = False) -> bool:
        """Whether a stop signal arrived: at once for one process; in a distributed job the processes agree
        every ``log_interval`` updates (one small collective then, none per update) and at epoch ends."""
        if not self.dist.enabled:
            return self.stop.received is not None
        if not every_update and self.update % max(self.cfg.log_interval, 1):
            return False
        flag = torch.tensor([float(self.stop.received is not None)], device=self.device)
        return bool(distributed.all_reduce_sum(flag).item())

    # ---------------------------------------------------------------- divergence, without a sync per step
    def _new_window(self) -> dict[str, torch.Tensor]:
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        return {"sum": zero.clone(), "count": zero.clone(), "max": zero.clone(),
                "first_bad": torch.full((), -1, dtype=torch.long, device=self.device),
                "bad_loss": zero.clone(), "last_good": zero.clone(),
                "last_good_step": torch.full((), -1, dtype=torch.long, device=self.device)}

    def _track(self, loss: torch.Tensor) -> None:
        """Fold one micro-batch's loss into the window, on the device (its step: the update it is part of)."""
        w, loss = self._window, loss.double()
        step = self.update + 1
        bad = ~torch.isfinite(loss)
        if self.cfg.get("max_loss") is not None:
            bad |= loss > self.cfg.max_loss
        first = (w["first_bad"] < 0) & bad
        w["first_bad"] = torch.where(first, step, w["first_bad"])
        w["bad_loss"] = torch.where(first, loss, w["bad_loss"])
        ok = ~bad & (w["first_bad"] < 0)
        w["last_good"] = torch.where(ok, loss, w["last_good"])
        w["last_good_step"] = torch.where(ok, step, w["last_good_step"])
        w["sum"] += loss
        w["count"] += 1
        w["max"] = torch.maximum(w["max"], loss)

    def check_divergence(self) -> None:
        """Read the window once; on any process's bad loss, every process stops at the earliest bad step."""
        w = self._window
        first = int(w["first_bad"])
        if self.dist.enabled:
            steps = distributed.all_gather_objects(first)
            first = min((s for s in steps if s >= 0), default=-1)
        if int(w["last_good_step"]) >= 0:
            self.last_finite_loss = {"step": int(w["last_good_step"]), "epoch": self.epoch + 1,
                                     "train/loss": float(w["last_good"])}
        if first >= 0:
            raise Diverged(first, self.epoch + 1, float(w["bad_loss"]), self.metrics, self.last_finite_loss)

    def log_window(self) -> None:
        """A ``train/loss`` row every ``log_interval`` updates: the mean over the window's global batches."""
        self.check_divergence()
        w = self._window
        total = distributed.all_reduce_sum(torch.stack([w["sum"], w["count"]]))
        mean = float(total[0] / total[1]) if float(total[1]) else float("nan")
        lr = self.optimizer.param_groups[0]["lr"]
        self.record.log({"step": self.update, "epoch": self.epoch + 1, "train/loss": mean, "lr": lr})
        self._window = self._new_window()

    # ---------------------------------------------------------------- evaluation
    def evaluate(self, model: nn.Module, prefix: str) -> dict[str, float]:
        topk = (1, min(5, self.data.num_classes))
        counts = count_predictions(model, self.data.val, self.precision, topk=topk, progress=self.progress,
                                   desc=prefix)
        return classification_metrics(counts, ("top1", "top5"), prefix)

    @property
    def images_per_s(self) -> float:
        return self.train_images / self.train_seconds if self.train_seconds else float("nan")

    # ---------------------------------------------------------------- state
    def state(self) -> dict[str, Any]:
        return {
            "run_id": config_hash(self.record.config),
            "epoch": self.epoch, "batch": self.batch, "update": self.update,
            "model": self.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "ema": self.ema.module.state_dict() if self.ema is not None else None,
            "scaler": self.precision.scaler.state_dict() if self.precision.scaler is not None else None,
            "metrics": self.metrics,
            "train_images": self.train_images, "train_seconds": self.train_seconds,
            "config": self.record.config,
            # what each process holds alone, by rank: RNG states, its share of the epoch's loss, the window
            "processes": distributed.all_gather_objects({
                "rng": rng_state(), "epoch_loss": self.epoch_loss.cpu(), "epoch_seen": self.epoch_seen,
                "window": {k: v.cpu() for k, v in self._window.items()}}),
        }

    def save(self) -> None:
        """Checkpoint (process 0 writes; every process contributes its RNG state)."""
        state = self.state()
        if self.dist.is_main:
            save_checkpoint(self.record.checkpoint_path, state)
        distributed.barrier()

    def resume(self, source: str | None) -> None:
        """``auto``: this run directory's checkpoint if there is one; a path: that run's or file's.

        Process 0 continues from the checkpoint ``normexp.run`` already read and verified (the record's
        ``resume_state``) when it decided the start; the other processes read the same file."""
        state = self.record.resume_state
        if state is None:
            if not source:
                return
            if source == "auto":
                if not checkpoint_file(self.record.dir).is_file():
                    return
                source = str(self.record.dir)
            state = load_checkpoint(source)
        source = str(self.record.dir if source == "auto" else source)
        load_model_state(self.module, state["model"], source)
        self.optimizer.load_state_dict(state["optimizer"])
        if self.ema is not None and state.get("ema") is not None:
            self.ema.module.load_state_dict(state["ema"])
        if self.precision.scaler is not None and state.get("scaler") is not None:
            self.precision.scaler.load_state_dict(state["scaler"])
        self.epoch, self.batch = state["epoch"], state.get("batch", 0)
        self.update = state.get("update", self.epoch * self.updates_per_epoch)
        if "scheduler" in state:
            self.scheduler.load_state_dict(state["scheduler"])
        # the schedule comes from the current config (as timm does), so a resumed run may extend epochs;
        # per epoch, fit() sets the epoch's lr before it continues
        if self.cfg.sched_on == "update":
            self.scheduler.step_update(self.update)
        self.metrics = state.get("metrics") or self.metrics
        self.train_images, self.train_seconds = state.get("train_images", 0), state.get("train_seconds", 0.0)
        # checkpoints before "processes" held one RNG state (and only at epoch ends)
        processes = state.get("processes") or [{"rng": state["rng"]}]
        if len(processes) == self.dist.world_size:
            mine = processes[self.dist.rank]
            set_rng_state(mine["rng"])
            self.epoch_loss = mine.get("epoch_loss", self.epoch_loss).to(self.device)
            self.epoch_seen = mine.get("epoch_seen", 0)
            if "window" in mine:
                self._window = {k: v.to(self.device) for k, v in mine["window"].items()}
        elif self.batch:
            raise UserError(f"checkpoint '{source}' stopped mid-epoch with {len(processes)} processes: "
                            f"resume it with {len(processes)} (this job has {self.dist.world_size})")
        else:
            log.warning("checkpoint from %d processes, resumed on %d: RNG streams restart", len(processes),
                        self.dist.world_size)
        log.info("resumed from %s at epoch %d, update %d", source, self.epoch, self.update)
