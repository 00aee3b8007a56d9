"""Throughput and peak memory of a whole training step, with references measured in the same run.

timm ``benchmark.py`` style: synthetic inputs, warm-up steps, then interleaved rounds (every case once per
round, so that a slow spell of a shared machine hits all of them) and the median over rounds. A step is
forward, loss, backward and optimizer step -- the trainer's optimizer (``trainer.opt`` ...) and loss
(label smoothing), nothing else. Models are built exactly as a run builds them (``build_backbone`` on configs
composed from ``configs/``), so norm placement and context are those of training.

Cases (all in one run):

* ``timm`` -- the same architecture from timm with its own LayerNorm (e.g. ``vit_small_patch16_224`` for
  ``vit_small``), same drop path;
* ``ours <norm>`` for each ``--norms`` (``ln`` always included): our model with that normalizer;
* ``--layout``: the DTN code's layout (``vit_small_star``: DTN in blocks 0-9, class token joined late) with
  DTN and the same model with LN;
* the trainer: our real ``normexp.tasks.classification.ClassificationTrainer`` training ``--trainer-steps``
  steps of an in-memory synthetic dataset vs a minimal loop over the same batches (same model, optimizer and
  loss).

Memory: the peak of tensor memory allocated during one step (activations, gradients, temporaries) above the
model and optimizer state it starts from (gradients cleared first) -- CUDA:
``torch.cuda.max_memory_allocated``; CPU: the running sum of the CPU allocator's allocations and frees
recorded by ``torch.profiler(profile_memory=True)`` over the step (tensor memory only, not the process RSS).

Ratios are printed against the project's targets (docs/benchmarks.md); on a shared machine they are noisy
(re-run on a quiet one). Example:

    python scripts/bench_train.py --backbone vit_small --norms ln dyt dtn --batch 8 --rounds 3
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import timm
import torch
from hydra import compose
from omegaconf import DictConfig, OmegaConf, open_dict
from timm.loss import LabelSmoothingCrossEntropy
from timm.optim import create_optimizer_v2
from torch import nn
from torch.profiler import ProfilerActivity, profile
from torch.utils.data import DataLoader, TensorDataset

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from normexp.code_defaults import config_tree  # noqa: E402
from normexp.data.loaders import ClassificationData  # noqa: E402
from normexp.models import build_backbone  # noqa: E402
from normexp.norms import kernels  # noqa: E402
from normexp.tasks.classification import ClassificationTrainer  # noqa: E402
from normexp.tracking.records import RunRecord  # noqa: E402

sys.path.insert(0, str(ROOT / "scripts"))
from bench_norms import cpu_name  # noqa: E402

kernels.COMPILE_AFTER_CALLS = 0  # the steady state of a long run: fused kernels from the first step

# our backbone -> timm's model of the same architecture (with its own LayerNorm)
TIMM_EQUIVALENT = {
    "vit_tiny": "vit_tiny_patch16_224", "vit_small": "vit_small_patch16_224",
    "vit_base": "vit_base_patch16_224",
    "swin_tiny": "swin_tiny_patch4_window7_224", "swin_small": "swin_small_patch4_window7_224",
    "swin_base": "swin_base_patch4_window7_224", "pvt_v2_b0": "pvt_v2_b0", "pvt_v2_b1": "pvt_v2_b1",
    "pvt_v2_b2": "pvt_v2_b2",
}
# max step-time ratio to LN
NORM_TARGETS = {"dyt": 1.00, "dtn": 1.15}
LAYOUT_TARGET, TIMM_TARGET, TRAINER_TARGET = 1.15, 0.98, 0.97
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def compose_cfg(*overrides: str) -> DictConfig:
    with config_tree():
        return compose(config_name="train", overrides=list(overrides))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Case:
    name: str
    model: nn.Module
    group: str  # "norm" (ours, vs ours LN), "timm", "layout"
    times: list[float] = field(default_factory=list)  # median seconds per step, one per round
    peak_mb: float = float("nan")

    @property
    def step_s(self) -> float:
        return statistics.median(self.times)


class StepRunner:
    """One training step of a model on a fixed synthetic batch: what the trainer does, without the rest."""

    def __init__(self, model: nn.Module, trainer_cfg: DictConfig, batch: tuple[torch.Tensor, torch.Tensor],
                 precision: str, device: torch.device) -> None:
        self.model, self.device = model.to(device).train(), device
        self.images, self.targets = (t.to(device) for t in batch)
        params = model.parameters() if trainer_cfg.decay_norm_and_bias else model
        self.optimizer = create_optimizer_v2(params, opt=trainer_cfg.opt, lr=trainer_cfg.lr,
                                             weight_decay=trainer_cfg.weight_decay, eps=trainer_cfg.opt_eps,
                                             betas=tuple(trainer_cfg.betas))
        self.loss = (LabelSmoothingCrossEntropy(trainer_cfg.smoothing) if trainer_cfg.smoothing > 0
                     else nn.CrossEntropyLoss())
        self.amp = PRECISIONS[precision]
        self.scaler = torch.amp.GradScaler(device.type) if self.amp is torch.float16 else None

    def __call__(self) -> None:
        autocast = torch.autocast(self.device.type, dtype=self.amp) if self.amp else contextlib.nullcontext()
        with autocast:
            loss = self.loss(self.model(self.images), self.targets)
        self.optimizer.zero_grad(set_to_none=True)
        if self.scaler is None:
            loss.backward()
            self.optimizer.step()
        else:
            self.scaler.scale(loss).backward()
            self.scaler.step(self.optimizer)
            self.scaler.update()


def time_steps(step: Callable[[], None], steps: int, device: torch.device) -> float:
    """Median seconds per step over ``steps`` consecutive steps."""
    times = []
    for _ in range(steps):
        sync(device)
        start = time.perf_counter()
        step()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def peak_step_memory_mb(step: StepRunner, device: torch.device) -> float:
    """Peak bytes allocated during one step above those allocated before it (see the module docstring)."""
    step.optimizer.zero_grad(set_to_none=True)  # the step starts from parameters and optimizer state alone
    if device.type == "cuda":
        sync(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        sync(device)
        return (torch.cuda.max_memory_allocated(device) - base) / 2**20
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    current = peak = 0
    for event in events:
        current += event.nbytes()
        peak = max(peak, current)
    return peak / 2**20


def build(cfg: DictConfig) -> nn.Module:
    torch.manual_seed(0)
    return build_backbone(cfg.backbone, cfg.norm)


def trainer_overhead(cfg: DictConfig, model: nn.Module, images: torch.Tensor, targets: torch.Tensor,
                     rounds: int, device: torch.device) -> tuple[float, float]:
    """Seconds per step of the real Trainer (one epoch over the in-memory batches) and of a minimal loop over
    the same batches with the trainer's own model, optimizer and loss; median over interleaved rounds."""
    batch = cfg.data.batch_size
    with open_dict(cfg):
        cfg.trainer.device = device.type
    train = DataLoader(TensorDataset(images, targets), batch_size=batch, shuffle=True, drop_last=True,
                       generator=torch.Generator().manual_seed(0))
    data = ClassificationData(train=train, val=DataLoader(TensorDataset(images[:batch], targets[:batch]),
                                                          batch_size=batch),
                              num_classes=cfg.data.num_classes, img_size=images.shape[-1], in_chans=3)
    with tempfile.TemporaryDirectory() as run_dir:
        record = RunRecord(run_dir, OmegaConf.to_container(cfg, resolve=True))
        trainer = ClassificationTrainer(cfg.trainer, model, data, record)
        batches = [(x.to(device), y.to(device)) for x, y in train]

        def minimal_epoch(_epoch: int) -> None:
            trainer.model.train()
            for x, y in batches:
                loss = trainer.train_loss(trainer.model(x), y)
                trainer.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                trainer.optimizer.step()

        minimal_epoch(0)  # warm-up (and any compilation) for both
        trainer.train_one_epoch(0)
        mine, theirs = [], []
        for epoch in range(1, rounds + 1):
            for run, out in ((minimal_epoch, mine), (trainer.train_one_epoch, theirs)):
                sync(device)
                start = time.perf_counter()
                run(epoch)
                sync(device)
                out.append((time.perf_counter() - start) / len(batches))
    return statistics.median(theirs), statistics.median(mine)


