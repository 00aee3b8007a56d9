"""``normexp analyze``: look inside a trained run (its norm slots, DyT's alpha, token magnitudes, attention).

    normexp analyze <run dir> [--figures io,alpha,tokens,attention,activations] [--images 16] [--seed 0]
                    [--slots 'blocks.*.norm1'] [--max-slots 36] [--token-slot NAME] [--no-ema]

Rebuilds the model from the run's record (resolved config + checkpoint; the EMA weights where its recipe
reports them, ``--no-ema`` for the trained ones), runs a fixed, seeded set of validation images through
it as its task feeds them (a DiT: noised at seeded diffusion steps, with their labels) with every norm
slot hooked, and writes ``<run dir>/analysis/``: one PNG per figure and the numbers behind it --

* ``io.png`` / ``io_channels.png`` + ``io.json`` (fit per slot) + ``io_points.csv`` (every plotted point):
  input vs output (before the slot's affine) of every norm slot, points of a few tokens / of the channels
  with the largest inputs in colour, the fit ``a tanh(bx) + c`` with its R^2 beside a straight line's, and the
  saturated fraction; DyT slots also draw their own ``tanh(alpha x)`` (DyT arXiv 2503.10622 Figs. 2, 4);
* ``alpha.png`` + ``alpha.csv`` + ``alpha_history.csv`` (runs with DyT): alpha against 1/std of each layer's
  input, and both over the epochs from ``metrics.jsonl`` (DyT Fig. 8);
* ``tokens.png`` + ``tokens.json``: per-head token magnitudes at the input and output of a norm slot
  (``--token-slot``; default the first block's first norm) for the first image (DTN arXiv 2112.02624 Fig. 1);
* ``attention.png`` + ``attention.csv``: mean attention distance per head and layer (the DTN README's
  ``DTN_Head.png``; ViT arXiv 2010.11929 Fig. 7);
* ``activations.png`` + ``activations.csv``: per norm slot, its input's kurtosis and max |x| (arXiv
  2511.23225) and, for point-wise layers, the saturated fraction (arXiv 2604.23434; ``activations.py``);
* ``summary.json``: the run, the weights, the images, the files, and a note for every figure that does not
  apply to this model (no DyT layer; no global attention).

Everything is computed before anything is written, into a temporary directory renamed over ``analysis/``
(``--out``: anywhere else): a failure leaves the previous analysis whole, and the next analyze removes the
temporaries of one that was killed. Only an analysis (a directory whose every file its ``summary.json``
lists) is replaced: ``--out`` naming another existing directory writes ``<that dir>/<run name>-analysis/``.
Bad input (no run directory, no checkpoint, a diverged run, an unknown figure) is one line and exit code 2.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import socket
import sys
import time
from pathlib import Path
from typing import Any

from ..errors import UserError, one_line, storage_error
from ..tracking.lock import pid_exists
from .core import ANALYSES, MAX_IO_SLOTS, RunAnalysis, analyse, load_run
from .render import (
    LabelledRun,
    alpha_history_rows,
    io_point_rows,
    plot_activations,
    plot_alpha,
    plot_attention,
    plot_io,
    plot_tokens,
    write_json,
    write_rows,
)


def parse_figures(text: str | None) -> list[str]:
    if not text:
        return list(ANALYSES)
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in ANALYSES]
    if unknown or not names:
        raise UserError(f"unknown figure(s) {unknown or [text]}; available: {', '.join(ANALYSES)}")
    return names


def write_analysis(analysis: RunAnalysis, out: Path, label: str | None = None) -> list[str]:
    """Render every part of ``analysis`` into ``out`` (an existing directory); return the files written."""
    run = analysis.run
    shown = LabelledRun(label or f"{run.backbone} / {run.norm}", analysis)
    files: list[str] = []

    def note(path: Path) -> None:
        files.append(path.name)

    if analysis.io is not None:
        slots = [n["slot"] for n in analysis.io_numbers or []]
        seen = f" {analysis.inputs}" if analysis.inputs else ""
        caption = (f"{len(analysis.images)} validation images{seen}; outputs before the slot's per-channel "
                   "affine; grey: a uniform sample of elements; saturated: |b x| > 2")
        rows = plot_io([shown], [slots], out / "io.png", "token", caption=caption)
        note(out / "io.png")
        plot_io([shown], [slots], out / "io_channels.png", "channel", caption=caption)
        note(out / "io_channels.png")
        write_rows(out / "io.json", rows)
        note(out / "io.json")
        write_rows(out / "io_points.csv", io_point_rows([shown], [slots]))
        note(out / "io_points.csv")
    if analysis.alpha:
        write_rows(out / "alpha.csv", plot_alpha([shown], out / "alpha.png"))
        note(out / "alpha.png")
        note(out / "alpha.csv")
        write_rows(out / "alpha_history.csv", alpha_history_rows([shown]))
        note(out / "alpha_history.csv")
    if analysis.activations is not None:
        write_rows(out / "activations.csv", plot_activations([shown], out / "activations.png"))
        note(out / "activations.png")
        note(out / "activations.csv")
    if analysis.tokens is not None:
        write_rows(out / "tokens.json", plot_tokens([shown], out / "tokens.png"))
        note(out / "tokens.png")
        note(out / "tokens.json")
    if analysis.attention is not None and analysis.attention.layers:
        caption = "; ".join(analysis.attention.notes)
        write_rows(out / "attention.csv", plot_attention([shown], out / "attention.png", caption=caption))
        note(out / "attention.png")
        note(out / "attention.csv")
    return files


def run_summary(analysis: RunAnalysis, figures: list[str], seed: int, files: list[str]) -> dict[str, Any]:
    run = analysis.run
    return {"run": str(run.dir), "backbone": run.backbone, "norm": run.norm,
            "weights": "EMA" if run.ema else "model", "epoch": run.epoch, "top1": run.top1,
            "figures": figures, "images": {"count": len(analysis.images), "seed": seed, "as": analysis.inputs,
                                           "val_indices": analysis.image_indices},
            "image_px": list(analysis.image_size), "slots": analysis.slots, "files": files,
            "notes": analysis.notes}


TEMPORARY = ".analysis-"  # + <pid>-<tag>-<host>: what an analyze writes before it renames it into place
LEGACY_STALE_S = 3600.0  # a temporary of another naming (before the pid was in it): left for this long


def _temporary(parent: Path, tag: str) -> Path:
    return parent / f"{TEMPORARY}{os.getpid()}-{tag}-{socket.gethostname()}"


def remove_killed_analyses(parent: Path) -> None:
    """The temporaries of analyses that were killed (their process is gone) in ``parent``."""
    for path in parent.glob(f"{TEMPORARY}*"):
        pid, _, rest = path.name[len(TEMPORARY):].partition("-")
        host, gone = rest.partition("-")[2], False
        if pid.isdigit() and host:
            gone = host == socket.gethostname() and not pid_exists(int(pid))
        else:
            with contextlib.suppress(OSError):
                gone = time.time() - path.stat().st_mtime > LEGACY_STALE_S
        if gone:
            shutil.rmtree(path, ignore_errors=True)


def is_our_analysis(path: Path) -> bool:
    """Whether ``path`` is a directory an analyze wrote: every entry in it is named in its ``summary.json``'s
    ``files`` (the manifest), so replacing it loses nothing of anyone else's."""
    try:
        files = json.loads((path / "summary.json").read_text()).get("files")
        entries = {entry.name for entry in path.iterdir()}
    except (OSError, ValueError, AttributeError):
        return False
    return isinstance(files, list) and entries <= set(files)


