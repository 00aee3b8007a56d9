"""The GPU path in one command: fused kernels, bf16, whole training steps, layer benchmarks, a real DDP run.

Run it on a CUDA machine from the repository root (it takes a few minutes on one current GPU):

    python scripts/gpu_check.py                           # every section, tables under results/bench/gpu/
    python scripts/gpu_check.py --sections fused,run      # a subset (e.g. to re-run what failed)
    python scripts/gpu_check.py --dry-run --out /tmp/gpu  # the same code paths on the CPU, tiny sizes

Sections (each writes ``<out>/<section>*.md`` with the machine, GPU, driver, versions and command):

* ``fused`` -- DyT (every squash; tokens, channels-last and channels-first maps) and DTN (tokens with and
  without prefix tokens, pooled grids, maps of either layout, ``only_var``) with ``kernels=compiled``
  against ``kernels=autograd``: in float32, output and input/parameter gradients within ``FP32_TOL``
  (max |difference| / max |reference|); under ``torch.autocast(dtype=bfloat16)``, the output dtype is the
  one LayerNorm gives for the same input, gradients are finite and within ``BF16_TOL`` of float32
  autograd at the same (rounded) input. A compile that falls back to the plain ops (a Triton error) fails
  the section.
* ``steps`` -- ``scripts/bench_train.py``: ViT-S/16 at 224 px, bf16 autocast, timm's
  ``vit_small_patch16_224`` vs ours with LN, DyT, DTN (every slot) and the DTN code's layout, in interleaved
  rounds; at batch 64 with ``torch.compile`` off and on, and at the largest batch that fits (estimated from
  the measured peak memory at batch 64) for the throughput line; then DiT-B/4's step on 256 px latents
  (``scripts/bench_dit.py``), fp32 and bf16, with LN, DyT and DTN.
* ``layers`` -- ``scripts/bench_norms.py`` on the device: every normalizer at ViT-S/B token shapes against
  LN and the memory-bound floor, forward+backward, float32 and bfloat16.
* ``run`` -- ``python -m normexp`` through ``torchrun --nproc_per_node=<gpus>`` (NCCL on GPUs): the DeiT
  recipe on ViT-S at 224 px over a synthetic ImageFolder of JPEGs made here, bf16, ``trainer.compile=true``,
  DataLoader workers, EMA and Mixup/CutMix on, step-limited by its small dataset. One run goes through
  uninterrupted; a second is killed (SIGKILL, the whole process group) after its first mid-epoch
  checkpoint and continued by the same command: both records must complete and agree per epoch within
  ``RESUME_TOL``; graph breaks and recompiles are counted from ``TORCH_LOGS``.

Only public interfaces are used -- configs composed as on the command line (``norm.kernels=``,
``trainer.amp=``, ...), ``normexp.norms.norm_layer_factory`` with the documented layer context, the
benchmark scripts' command lines and ``python -m normexp`` -- so the check survives refactoring.
The exit code is 1 when any check fails (every section still runs and writes its table).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from normexp.norms import TokenLayout, norm_layer_factory  # noqa: E402

SECTIONS = ("fused", "steps", "layers", "run")
FP32_TOL = 1e-4  # compiled vs plain ops in float32: reassociated sums, a rational tanh (2e-8)
BF16_TOL = 5e-2  # bf16 autocast vs float32 at the same bf16 input: 8 bits of mantissa (0.4 % per rounding)
GRAD_FLOOR = 1e-2  # see worst_grad
RESUME_TOL = 2e-2  # per-epoch train/loss, killed-and-resumed vs uninterrupted (GPU kernels are not bitwise)
EXPECTED_RECOMPILES = 0  # the training step is compiled once (drop_last: every batch has one shape)


# ----------------------------------------------------------------------------- report
def nvidia_driver() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "n/a"
    except (OSError, subprocess.SubprocessError):
        return "n/a"


def header(device: torch.device) -> list[str]:
    """Machine, GPU, driver, versions and command: the first lines of every table this script writes."""
    import timm

    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        gpu = (f"{torch.cuda.device_count()} x {props.name} ({props.total_memory / 2**30:.0f} GiB, "
               f"compute capability {props.major}.{props.minor})")
    else:
        gpu = "none (CPU dry run)"
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    return [f"- machine: {platform.node()}, {os.cpu_count()} CPUs, {platform.platform()}",
            f"- GPU: {gpu}; driver {nvidia_driver()}; CUDA runtime {torch.version.cuda}",
            f"- versions: python {platform.python_version()}, torch {torch.__version__}, triton "
            f"{triton_version}, timm {timm.__version__}",
            f"- command: `{' '.join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]])}`",
            f"- date: {time.strftime('%Y-%m-%d %H:%M')}"]


@dataclass
class Section:
    """One section's table: its lines, whether every check passed, and its wall time."""

    name: str
    title: str
    lines: list[str] = field(default_factory=list)
    ok: bool = True
    seconds: float = 0.0

    def fail(self, line: str) -> None:
        self.ok = False
        self.lines.append(line)

    def write(self, out: Path, head: list[str]) -> Path:
        path = out / f"{self.name}.md"
        status = "pass" if self.ok else "FAIL"
        path.write_text(f"# {self.title} (scripts/gpu_check.py)\n\n" + "\n".join(head) +
                        f"\n- section: {status}, {self.seconds:.0f} s\n\n" + "\n".join(self.lines) + "\n")
        return path


