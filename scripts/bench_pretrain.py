"""Throughput of a pre-training step (MAE, DINO) against a supervised step of the same ViT, in one run.

Each case is one whole training step on a fixed synthetic batch -- forward, loss, backward, optimizer step
(AdamW), and for DINO the teacher's forward and EMA update -- of a model built as a run builds it (the
tasks' own builders over configs composed from ``configs/``: ``experiment=mae_pretrain``,
``experiment=dino_vitb16``), so the normalizer sits in every slot as in training. Cases run in interleaved
rounds (each once per round, so a slow spell of a shared machine hits all of them); a case's time is the
median over rounds of its median step.

* ``supervised <backbone> ln``: a classification step (label smoothing 0.1) of the backbone with LN;
* ``mae <norm>``: MAE's step (mask ratio 0.75: the encoder sees a quarter of the patches) -- images/s against
  the supervised step (target: at least 2.5x);
* ``dino <norm>``: DINO's step on 2 global views and ``--local-crops`` local ones (96 px at 224).

Example (what ``make bench`` runs):

    python scripts/bench_pretrain.py --backbone vit_base --norms ln dyt dtn --batch 4 --rounds 2
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from hydra import compose
from omegaconf import DictConfig
from timm.optim import create_optimizer_v2
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_norms import cpu_name  # noqa: E402

from normexp.code_defaults import config_tree  # noqa: E402
from normexp.models import build_backbone  # noqa: E402
from normexp.norms import kernels  # noqa: E402
from normexp.tasks.dino import DINOLoss, build_network  # noqa: E402
from normexp.tasks.mae import build_mae  # noqa: E402

kernels.COMPILE_AFTER_CALLS = 0  # the steady state of a long run: fused kernels from the first (warm-up) step
MAE_TARGET = 2.5  # MAE's images/s over the supervised step's, at least


def compose_cfg(*overrides: str) -> DictConfig:
    with config_tree():
        return compose(config_name="train", overrides=list(overrides))


def optimizer_of(model: nn.Module) -> torch.optim.Optimizer:
    return create_optimizer_v2(model, opt="adamw", lr=1e-4, weight_decay=0.05)


def supervised_step(cfg: DictConfig, batch: int, device: torch.device) -> Callable[[], None]:
    model = build_backbone(cfg.backbone, cfg.norm).to(device).train()
    optimizer, loss_fn = optimizer_of(model), nn.CrossEntropyLoss(label_smoothing=0.1)
    size = cfg.data.img_size
    images, targets = torch.randn(batch, 3, size, size, device=device), torch.randint(0, 1000, (batch,),
                                                                                     device=device)

    def step() -> None:
        loss = loss_fn(model(images), targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return step


def mae_step(cfg: DictConfig, batch: int, device: torch.device) -> Callable[[], None]:
    model = build_mae(cfg).to(device).train()
    optimizer = optimizer_of(model)
    size = cfg.data.img_size
    images = torch.randn(batch, 3, size, size, device=device)

    def step() -> None:
        loss = model(images)[0]
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return step


def dino_step(cfg: DictConfig, batch: int, device: torch.device) -> Callable[[], None]:
    student, teacher = build_network(cfg).to(device).train(), build_network(cfg, drop_path=False).to(device)
    teacher.load_state_dict(student.state_dict())
    teacher.requires_grad_(False)
    optimizer = optimizer_of(student)
    t = cfg.task
    loss_fn = DINOLoss(t.out_dim, 2 + t.local_crops).to(device)
    size = cfg.data.img_size
    views = [torch.randn(batch, 3, size, size, device=device) for _ in range(2)] + \
        [torch.randn(batch, 3, t.local_size, t.local_size, device=device) for _ in range(t.local_crops)]

    def step() -> None:
        with torch.no_grad():
            target = teacher(views[:2])
        loss = loss_fn(student(views), target, 0.04)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        with torch.no_grad():
            for s, p in zip(student.parameters(), teacher.parameters(), strict=True):
                p.mul_(0.996).add_(s.detach(), alpha=0.004)
    return step


def timed(step: Callable[[], None], steps: int, device: torch.device) -> float:
    times = []
    for _ in range(steps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def interleaved(cases: dict[str, Callable[[], None]], warmup: int, steps: int, rounds: int,
                device: torch.device) -> dict[str, float]:
    """Each case's seconds per step: warmed up, then ``rounds`` rounds of ``steps`` steps of every case in
    turn (a slow spell of a shared machine hits all of them), the median over rounds of each round's
    median."""
    for step in cases.values():
        timed(step, warmup, device)
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, step in cases.items():
            times[name].append(timed(step, steps, device))
    return {name: statistics.median(values) for name, values in times.items()}


def report_header(title: str, script: str, device: torch.device) -> list[str]:
    gpu = f", {torch.cuda.get_device_name(device)}" if device.type == "cuda" else ""
    return [f"# {title} (scripts/{script})", "",
            f"- machine: {cpu_name()}, {torch.get_num_threads()} torch threads, "
            f"{platform.platform(terse=True)}{gpu}",
            f"- versions: torch {torch.__version__}",
            f"- command: `scripts/{script} {' '.join(sys.argv[1:])}`"]


def write_report(lines: list[str], out: Path | None) -> None:
    text = "\n".join(lines) + "\n"
    print(text)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backbone", default="vit_base")
    parser.add_argument("--norms", nargs="+", default=["ln", "dyt", "dtn"])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--local-crops", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    common = [f"backbone={args.backbone}", "logger=none"]
    cases: dict[str, Callable[[], None]] = {
        f"supervised {args.backbone} ln": supervised_step(
            compose_cfg("data=imagenet", *common, "backbone.drop_path_rate=0.0"), args.batch, device)}
    for norm in args.norms:
        cases[f"mae {norm}"] = mae_step(compose_cfg("experiment=mae_pretrain", *common, f"norm={norm}"),
                                        args.batch, device)
    for norm in args.norms:
        cases[f"dino {norm}"] = dino_step(compose_cfg("experiment=dino_vitb16", *common, f"norm={norm}",
                                                      f"task.local_crops={args.local_crops}"), args.batch,
                                          device)
    seconds = interleaved(cases, args.warmup, args.steps, args.rounds, device)
    supervised = seconds[f"supervised {args.backbone} ln"]
    lines = [
        *report_header("Pre-training step benchmark", "bench_pretrain.py", device),
        f"- step: batch {args.batch}, 224 px, fp32, device {device}; DINO: 2 x 224 + {args.local_crops} x 96 "
        f"px views; warm-up {args.warmup}, {args.rounds} interleaved rounds of {args.steps} steps, median",
        "",
        "| case | step ms | images/s | ratio | target |", "|---|---|---|---|---|"]
    for name, s in seconds.items():
        ratio = target = ""
        if name.startswith("mae"):
            ratio = f"{supervised / s:.2f}x the supervised images/s"
            target = f"{'pass' if supervised / s >= MAE_TARGET else 'FAIL'} (>={MAE_TARGET}x)"
        elif name.startswith("dino"):
            ratio = f"{supervised / s:.2f}x the supervised images/s"
        norm = name.split()[-1]
        if norm != "ln" and not name.startswith("supervised"):
            ratio += f"; {s / seconds[name.rsplit(' ', 1)[0] + ' ln']:.2f}x its ln time"
        lines.append(f"| {name} | {1000 * s:.0f} | {args.batch / s:.2f} | {ratio} | {target} |")
    write_report(lines, args.out)


if __name__ == "__main__":
    main()
