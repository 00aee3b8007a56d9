"""Train every family's micro member with each normalizer on the digits demo and tabulate the records.

Each run is the demo itself (``python -m normexp backbone=<micro> norm=<norm> logger=none``, 30 epochs),
launched one after another so their timings do not disturb each other; the table is read back from the
run records (summary.json), never from the console. ``--grid`` sweeps recipe settings and ``--seeds``
repeats each setting: the table gives each setting's mean top-1 and its 95 % t interval over the seeds
(how the laptop scale's per-family recipes were chosen, ``configs/scale/laptop.yaml``).

    python scripts/micro_sweep.py                      # every *_micro backbone x ln, dtn, dyt (+ BN nets' bn)
    python scripts/micro_sweep.py --backbones swin_micro --norms ln dyt
    python scripts/micro_sweep.py --backbones vit_micro --norms ln --seeds 0 1 2 \\
        --grid trainer.epochs=30,60 trainer.lr=1e-3,2e-3 --table results/bench/laptop_sweep.md
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from normexp.tables.stats import t_interval  # noqa: E402

EXTRA = [("levit_micro", "bn"), ("resnet50_micro", "bn"), ("vgg19_bn_micro", "bn")]  # as published (BN)


def micro_backbones() -> list[str]:
    return sorted(p.stem for p in (ROOT / "configs" / "backbone").glob("*_micro.yaml"))


def grid_settings(grid: list[str]) -> list[list[str]]:
    """``["trainer.epochs=30,60", "trainer.lr=1e-3,2e-3"]`` -> every combination, as override lists."""
    axes = [[f"{key}={v}" for v in values.split(",")] for key, _, values in (g.partition("=") for g in grid)]
    return [list(combo) for combo in itertools.product(*axes)]


def run_one(backbone: str, norm: str, seed: int, setting: list[str], output_root: Path,
            overrides: list[str]) -> dict:
    name = "-".join([backbone, norm, *(s.replace("=", "") for s in setting), f"s{seed}"])
    cmd = [sys.executable, "-m", "normexp", f"backbone={backbone}", f"norm={norm}", f"seed={seed}",
           "logger=none", "trainer.progress=false", *setting, *overrides]
    start = time.time()  # each run under a root of its own: its record is the one directory there
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "NORMEXP_OUTPUT_DIR": str(output_root / name)})
    wall = time.time() - start
    summary_path = next((output_root / name).glob("*/*/summary.json"), output_root / name / "none")
    run_dir = summary_path.parent
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    if proc.returncode != 0:
        print(proc.stderr[-2000:], file=sys.stderr)
    final = summary.get("metrics", {}).get("final", {})
    return {"backbone": backbone, "norm": norm, "setting": " ".join(setting), "seed": seed,
            "status": summary.get("status", "failed"), "top1": final.get("val/top1"),
            "process_wall_s": round(wall, 1), "images_per_s": summary.get("images_per_s"),
            "params": summary.get("params"), "run_dir": str(run_dir)}


def summarize(runs: list[dict], target: float, budget: float) -> dict:
    """One setting's runs (its seeds): mean top-1 and its t interval, mean wall, whether it meets the
    target within the budget."""
    top1 = [r["top1"] for r in runs if r["top1"] is not None]
    interval = t_interval(top1)
    wall = statistics.fmean(r["process_wall_s"] for r in runs)
    meets = len(top1) == len(runs) and interval is not None and interval.estimate >= target and wall <= budget
    return {**{k: runs[0][k] for k in ("backbone", "norm", "setting", "images_per_s", "params")},
            "n": len(top1), "top1": interval, "wall": round(wall, 1), "meets_target": meets}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backbones", nargs="+", default=None, help="default: every *_micro backbone")
    parser.add_argument("--norms", nargs="+", default=["ln", "dtn", "dyt"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--grid", nargs="+", default=[], metavar="KEY=V1,V2",
                        help="recipe settings to sweep (every combination)")
    parser.add_argument("--target", type=float, default=80.0, help="top-1 target (%%)")
    parser.add_argument("--budget", type=float, default=300.0, help="wall-time budget per run (s)")
    parser.add_argument("--output", type=Path, default=ROOT / "outputs" / "micro_sweep")
    parser.add_argument("--table", type=Path, default=ROOT / "results" / "micro_sweep.md")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run")
    args = parser.parse_args()

    backbones = args.backbones or micro_backbones()
    pairs = [(b, n) for b in backbones for n in args.norms]
    pairs += [p for p in EXTRA if p[0] in backbones and p not in pairs and args.backbones is None]
    rows = []
    for (backbone, norm), setting in itertools.product(pairs, grid_settings(args.grid)):
        runs = []
        for seed in args.seeds:
            runs.append(run_one(backbone, norm, seed, setting, args.output, args.overrides))
            print(json.dumps(runs[-1]), flush=True)
        rows.append(summarize(runs, args.target, args.budget))

    lines = [f"| backbone | norm | setting | top-1 (%) | n | wall (s) | images/s | params | "
             f">= {args.target:g} % in <= {args.budget:g} s |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        i = r["top1"]
        top1 = "-" if i is None else f"{i.estimate:.2f}"
        top1 += f" ± {i.half_width:.2f}" if i is not None and i.has_interval else ""
        meets = "yes" if r["meets_target"] else "NO"
        lines.append(f"| {r['backbone']} | {r['norm']} | {r['setting'] or 'demo'} | {top1} | {r['n']} | "
                     f"{r['wall']} | {r['images_per_s']} | {r['params']} | {meets} |")
    table = "\n".join(lines)
    print(table)
    args.table.parent.mkdir(parents=True, exist_ok=True)
    grid = f", grid {' '.join(args.grid)}" if args.grid else ""
    header = (f"Micro members on the digits demo (30 epochs unless the grid says, seeds "
              f"{','.join(map(str, args.seeds))}{grid}; top-1: mean ± the half-width of its 95 % t interval "
              f"over the seeds; wall: mean per run), `python scripts/micro_sweep.py`, {os.cpu_count()} CPU "
              f"cores, {time.strftime('%Y-%m-%d')}.\n\n")
    args.table.write_text(header + table + "\n")
    sys.exit(0 if all(r["meets_target"] for r in rows) else 1)


if __name__ == "__main__":
    main()
