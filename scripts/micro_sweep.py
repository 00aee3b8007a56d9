"""Train every family's micro member with each normalizer on the digits demo and tabulate the records.

Each run is the demo itself (``python -m normexp backbone=<micro> norm=<norm> logger=none``, 30 epochs),
launched one after another so their timings do not disturb each other; the table is read back from the
run records (summary.json), never from the console.

    python scripts/micro_sweep.py                      # every *_micro backbone x ln, dtn, dyt (+ BN nets' bn)
    python scripts/micro_sweep.py --backbones swin_micro --norms ln dyt
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXTRA = [("levit_micro", "bn"), ("resnet50_micro", "bn"), ("vgg19_bn_micro", "bn")]  # as published (BN)


def micro_backbones() -> list[str]:
    return sorted(p.stem for p in (ROOT / "configs" / "backbone").glob("*_micro.yaml"))


def run_one(backbone: str, norm: str, output_root: Path, overrides: list[str]) -> dict:
    run_dir = output_root / f"{backbone}-{norm}"
    cmd = [sys.executable, "-m", "normexp", f"backbone={backbone}", f"norm={norm}", "logger=none",
           "trainer.progress=false", f"hydra.run.dir={run_dir}", *overrides]
    start = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.time() - start
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    if proc.returncode != 0:
        print(proc.stderr[-2000:], file=sys.stderr)
    final = summary.get("metrics", {}).get("final", {})
    return {"backbone": backbone, "norm": norm, "status": summary.get("status", "failed"),
            "top1": final.get("val/top1"), "process_wall_s": round(wall, 1),
            "images_per_s": summary.get("images_per_s"), "params": summary.get("params"),
            "run_dir": str(run_dir)}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backbones", nargs="+", default=None, help="default: every *_micro backbone")
    parser.add_argument("--norms", nargs="+", default=["ln", "dtn", "dyt"])
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
    for backbone, norm in pairs:
        row = run_one(backbone, norm, args.output, args.overrides)
        row["meets_target"] = row["top1"] is not None and row["top1"] >= args.target \
            and row["process_wall_s"] <= args.budget
        rows.append(row)
        print(json.dumps(row), flush=True)

    lines = [f"| backbone | norm | top-1 (%) | wall (s) | images/s | params | >= {args.target:g} % in "
             f"<= {args.budget:g} s |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        top1 = "-" if r["top1"] is None else f"{r['top1']:.2f}"
        lines.append(f"| {r['backbone']} | {r['norm']} | {top1} | {r['process_wall_s']} | "
                     f"{r['images_per_s']} | {r['params']} | {'yes' if r['meets_target'] else 'NO'} |")
    table = "\n".join(lines)
    print(table)
    args.table.parent.mkdir(parents=True, exist_ok=True)
    header = (f"Micro members on the digits demo (30 epochs, seed 0), `python scripts/micro_sweep.py`, "
              f"{os.cpu_count()} CPU cores, {time.strftime('%Y-%m-%d')}.\n\n")
    args.table.write_text(header + table + "\n")
    sys.exit(0 if all(r["meets_target"] for r in rows) else 1)


if __name__ == "__main__":
    main()
