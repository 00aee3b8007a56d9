#!/usr/bin/env python
"""Throughput of DiT's training step with each normalizer, in one run.

One whole step of task=dit on a fixed synthetic batch of latents -- the diffusion loss at uniformly drawn
steps (MSE + the variational bound), backward, AdamW, the EMA update -- of the model
``experiment=dit_imagenet`` builds (``--backbone``, latents of ``--input-size`` x ``--input-size`` x 4: 32 is
256 px images), with the normalizer in every slot as in training (each with its paper's initialisation).
Cases run in interleaved rounds; a case's time is the median over rounds of its median step. The VAE's
encoding is left out (DiT users cache the latents).

Example (what ``make bench`` runs on the CPU; the GPU check runs it at DiT's size):

    python scripts/bench_dit.py --backbone dit_b4 --norms ln dyt dtn --batch 4 --input-size 16
"""

from __future__ import annotations

import argparse
import copy
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from timm.optim import create_optimizer_v2

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_pretrain import compose_cfg, interleaved, report_header, write_report  # noqa: E402

from normexp.diffusion import GaussianDiffusion  # noqa: E402
from normexp.models import build_backbone  # noqa: E402
from normexp.norms import kernels  # noqa: E402
from normexp.tasks.dit import with_model_input  # noqa: E402

kernels.COMPILE_AFTER_CALLS = 0  # the steady state of a long run: fused kernels from the first (warm-up) step


def dit_step(backbone: str, norm: str, batch: int, input_size: int, device: torch.device,
             amp: str | None = None) -> Callable[[], None]:
    cfg = with_model_input(compose_cfg("experiment=dit_imagenet", f"backbone={backbone}", f"norm={norm}",
                                       "logger=none", f"data.img_size={8 * input_size}"))
    model = build_backbone(cfg.backbone, cfg.norm).to(device).train()
    ema = copy.deepcopy(model).requires_grad_(False)
    optimizer = create_optimizer_v2(model, opt="adamw", lr=4e-4, weight_decay=0.0)
    diffusion = GaussianDiffusion.create(1000)
    latents = torch.randn(batch, 4, input_size, input_size, device=device)
    labels = torch.randint(0, 1000, (batch,), device=device)

    def step() -> None:
        t = torch.randint(0, diffusion.num_steps, (batch,), device=device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp == "bf16"):
            loss = diffusion.training_losses(model, latents, t, y=labels)["loss"].mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        with torch.no_grad():
            torch._foreach_lerp_(list(ema.parameters()), list(model.parameters()), 1 - 0.9999)
    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backbone", default="dit_b4")
    parser.add_argument("--norms", nargs="+", default=["ln", "dyt", "dtn"])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--input-size", type=int, default=16, help="latent size (32: 256 px images)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--amp", choices=["bf16"], default=None, help="autocast (default: fp32, DiT's)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    cases = {norm: dit_step(args.backbone, norm, args.batch, args.input_size, device, args.amp)
             for norm in args.norms}
    seconds = interleaved(cases, args.warmup, args.steps, args.rounds, device)
    first = args.norms[0]
    lines = [
        *report_header("DiT training step benchmark", "bench_dit.py", device),
        f"- step: {args.backbone}, batch {args.batch}, latents {args.input_size}x{args.input_size}x4 "
        f"({8 * args.input_size} px images), {args.amp or 'fp32'}, device {device}; warm-up {args.warmup}, "
        f"{args.rounds} interleaved rounds of {args.steps} steps, median",
        "",
        f"| norm | step ms | images/s | time vs {first} |", "|---|---|---|---|"]
    for name, s in seconds.items():
        lines.append(f"| {name} | {1000 * s:.0f} | {args.batch / s:.2f} | {s / seconds[first]:.2f}x |")
    write_report(lines, args.out)


if __name__ == "__main__":
    main()