def writable_destination(candidates: list[Path]) -> Path:
    """The first of ``candidates`` that is absent or an analysis output of ours (to be replaced whole): a
    directory of the user's is never removed -- ``--out <existing dir>`` writes into a new folder under it."""
    for path in candidates:
        if not os.path.lexists(path) or (path.is_dir() and not path.is_symlink() and is_our_analysis(path)):
            return path
    last = candidates[-1]
    kind = "a directory that holds files analyze did not write" if last.is_dir() else "not a directory"
    raise UserError(f"'{last}' is {kind}: move it away, or write the analysis elsewhere: --out <new dir>")


def analyze(run_dir: str | Path, figures: list[str], images: int, seed: int, ema: bool | None = None,
            token_slot: str | None = None, device: str = "cpu", slots: list[str] | None = None,
            max_slots: int | None = MAX_IO_SLOTS,
            out: str | Path | None = None) -> tuple[Path, dict[str, Any]]:
    """Analyse ``run_dir`` and write ``out`` (default ``<run_dir>/analysis/``) whole, with the permissions
    the umask gives (as the run's own files); see the module docstring."""
    if images < 1:
        raise UserError(f"--images must be at least 1, got {images}")
    if max_slots is not None and max_slots < 1:
        raise UserError(f"--max-slots must be at least 1, got {max_slots}")
    run = load_run(run_dir, ema=ema)
    candidates = ([run.dir / "analysis"] if out is None
                  else [Path(out), Path(out) / f"{run.dir.name}-analysis"])
    final = writable_destination(candidates)
    analysis = analyse(run, figures, images=images, seed=seed, token_slot=token_slot, device=device,
                       io_patterns=slots, io_max=max_slots)
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        remove_killed_analyses(final.parent)
        tmp = _temporary(final.parent, secrets.token_hex(3))
        tmp.mkdir()
    except OSError as e:
        raise storage_error(e, "write the analysis elsewhere: --out <dir>") or e from e
    try:
        files = write_analysis(analysis, tmp)
        summary = run_summary(analysis, figures, seed, files + ["summary.json"])
        write_json(tmp / "summary.json", summary)
        old = None
        if final.exists():
            old = _temporary(final.parent, "old")
            final.rename(old)
        tmp.rename(final)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final, summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="normexp analyze", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", help="a run directory (with config.yaml and checkpoint.pth)")
    parser.add_argument("--figures", default=None,
                        help=f"comma-separated, of {','.join(ANALYSES)} (default: all)")
    parser.add_argument("--images", type=int, default=16, help="validation images to run (default 16)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the image sample and the point samples")
    parser.add_argument("--token-slot", default=None, help="the norm slot of the tokens figure "
                        "(default: the first block's first norm)")
    parser.add_argument("--slots", default=None, help="io: comma-separated fnmatch patterns of the norm "
                        "slots to draw, e.g. 'blocks.*.norm1' (default: every slot)")
    parser.add_argument("--max-slots", type=int, default=MAX_IO_SLOTS,
                        help=f"io: at most this many slots, evenly spaced in depth (default {MAX_IO_SLOTS})")
    parser.add_argument("--no-ema", action="store_true",
                        help="the trained weights even where the run reports its EMA's")
    parser.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:N")
    parser.add_argument("--out", default=None, help="where the analysis goes (default: <run dir>/analysis); "
                        "in an existing directory that is not an analysis: a new <run name>-analysis folder")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        figures = parse_figures(args.figures)
        out, summary = analyze(args.run, figures, args.images, args.seed, ema=False if args.no_ema else None,
                               token_slot=args.token_slot, device=args.device,
                               slots=args.slots.split(",") if args.slots else None, max_slots=args.max_slots,
                               out=args.out)
    except UserError as e:
        print(f"error: {one_line(e)}", file=sys.stderr)
        sys.exit(2)
    print(f"{summary['backbone']} with norm={summary['norm']} ({summary['weights']} weights, epoch "
          f"{summary['epoch']}), {summary['images']['count']} images: {time.perf_counter() - start:.1f} s")
    for figure, notes in summary["notes"].items():
        for line in notes:
            print(f"note ({figure}): {line}")
    print(f"wrote {out}/: {', '.join(summary['files'])}")


if __name__ == "__main__":
    main()