def verdict(ratio: float, target: float, higher_is_better: bool = False) -> str:
    ok = ratio >= target if higher_is_better else ratio <= target
    return f"{'pass' if ok else 'FAIL'} ({'>=' if higher_is_better else '<='}{target:.2f}x)"


def header(args: argparse.Namespace, device: torch.device) -> list[str]:
    machine = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    return [f"- machine: {machine}, {torch.get_num_threads()} torch threads, {platform.platform()}",
            f"- versions: python {platform.python_version()}, torch {torch.__version__}, "
            f"timm {timm.__version__}",
            f"- command: `{' '.join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]])}`",
            f"- step: batch {args.batch}, {args.img_size} px, {args.precision}, device {device}, "
            f"torch.compile {'on' if args.compile else 'off'}; warm-up "
            f"{args.warmup} steps, {args.rounds} interleaved rounds of {args.steps} steps, median"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backbone", default="vit_small")
    parser.add_argument("--norms", nargs="+", default=["ln", "dyt", "dtn"])
    parser.add_argument("--layout", default="vit_small_star",
                        help="backbone whose own layout is compared with DTN vs LN ('none': skip)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--img-size", type=int, default=224)
    parser.add_argument("--num-classes", type=int, default=1000)
    parser.add_argument("--precision", default="fp32", choices=list(PRECISIONS))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per case and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--trainer-steps", type=int, default=4, help="0: skip the trainer-overhead ratio")
    parser.add_argument("--no-timm", action="store_true")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile every model's training step (as trainer.compile=true does)")
    parser.add_argument("--out", type=Path, default=None, help="also write the tables to this markdown file")
    parser.add_argument("--json", type=Path, default=None, help="also write the cases' figures to this file")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    common = ["logger=none", "trainer.progress=false", "trainer.checkpoint=false", "trainer.warmup_epochs=0",
              f"data.img_size={args.img_size}", f"data.num_classes={args.num_classes}",
              f"data.batch_size={args.batch}"]

    def cfg_for(backbone: str, norm: str) -> DictConfig:
        return compose_cfg(f"backbone={backbone}", f"norm={norm}", *common)

    norms = ["ln", *[n for n in args.norms if n != "ln"]]
    cases = [Case(f"ours {n}", build(cfg_for(args.backbone, n)), "norm") for n in norms]
    if not args.no_timm and args.backbone in TIMM_EQUIVALENT:
        cfg = cfg_for(args.backbone, "ln")
        torch.manual_seed(0)
        ref = timm.create_model(TIMM_EQUIVALENT[args.backbone], num_classes=args.num_classes,
                                img_size=args.img_size, drop_path_rate=cfg.backbone.drop_path_rate)
        cases.insert(0, Case(f"timm {TIMM_EQUIVALENT[args.backbone]}", ref, "timm"))
    if args.layout != "none":
        cases += [Case(f"{args.layout} {n}", build(cfg_for(args.layout, n)), "layout") for n in ("ln", "dtn")]

    trainer_cfg = cfg_for(args.backbone, "ln").trainer
    gen = torch.Generator().manual_seed(0)
    batch = (torch.randn(args.batch, 3, args.img_size, args.img_size, generator=gen),
             torch.randint(0, args.num_classes, (args.batch,), generator=gen))
    if args.compile:
        for case in cases:
            case.model = torch.compile(case.model)
    runners = {c.name: StepRunner(c.model, trainer_cfg, batch, args.precision, device) for c in cases}
    print("\n".join(header(args, device)), flush=True)
    for case in cases:  # warm-up (compiles any fused kernels), then the step's peak memory
        start = time.perf_counter()
        for _ in range(args.warmup):
            runners[case.name]()
        case.peak_mb = peak_step_memory_mb(runners[case.name], device)
        print(f"warm-up {case.name}: {time.perf_counter() - start:.1f}s", flush=True)
    for r in range(args.rounds):
        for case in cases:
            case.times.append(time_steps(runners[case.name], args.steps, device))
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{c.name} {c.times[-1]:.3f}s" for c in cases),
              flush=True)

    lines = [*header(args, device), "",
             "| case | step ms | images/s | peak step memory MB | ratio | target |",
             "|---|---|---|---|---|---|"]
    ln = next(c for c in cases if c.name == "ours ln")
    for case in cases:
        ratio, target = "", ""
        if case.group == "norm" and case is not ln:
            ratio = f"{case.step_s / ln.step_s:.3f}x ours ln time"
            norm = case.name.split()[-1]
            target = verdict(case.step_s / ln.step_s, NORM_TARGETS[norm]) if norm in NORM_TARGETS else ""
        elif case.group == "timm":
            ratio = f"ours ln: {case.step_s / ln.step_s:.3f}x its images/s"
            target = verdict(case.step_s / ln.step_s, TIMM_TARGET, higher_is_better=True)
        elif case.group == "layout" and case.name.endswith("dtn"):
            base = next(c for c in cases if c.group == "layout" and c.name.endswith("ln"))
            ratio = f"{case.step_s / base.step_s:.3f}x {base.name} time"
            target = verdict(case.step_s / base.step_s, LAYOUT_TARGET)
        lines.append(f"| {case.name} | {case.step_s * 1e3:.0f} | {args.batch / case.step_s:.2f} | "
                     f"{case.peak_mb:.0f} | {ratio} | {target} |")
    if args.trainer_steps > 0:
        cfg = cfg_for(args.backbone, "ln")
        with open_dict(cfg):
            cfg.trainer.compile = args.compile
        n = args.trainer_steps * args.batch
        images = torch.randn(n, 3, args.img_size, args.img_size, generator=gen)
        targets = torch.randint(0, args.num_classes, (n,), generator=gen)
        model = copy.deepcopy(getattr(ln.model, "_orig_mod", ln.model))
        trainer_s, minimal_s = trainer_overhead(cfg, model, images, targets, args.rounds, device)
        ratio = minimal_s / trainer_s
        lines += ["", f"Trainer ({args.backbone}, ln, {args.trainer_steps} steps per epoch, {args.rounds} "
                  f"interleaved epochs, median): {trainer_s * 1e3:.0f} ms/step vs minimal loop "
                  f"{minimal_s * 1e3:.0f} ms/step: trainer at {ratio:.3f}x the minimal loop's images/s, "
                  f"{verdict(ratio, TRAINER_TARGET, higher_is_better=True)}"]
    print("\n" + "\n".join(lines[len(header(args, device)):]))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        title = "# Training-step benchmark (scripts/bench_train.py)\n\n"
        args.out.write_text(title + "\n".join(lines) + "\n")
        print(f"wrote {args.out}")
    if args.json:
        cases_json = [{"name": c.name, "step_s": c.step_s, "images_per_s": args.batch / c.step_s,
                       "peak_mb": c.peak_mb} for c in cases]
        args.json.write_text(json.dumps({"batch": args.batch, "cases": cases_json}, indent=1))


if __name__ == "__main__":
    main()