# ----------------------------------------------------------------------------- 1. fused = plain
@dataclass
class LayerCase:
    """One normalizer slot: name, hyper-parameters, the context a model hands it, and an input shape."""

    label: str
    norm: str
    hparams: dict[str, Any]
    dim: int
    shape: tuple[int, ...]
    context: dict[str, Any]


def layer_cases(dry_run: bool) -> list[LayerCase]:
    """The slots of DyT and DTN a model builds (the same context ViT, Swin, PVT and ConvNeXt hand over)."""
    b = 2 if dry_run else 16
    c, heads = (32, 4) if dry_run else (384, 6)
    grid, big, pool = ((4, 4), (6, 6), 3) if dry_run else ((14, 14), (56, 56), 14)
    n = grid[0] * grid[1]
    tokens = {"data_format": "channels_last"}
    cases = [LayerCase(f"dyt {squash}, tokens ({b}, {1 + n}, {c})", "dyt", {"squash": squash}, c,
                       (b, 1 + n, c), tokens) for squash in ("tanh", "hardtanh", "sigmoid", "identity")]
    cases += [
        LayerCase(f"dyt tanh, channels-last map ({b}, {big[0]}, {big[1]}, {c // 4})", "dyt", {}, c // 4,
                  (b, *big, c // 4), tokens),
        LayerCase(f"dyt tanh, channels-first map ({b}, {c // 4}, {big[0]}, {big[1]})", "dyt", {}, c // 4,
                  (b, c // 4, *big), {"data_format": "channels_first"}),
        LayerCase(f"dyt tanh, fixed alpha, tokens ({b}, {n}, {c})", "dyt", {"learnable_alpha": False}, c,
                  (b, n, c), tokens),
    ]
    with_prefix = {**tokens, "num_heads": heads, "layout": TokenLayout(grid=grid, num_prefix_tokens=1),
                   "num_prefix_tokens": 1}
    no_prefix = {**tokens, "num_heads": heads, "layout": TokenLayout(grid=grid)}
    pooled = {**tokens, "num_heads": heads // 2, "layout": TokenLayout(grid=big)}
    dtn, at = {"pool_size": pool}, f"grid {grid[0]}x{grid[1]}"
    cases += [
        LayerCase(f"dtn tokens + 1 prefix, {at}", "dtn", dtn, c, (b, 1 + n, c), with_prefix),
        LayerCase(f"dtn tokens, {at}", "dtn", dtn, c, (b, n, c), no_prefix),
        LayerCase(f"dtn only_var, tokens + 1 prefix, {at}", "dtn", {**dtn, "only_var": True}, c,
                  (b, 1 + n, c), with_prefix),
        LayerCase(f"dtn tokens, pooled grid {big[0]}x{big[1]} -> {pool}x{pool}", "dtn", dtn, c // 2,
                  (b, big[0] * big[1], c // 2), pooled),
        LayerCase(f"dtn channels-last map {big[0]}x{big[1]} (pooled)", "dtn", dtn, c // 2,
                  (b, *big, c // 2), {**tokens, "num_heads": heads // 2}),
        LayerCase(f"dtn channels-first map {grid[0]}x{grid[1]}", "dtn", dtn, c, (b, c, *grid),
                  {"data_format": "channels_first", "num_heads": heads}),
    ]
    return cases


def build_layer(case: LayerCase, kernels: str, device: torch.device) -> torch.nn.Module:
    """The layer with ``kernels``, its parameters moved off their initial values (seeded, the same for every
    mode) so that every parameter gradient is exercised."""
    torch.manual_seed(0)
    layer = norm_layer_factory(case.norm, kernels=kernels, **case.hparams)(case.dim, **case.context)
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return layer.to(device).train()


def forward_backward(layer: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor,
                     autocast: torch.dtype | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Output and gradients (input and every parameter) of one forward+backward."""
    x = x.detach().clone().requires_grad_()
    layer.zero_grad(set_to_none=True)
    ctx = torch.autocast(x.device.type, dtype=autocast) if autocast else contextlib.nullcontext()
    with ctx:
        y = layer(x)
    y.backward(grad.to(y.dtype))
    grads = {"x": x.grad}
    grads.update({n: p.grad for n, p in layer.named_parameters() if p.grad is not None})
    return y.detach(), grads


def rel_err(a: torch.Tensor, ref: torch.Tensor, floor: float = 0.0) -> float:
    """max |a - ref| / max(max |ref|, floor)."""
    a, ref = a.double(), ref.double()
    return float((a - ref).abs().max() / ref.abs().max().clamp_min(max(floor, 1e-30)))


def worst_grad(grads: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> tuple[float, str]:
    """The largest :func:`rel_err` over the gradients, each against at least ``GRAD_FLOOR`` of the case's
    largest reference gradient: a gradient that is zero in exact arithmetic (DTN's position bias cancels in
    the softmax) is round-off in both and is compared on the scale of the others."""
    scale = max(float(g.abs().max()) for g in ref.values())
    return max((rel_err(grads[k], ref[k], GRAD_FLOOR * scale), k) for k in ref)


@contextlib.contextmanager
def captured_warnings(loggers: tuple[str, ...] = ("normexp", "torch._dynamo")) -> Iterator[list[str]]:
    """WARNING records while inside: normexp says when a compile fell back to the plain ops, dynamo when a
    function hit its recompile limit (it then runs op by op, silently after that one warning)."""
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    handler = Keep(logging.WARNING)
    for name in loggers:
        logging.getLogger(name).addHandler(handler)
    try:
        yield records
    finally:
        for name in loggers:
            logging.getLogger(name).removeHandler(handler)


def check_fused(device: torch.device, dry_run: bool, mode: str) -> Section:
    section = Section("fused", f"Fused kernels ({mode}) = plain ops on the device")
    section.lines += [f"Tolerances: float32 compiled vs autograd, max |diff| / max |ref| <= {FP32_TOL:g} (a "
                      f"gradient's max |ref| at least {GRAD_FLOOR:g} x the case's largest gradient); bf16 "
                      f"autocast (bf16 input, as after a Linear) vs float32 autograd at that input <= "
                      f"{BF16_TOL:g}, gradients finite, output dtype = LayerNorm's for the same input.", "",
                      "| case | fp32: y | fp32: grads (worst) | bf16: y dtype (LN's) | bf16: y | bf16: grads "
                      "(worst) | verdict |", "|---|---|---|---|---|---|---|"]
    gen = torch.Generator().manual_seed(0)
    with captured_warnings() as warnings:
        for case in layer_cases(dry_run):
            x = torch.randn(case.shape, generator=gen).to(device)
            grad = torch.randn(case.shape, generator=gen).to(device)
            plain, fused = build_layer(case, "autograd", device), build_layer(case, mode, device)
            y_ref, g_ref = forward_backward(plain, x, grad, None)
            y, g = forward_backward(fused, x, grad, None)
            fp32_y, fp32_g = rel_err(y, y_ref), worst_grad(g, g_ref)
            ln = norm_layer_factory("ln")(case.dim, **case.context).to(device)
            x16 = x.to(torch.bfloat16)
            with torch.autocast(device.type, dtype=torch.bfloat16):
                ln_dtype = ln(x16).dtype
            y16, g16 = forward_backward(fused, x16, grad, torch.bfloat16)
            # the reference sees the same rounded input: hardtanh's derivative jumps at the clip, so an
            # element that rounding moves across it differs by its whole gradient, whatever the kernel
            y_ref16, g_ref16 = forward_backward(plain, x16.float(), grad, None)
            finite = all(bool(torch.isfinite(t).all()) for t in [y16, *g16.values()])
            bf16_y, bf16_g = rel_err(y16, y_ref16), worst_grad(g16, g_ref16)
            ok = (fp32_y <= FP32_TOL and fp32_g[0] <= FP32_TOL and y16.dtype == ln_dtype and finite
                  and bf16_y <= BF16_TOL and bf16_g[0] <= BF16_TOL and set(g) == set(g_ref) == set(g16))
            section.ok &= ok
            dtype = f"{str(y16.dtype).removeprefix('torch.')} ({str(ln_dtype).removeprefix('torch.')})"
            section.lines.append(
                f"| {case.label} | {fp32_y:.1e} | {fp32_g[0]:.1e} ({fp32_g[1]}) | {dtype} | {bf16_y:.1e} | "
                f"{bf16_g[0]:.1e} ({bf16_g[1]}){'' if finite else ', NOT FINITE'} | "
                f"{'pass' if ok else 'FAIL'} |")
    fallbacks = [w for w in warnings if "torch.compile" in w or "recompile_limit" in w]
    if fallbacks:
        section.fail(f"\nFAIL: compiled kernels ran op by op: {fallbacks[0].splitlines()[0]}")
    return section


# ----------------------------------------------------------------------------- 2 and 3. benchmarks
def run_logged(cmd: list[str], section: Section, timeout: float, env: dict[str, str] | None = None
               ) -> subprocess.CompletedProcess:
    """Run a command, echo its output, and fail the section (naming the command) when it fails."""
    print("$", " ".join(cmd), flush=True)
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, **(env or {})})
    except subprocess.TimeoutExpired:
        section.fail(f"FAIL: timed out after {timeout:.0f} s: `{' '.join(cmd)}`")
        return subprocess.CompletedProcess(cmd, 124, "", "")
    print(proc.stdout[-4000:], proc.stderr[-4000:], sep="\n", flush=True)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        section.fail(f"FAIL: exit {proc.returncode}: `{' '.join(cmd)}`: {tail}")
    return proc


def embed(path: Path) -> list[str]:
    """A benchmark's table, without its own title (the section header says the same)."""
    if not path.is_file():
        return [f"(no table: {path.name} was not written)"]
    return [line for line in path.read_text().splitlines() if not line.startswith("# ")] + [""]


def check_steps(device: torch.device, dry_run: bool, work: Path, timeout: float) -> Section:
    section = Section("steps", "Whole training steps, bf16 autocast")
    script = str(ROOT / "scripts" / "bench_train.py")
    if dry_run:
        common = ["--backbone", "vit_small", "--img-size", "32", "--num-classes", "10", "--warmup", "1",
                  "--steps", "1", "--rounds", "1", "--trainer-steps", "2"]
        batch = 2
    else:
        common = ["--backbone", "vit_small", "--img-size", "224", "--num-classes", "1000", "--warmup", "3",
                  "--steps", "5", "--rounds", "3", "--trainer-steps", "6"]
        batch = 64
    common += ["--norms", "ln", "dyt", "dtn", "--layout", "vit_small_star", "--precision", "bf16",
               "--device", str(device)]
    # the dry run compiles the micro ViT alone (a compile of ViT-S's step takes minutes on a CPU)
    micro = ["--backbone", "vit_micro", "--img-size", "16", "--norms", "ln", "--layout", "none",
             "--trainer-steps", "0"] if dry_run else []
    runs = [("eager", batch, []), ("compiled", batch, ["--compile", *micro])]
    peaks: list[float] = []
    for label, size, extra in runs:
        out, figures = work / f"steps_{label}.md", work / f"steps_{label}.json"
        run_logged([sys.executable, script, *common, "--batch", str(size), *extra, "--out", str(out),
                    "--json", str(figures)], section, timeout)
        section.lines += [f"## batch {size}, torch.compile {'on' if extra else 'off'}", "", *embed(out)]
        if figures.is_file() and not extra:
            peaks = [c["peak_mb"] for c in json.loads(figures.read_text())["cases"]]
    if peaks and device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        # step memory grows linearly with the batch; keep a quarter free for the allocator and the state
        largest = int(batch * 0.75 * free / 2**20 / max(peaks)) // batch * batch
        out = work / "steps_largest.md"
        if largest > batch:
            run_logged([sys.executable, script, *common, "--batch", str(largest), "--rounds", "2",
                        "--trainer-steps", "0", "--out", str(out)], section, timeout)
            section.lines += [f"## batch {largest} (the largest that fits: 3/4 of the free memory over the "
                              f"largest peak step memory at batch {batch}), torch.compile off", "",
                              *embed(out)]
    # DiT's step (task=dit): DiT-B/4 on 256 px latents, fp32 as DiT trains, and bf16
    dit = (["--backbone", "dit_micro", "--batch", "2", "--input-size", "8", "--warmup", "1", "--steps", "1",
            "--rounds", "1"] if dry_run else
           ["--backbone", "dit_b4", "--batch", "64", "--input-size", "32", "--warmup", "3", "--steps", "5",
            "--rounds", "3"])
    for amp in ([], ["--amp", "bf16"]):
        out = work / f"dit{'_' + amp[1] if amp else ''}.md"
        run_logged([sys.executable, str(ROOT / "scripts" / "bench_dit.py"), *dit, *amp, "--device",
                    str(device), "--out", str(out)], section, timeout)
        section.lines += [f"## DiT step, {amp[1] if amp else 'fp32'}", "", *embed(out)]
    return section


def check_layers(device: torch.device, dry_run: bool, work: Path, timeout: float) -> Section:
    section = Section("layers", "Normalizer layers: forward+backward against LN and the memory-bound floor")
    script = str(ROOT / "scripts" / "bench_norms.py")
    size = (["--batch", "2", "--warmup", "1", "--repeats", "1", "--rounds", "1", "--shapes", "vit_s",
             "--norms", "ln", "dyt", "dtn"] if dry_run else
            ["--batch", "64", "--warmup", "3", "--repeats", "20", "--rounds", "3"])
    for dtype in ("float32", "bfloat16"):
        out = work / f"layers_{dtype}.md"
        run_logged([sys.executable, script, *size, "--device", str(device), "--dtype", dtype,
                    "--out", str(out)], section, timeout)
        section.lines += [f"## {dtype}", "", *embed(out)]
    return section


# ----------------------------------------------------------------------------- 4. a real run
def make_jpeg_tree(root: Path, classes: int, train: int, val: int, size: tuple[int, int]) -> None:
    """An ImageFolder tree of real JPEGs (smooth random colour fields with a class-coloured square)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for split, count in (("train", train), ("val", val)):
        for c in range(classes):
            folder = root / split / f"n{c:08d}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(count):
                small = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)
                img = Image.fromarray(small).resize(size[::-1], Image.BILINEAR)
                pixels = np.asarray(img).copy()
                h, w = size
                pixels[h // 4: h // 2, w // 4: w // 2] = (37 * c % 256, 91 * c % 256, 173 * c % 256)
                Image.fromarray(pixels).save(folder / f"img_{i:04d}.JPEG", quality=90)


def kill_tree(pid: int) -> None:
    """SIGKILL a process and every descendant (torchrun starts its workers in sessions of their own, so
    killing its process group would leave them running): what a node failure does to a job."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo += children.get(tree[-1], [])
    for member in tree:
        with contextlib.suppress(ProcessLookupError):
            os.kill(member, signal.SIGKILL)


def epoch_rows(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if "val/top1" in r]


def status_of(run_dir: Path) -> str:
    path = run_dir / "summary.json"
    return json.loads(path.read_text()).get("status", "?") if path.is_file() else "no summary"


def count_compile_events(text: str) -> tuple[int, int]:
    """(graph breaks, recompiles) in the output of a run with TORCH_LOGS=graph_breaks,recompiles."""
    lines = text.splitlines()
    return (sum("Graph break" in line for line in lines),
            sum("Recompiling function" in line for line in lines))


def check_run(device: torch.device, dry_run: bool, work: Path, timeout: float, gpus: int, log_dir: Path
              ) -> Section:
    section = Section("run", "A real run: DeiT recipe, ViT-S, torchrun, kill -9 and resume")
    tree = work / "imagefolder"
    if dry_run:  # the micro ViT: ViT-S checkpoints (350 MB with EMA and AdamW) every 2 steps take minutes
        make_jpeg_tree(tree, classes=2, train=8, val=2, size=(40, 48))
        size = ["backbone=vit_micro", "data.img_size=16", "data.batch_size=4", "data.eval_batch_size=4",
                "data.num_workers=2", "trainer.device=cpu", "trainer.compile=false"]
        classes = 2
    else:
        make_jpeg_tree(tree, classes=10, train=64, val=8, size=(256, 320))
        size = ["backbone=vit_small", "data.batch_size=64", "data.eval_batch_size=128", "data.num_workers=6",
                "trainer.compile=true"]
        classes = 10
    nproc = 1 if dry_run else gpus
    overrides = ["experiment=deit_imagenet", f"data.root={tree}",
                 f"data.num_classes={classes}", "trainer.global_batch=null", "trainer.epochs=3",
                 "trainer.warmup_epochs=1", "trainer.amp=bf16", "trainer.checkpoint_interval=2",
                 "trainer.log_interval=1", "trainer.progress=false", "logger=none", *size]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                "-m", "normexp"]
    env = {**os.environ, "TORCH_LOGS": "graph_breaks,recompiles", "WANDB_SILENT": "true",
           "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}

    def launch(root: Path) -> subprocess.Popen:
        """The run, under an output root of its own (its record: the one directory there)."""
        print(f"$ NORMEXP_OUTPUT_DIR={root}", " ".join(torchrun + overrides), flush=True)
        return subprocess.Popen([*torchrun, *overrides], cwd=ROOT,
                                env={**env, "NORMEXP_OUTPUT_DIR": str(root)}, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)

    def record(root: Path) -> Path:
        return next(root.glob("classification/*"), root / "not-started")

    def finish(proc: subprocess.Popen, log: str) -> tuple[int, str]:
        try:
            text, _ = proc.communicate(timeout=timeout)
            code = proc.returncode
        except subprocess.TimeoutExpired:
            kill_tree(proc.pid)
            text, _ = proc.communicate()
            code = 124
        (log_dir / log).write_text(text)  # the whole output, for whoever reads the table
        return code, text

    start = time.perf_counter()
    code, out = finish(launch(work / "run_reference"), "run_uninterrupted.log")
    reference = record(work / "run_reference")
    breaks, recompiles = count_compile_events(out)
    seconds = time.perf_counter() - start
    section.lines += [f"Command: `torchrun --standalone --nproc_per_node={nproc} -m normexp "
                      f"{' '.join(overrides)}` (each under an output root of its own)", "",
                      "| run | exit | status | epochs | wall s | graph breaks | recompiles |",
                      "|---|---|---|---|---|---|---|",
                      f"| uninterrupted | {code} | {status_of(reference)} | {len(epoch_rows(reference))} | "
                      f"{seconds:.0f} | {breaks} | {recompiles} |"]
    if code != 0:
        section.fail(f"\nFAIL: the uninterrupted run exited {code}: {out.strip().splitlines()[-1:]}")
    if breaks or recompiles > EXPECTED_RECOMPILES:
        lines = [line for line in out.splitlines() if "Graph break" in line or "Recompiling" in line]
        section.fail(f"\nFAIL: {breaks} graph breaks, {recompiles} recompiles (expected 0 and at most "
                     f"{EXPECTED_RECOMPILES}); first: {lines[:1]}")

    proc = launch(work / "run_killed")
    deadline = time.monotonic() + timeout
    while not (record(work / "run_killed") / "checkpoint.pth").exists() and proc.poll() is None \
            and time.monotonic() < deadline:
        time.sleep(0.2)
    killed = record(work / "run_killed")
    kill_tree(proc.pid)
    first, _ = proc.communicate()
    (log_dir / "run_killed.log").write_text(first)
    after_kill = status_of(killed)
    if after_kill == "completed":
        section.fail("\nFAIL: the run completed before it could be killed: lengthen it")
    code, out = finish(launch(work / "run_killed"), "run_resumed.log")  # the same command continues it
    section.lines.append(f"| killed after its first checkpoint ({after_kill}), then the same command | "
                         f"{code} | {status_of(killed)} | {len(epoch_rows(killed))} | | "
                         f"{'/'.join(map(str, count_compile_events(out)))} | |")
    if code != 0 or status_of(killed) != "completed" or "resumed from" not in out:
        section.fail(f"\nFAIL: the resumed run exited {code} with status {status_of(killed)} "
                     f"({'resumed' if 'resumed from' in out else 'did not resume'})")
    ref_rows, rows = epoch_rows(reference), epoch_rows(killed)
    if ref_rows and len(rows) == len(ref_rows):
        diffs = [abs(a["train/loss"] - b["train/loss"]) for a, b in zip(ref_rows, rows, strict=True)]
        section.lines += ["", f"Per-epoch train/loss, resumed vs uninterrupted: max |diff| {max(diffs):.2e} "
                          f"(tolerance {RESUME_TOL:g}); "
                          + ", ".join(f"epoch {r['epoch']}: {r['train/loss']:.4f} / {s['train/loss']:.4f}"
                                      for r, s in zip(ref_rows, rows, strict=True))]
        if max(diffs) > RESUME_TOL:
            section.fail("FAIL: the resumed run does not match the uninterrupted one")
    else:
        section.fail(f"\nFAIL: epoch rows: uninterrupted {len(ref_rows)}, resumed {len(rows)}")
    return section


# ----------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {SECTIONS}")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--gpus", type=int, default=None,
                        help="processes of the real run (default: every GPU)")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "bench" / "gpu")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per benchmark or run command")
    parser.add_argument("--fused-mode", default="compiled", choices=["compiled", "eager"],
                        help="the fused path checked against the plain ops: compiled (the point of the "
                        "check), or its kernels op by op (seconds instead of minutes on a CPU)")
    parser.add_argument("--dry-run", action="store_true",
                        help="on the CPU at tiny sizes: every code path, no meaningful figures")
    args = parser.parse_args(argv)
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        parser.error(f"unknown section(s) {unknown}; choose from {', '.join(SECTIONS)}")
    device = torch.device("cpu" if args.dry_run else args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: CUDA is not available here: run this on a GPU machine, or pass --dry-run to exercise "
              "the same code paths on the CPU", file=sys.stderr)
        return 2
    gpus = args.gpus or (torch.cuda.device_count() if device.type == "cuda" else 1)
    args.out.mkdir(parents=True, exist_ok=True)
    head = header(device)
    print("\n".join(head), flush=True)
    work = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    checks: dict[str, Callable[[], Section]] = {
        "fused": lambda: check_fused(device, args.dry_run, args.fused_mode),
        "steps": lambda: check_steps(device, args.dry_run, work, args.timeout),
        "layers": lambda: check_layers(device, args.dry_run, work, args.timeout),
        "run": lambda: check_run(device, args.dry_run, work, args.timeout, gpus, args.out),
    }
    results = []
    try:
        for name in sections:
            start = time.perf_counter()
            try:
                section = checks[name]()
            except Exception as e:  # a crash in one section is that section's failure, not the end
                section = Section(name, name)
                section.fail(f"FAIL: {type(e).__name__}: {e}")
            section.seconds = time.perf_counter() - start
            path = section.write(args.out, head)
            results.append(section)
            verdict = "pass" if section.ok else "FAIL"
            print(f"== {name}: {verdict} in {section.seconds:.0f} s -> {path}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("\n".join(f"{s.name}: {'pass' if s.ok else 'FAIL'} ({s.seconds:.0f} s)" for s in results))
    return 0 if all(s.ok for s in results) else 1


if __name__ == "__main__":
    sys.exit(main())
