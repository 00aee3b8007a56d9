"""The GPU path in one command within a time budget: fused kernels, layer and step benchmarks, a DDP run.

Run it on a CUDA machine from the repository root (8 minutes on one H200 by default):

    python scripts/gpu_check.py                           # every section, tables under results/bench/gpu/
    python scripts/gpu_check.py --sections fused,run      # a subset (e.g. to re-run what failed)
    python scripts/gpu_check.py --budget-s 900            # more time: fewer parts cut
    python scripts/gpu_check.py --dry-run --out /tmp/gpu  # the same code paths on the CPU, tiny sizes

Sections run most valuable first, each writing ``<out>/<section>.md`` (machine, GPU, driver, versions,
command, its share of the budget) as soon as it ends, so a run cut short still reports what finished:

* ``fused`` -- every normalizer with a fused path (a ``kernels`` option) with ``kernels=compiled`` against
  ``kernels=autograd``: DyT (every squash; tokens, channels-last and channels-first maps), DTN (tokens with
  and without prefix tokens, pooled grids, maps of either layout, ``only_var``) and a token case of every
  other one (one per function of the point-wise family), round-robin over the normalizers so that a cut
  leaves each checked at least once. In float32, output and input/parameter gradients within ``FP32_TOL``
  (max |difference| / max |reference|); under ``torch.autocast(dtype=bfloat16)``, the output dtype is the
  one LayerNorm gives for the same input, gradients are finite and within ``BF16_TOL`` of float32 autograd
  at the same (rounded) input, or within ``PLAIN_BF16_SLACK`` times the plain ops' own bf16 error where a
  cancelling sum (a scalar's gradient) loses more than that in any kernel. A compile that falls back to the
  plain ops (a Triton error) fails the section.
* ``layers`` -- forward+backward at ViT-B tokens (64, 197, 768) under bf16 autocast (bf16 input, as after a
  Linear; float32 parameters): DyT, Derf, every point-wise function, RMSNorm and DTN (their default,
  fused, path) against three LayerNorm baselines timed in the same interleaved rounds -- eager, compiled
  (``torch.compile``) and timm's fast norm (``timm.layers.fast_norm.fast_layer_norm``: LayerNorm in bf16,
  without autocast's float32 upcast) -- with the issue's target marked (point-wise <= 1.0x compiled LN);
  then, as time allows, ``scripts/bench_norms.py`` (every registered normalizer, time and memory) in
  bfloat16 and float32.
* ``steps`` -- ``scripts/bench_train.py``: ViT-B/16's bf16 step, compiled, with LN, DyT, Derf and DTN
  (targets x LN: DyT <= 1.00, Derf <= 1.02, DTN <= 1.15); ``scripts/bench_dit.py``: DiT-B/4's fp32 step on
  256 px latents with LN, DTN, DyT (DTN <= 1.3x LN); then, as time allows, ViT-B eager against timm's
  model with the trainer's overhead, and DiT-B/4 in bf16.
* ``run`` -- ``python -m normexp`` through ``torchrun --nproc_per_node=<gpus>`` (NCCL on GPUs): the DeiT
  recipe on ViT-S at 224 px over a synthetic ImageFolder of JPEGs made here, bf16, ``trainer.compile=true``,
  DataLoader workers, EMA and Mixup/CutMix on, step-limited by its small dataset. One run goes through
  uninterrupted while a second, started beside it, is killed (SIGKILL, the whole process tree) after its
  first mid-epoch checkpoint and continued by the same command: both records must complete and agree per
  epoch within ``RESUME_TOL``; graph breaks and recompiles are counted from ``TORCH_LOGS``.

The budget (``--budget-s``, counted from the start) is split over the chosen sections as ``PLAN_S`` says;
time a section leaves unused goes to the next. Within a section a part that would not fit in what is left
(by ``ESTIMATE_S``, or by the slowest part so far) is not started, and a command still running at the
section's end is stopped; the table says which (``NOT RUN``, ``CUT``) and the section reads ``incomplete``.
SIGTERM (e.g. from ``timeout``) writes the running section as far as it got and the rest as not run.

Only public interfaces are used -- configs composed as on the command line (``norm.kernels=``,
``trainer.amp=``, ...), ``normexp.norms.norm_layer_factory`` with the documented layer context, the
benchmark scripts' command lines and ``python -m normexp`` -- so the check survives refactoring.
Exit code: 1 when a check failed, else 3 when the budget cut something, else 0. Speed targets are reported
as met or not met; they are not checks.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import logging
import math
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from normexp.norms import TokenLayout, kernels, list_norms, norm_layer_factory  # noqa: E402
from normexp.norms.registry import hyperparameters  # noqa: E402

SECTIONS = ("fused", "layers", "steps", "run")  # most valuable first: a run cut short keeps what finished
# the budget's split: the seconds each section is planned to take of the default budget on one H200, from
# the walls of the last H200 run (results/bench/gpu/README.md says how); a section's unused time goes on
PLAN_S = {"fused": 150, "layers": 90, "steps": 140, "run": 100}
DEFAULT_BUDGET_S = sum(PLAN_S.values())  # 8 minutes
# estimated seconds of each benchmark command on one H200, compiles included (cold caches): a command is
# not started when less than this is left of its section
ESTIMATE_S = {"vit_b compiled": 120, "dit fp32": 35, "vit_b eager": 50, "dit bf16": 30,
              "bench_norms bfloat16": 60, "bench_norms float32": 50, "run": 100}
TIMING_RESERVE_S = 10  # of the layers section, for its timed rounds once every layer is warm
FP32_TOL = 1e-4  # compiled vs plain ops in float32: reassociated sums, a rational tanh (2e-8)
BF16_TOL = 5e-2  # bf16 autocast vs float32 at the same bf16 input: 8 bits of mantissa (0.4 % per rounding)
PLAIN_BF16_SLACK = 1.5  # ... or at most this times what the plain ops lose under the same autocast
GRAD_FLOOR = 1e-2  # see worst_grad
RESUME_TOL = 2e-2  # per-epoch train/loss, killed-and-resumed vs uninterrupted (GPU kernels are not bitwise)
EXPECTED_RECOMPILES = 0  # the training step is compiled once (drop_last: every batch has one shape)
# the GPU targets (max time ratio to LN): a layer at ViT-B tokens in bf16 against compiled LN, ViT-B's
# bf16 compiled training step, DiT-B/4's step
LAYER_TARGET = 1.0
STEP_TARGETS = {"dyt": 1.00, "derf": 1.02, "dtn": 1.15}
DIT_TARGETS = {"dtn": 1.3}


class Interrupted(Exception):
    """SIGTERM arrived (``timeout`` ran out): write what the running section has and stop."""


STOPPED: list[int] = []  # the signal, once one arrived (torch.compile may wrap the exception it raises)


def on_sigterm(signum: int, frame: Any) -> None:
    STOPPED.append(signum)
    raise Interrupted(f"signal {signum}")


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
    """One section's table: its lines, whether every check passed, whether everything ran (the budget cut
    nothing), its wall time, and the ``time.monotonic()`` by which it must end."""

    name: str
    title: str
    deadline: float = math.inf
    planned: float = math.inf
    lines: list[str] = field(default_factory=list)
    ok: bool = True
    complete: bool = True
    seconds: float = 0.0

    def fail(self, line: str) -> None:
        self.ok = False
        self.lines.append(line)

    def cut(self, line: str) -> None:
        self.complete = False
        self.lines.append(line)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def timeout(self) -> float | None:
        """Seconds a command may run: what is left of the section (None: no budget)."""
        return None if self.deadline == math.inf else max(self.left(), 1.0)

    def fits(self, what: str, estimate: float) -> bool:
        """Whether ``estimate`` seconds are left; if not, the table says ``what`` was not run."""
        if self.left() >= estimate:
            return True
        self.cut(f"NOT RUN (budget): {what}: needs about {estimate:.0f} s, {max(self.left(), 0):.0f} s left")
        self.lines.append("")
        return False

    @property
    def status(self) -> str:
        return "FAIL" if not self.ok else "pass" if self.complete else "incomplete"

    def write(self, out: Path, head: list[str]) -> Path:
        path = out / f"{self.name}.md"
        planned = "" if self.planned == math.inf else f" (planned {self.planned:.0f} s of the budget)"
        cut = "" if self.complete else "; the budget cut the parts marked NOT RUN / CUT"
        path.write_text(f"# {self.title} (scripts/gpu_check.py)\n\n" + "\n".join(head) +
                        f"\n- section: {self.status}, {self.seconds:.0f} s{planned}{cut}\n\n" +
                        "\n".join(self.lines) + "\n")
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


def option_choices(norm: str, option: str) -> list[Any] | None:
    """The allowed values of a normalizer's option (from its ``hparam_checks``), None when it has no such
    option."""
    options = {h.name: h for h in hyperparameters(norm) or []}
    if option not in options:
        return None
    return list(options[option].checks.get("choices", [options[option].default]))


def layer_cases(dry_run: bool) -> list[LayerCase]:
    """The slots of DyT and DTN a model builds (the same context ViT, Swin, PVT and ConvNeXt hand over), and
    a token case of every other normalizer with a fused path (one per function of the point-wise family),
    round-robin over the normalizers: a check cut short has checked each of them at least once."""
    b = 2 if dry_run else 16
    c, heads = (32, 4) if dry_run else (384, 6)
    grid, big, pool = ((4, 4), (6, 6), 3) if dry_run else ((14, 14), (56, 56), 14)
    n = grid[0] * grid[1]
    tokens = {"data_format": "channels_last"}
    dyt = [LayerCase(f"dyt {squash}, tokens ({b}, {1 + n}, {c})", "dyt", {"squash": squash}, c,
                     (b, 1 + n, c), tokens) for squash in ("tanh", "hardtanh", "sigmoid", "identity")]
    dyt += [
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
    at, hp = f"grid {grid[0]}x{grid[1]}", {"pool_size": pool}
    dtn = [
        LayerCase(f"dtn tokens + 1 prefix, {at}", "dtn", hp, c, (b, 1 + n, c), with_prefix),
        LayerCase(f"dtn tokens, {at}", "dtn", hp, c, (b, n, c), no_prefix),
        LayerCase(f"dtn only_var, tokens + 1 prefix, {at}", "dtn", {**hp, "only_var": True}, c,
                  (b, 1 + n, c), with_prefix),
        LayerCase(f"dtn tokens, pooled grid {big[0]}x{big[1]} -> {pool}x{pool}", "dtn", hp, c // 2,
                  (b, big[0] * big[1], c // 2), pooled),
        LayerCase(f"dtn channels-last map {big[0]}x{big[1]} (pooled)", "dtn", hp, c // 2,
                  (b, *big, c // 2), {**tokens, "num_heads": heads // 2}),
        LayerCase(f"dtn channels-first map {grid[0]}x{grid[1]}", "dtn", hp, c, (b, c, *grid),
                  {"data_format": "channels_first", "num_heads": heads}),
    ]
    groups = [dyt, dtn]
    for norm in list_norms():
        if norm in ("dyt", "dtn") or option_choices(norm, "kernels") is None:
            continue
        fns = option_choices(norm, "fn") or [None]
        groups.append([LayerCase(f"{norm}{f' {fn}' if fn else ''}, tokens ({b}, {1 + n}, {c})", norm,
                                 {"fn": fn} if fn else {}, c, (b, 1 + n, c), tokens) for fn in fns])
    return [case for row in itertools.zip_longest(*groups) for case in row if case is not None]


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


def check_fused(section: Section, device: torch.device, dry_run: bool, mode: str) -> None:
    section.lines += [f"Tolerances: float32 compiled vs autograd, max |diff| / max |ref| <= {FP32_TOL:g} (a "
                      f"gradient's max |ref| at least {GRAD_FLOOR:g} x the case's largest gradient); bf16 "
                      f"autocast (bf16 input, as after a Linear) vs float32 autograd at that input <= "
                      f"{BF16_TOL:g} (or <= {PLAIN_BF16_SLACK:g} x the plain ops' own bf16 error there), "
                      f"gradients finite, output dtype = LayerNorm's for the same input.", "",
                      "| case | fp32: y | fp32: grads (worst) | bf16: y dtype (LN's) | bf16: y | bf16: grads "
                      "(worst) | verdict | s |", "|---|---|---|---|---|---|---|---|"]
    gen = torch.Generator().manual_seed(0)
    cases, seconds = layer_cases(dry_run), []
    with captured_warnings() as warnings:
        for i, case in enumerate(cases):
            if seconds and section.left() < max(seconds):  # the slowest case so far would not fit
                rest, left = cases[i:], max(0.0, section.left())
                section.cut(f"\nNOT RUN (budget): {len(rest)} of {len(cases)} cases, {left:.0f} s left, the "
                            f"slowest case took {max(seconds):.0f} s: " + "; ".join(c.label for c in rest))
                break
            start = time.monotonic()
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
            # a sum that cancels (a scalar's gradient) can lose more than BF16_TOL in bf16 whatever the
            # kernel: then the fused path may lose what the plain ops lose under the same autocast
            y_plain16, g_plain16 = forward_backward(plain, x16, grad, torch.bfloat16)
            y_tol = max(BF16_TOL, PLAIN_BF16_SLACK * rel_err(y_plain16, y_ref16))
            g_tol = max(BF16_TOL, PLAIN_BF16_SLACK * worst_grad(g_plain16, g_ref16)[0])
            ok = (fp32_y <= FP32_TOL and fp32_g[0] <= FP32_TOL and y16.dtype == ln_dtype and finite
                  and bf16_y <= y_tol and bf16_g[0] <= g_tol and set(g) == set(g_ref) == set(g16))
            section.ok &= ok
            seconds.append(time.monotonic() - start)
            dtype = f"{str(y16.dtype).removeprefix('torch.')} ({str(ln_dtype).removeprefix('torch.')})"
            section.lines.append(
                f"| {case.label} | {fp32_y:.1e} | {fp32_g[0]:.1e} ({fp32_g[1]}) | {dtype} | {bf16_y:.1e} | "
                f"{bf16_g[0]:.1e} ({bf16_g[1]}){'' if finite else ', NOT FINITE'} | "
                f"{'pass' if ok else 'FAIL'} | {seconds[-1]:.1f} |")
    fallbacks = [w for w in warnings if "torch.compile" in w or "recompile_limit" in w]
    if fallbacks:
        section.fail(f"\nFAIL: compiled kernels ran op by op: {fallbacks[0].splitlines()[0]}")


# ----------------------------------------------------------------------------- 2 and 3. benchmarks
def run_logged(cmd: list[str], section: Section, what: str, estimate: float) -> bool:
    """Run a benchmark command if ``estimate`` seconds are left of the section, echo its output, and fail the
    section (naming the command) when it fails; stopped at the section's end, its last output lines go into
    the table. Whether it finished."""
    if not section.fits(what, estimate):
        return False
    print("$", " ".join(cmd), flush=True)
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=section.timeout())
    except subprocess.TimeoutExpired as e:
        partial = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else e.stdout or ""
        section.cut(f"CUT (budget): {what}: stopped after {e.timeout:.0f} s: `{' '.join(cmd)}`; its last "
                    f"output lines:\n\n```\n" + "\n".join(partial.strip().splitlines()[-8:]) + "\n```\n")
        return False
    print(proc.stdout[-4000:], proc.stderr[-4000:], sep="\n", flush=True)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        section.fail(f"FAIL: exit {proc.returncode}: `{' '.join(cmd)}`: {tail}\n")
        return False
    return True


def embed(path: Path) -> list[str]:
    """A benchmark's table, without its own title (the section header says the same)."""
    if not path.is_file():
        return [f"(no table: {path.name} was not written)"]
    return [line for line in path.read_text().splitlines() if not line.startswith("# ")] + [""]


def target_rows(ratios: dict[str, float], targets: dict[str, float], baseline: str) -> list[str]:
    """The issue's targets as a table: each normalizer's time ratio to ``baseline``, met or not met."""
    lines = [f"| norm | time x {baseline} | target | |", "|---|---|---|---|"]
    for norm, target in targets.items():
        ratio = ratios.get(norm)
        measured = "not measured" if ratio is None else f"{ratio:.3f}x"
        verdict = "not measured" if ratio is None else "met" if ratio <= target else "NOT MET"
        lines.append(f"| {norm} | {measured} | <= {target:.2f}x | {verdict} |")
    return [*lines, ""]


def step_ratios(figures: Path) -> dict[str, float]:
    """``scripts/bench_train.py --json``'s ``ours <norm>`` step times over ``ours ln``'s."""
    cases = {c["name"]: c["step_s"] for c in json.loads(figures.read_text())["cases"]}
    return {name.removeprefix("ours "): s / cases["ours ln"] for name, s in cases.items()
            if name.startswith("ours ")}


def table_ratios(path: Path) -> dict[str, float]:
    """The last column (``<r>x``: time vs the first row) of ``scripts/bench_dit.py``'s table."""
    rows = [line.strip("|").split("|") for line in path.read_text().splitlines() if line.startswith("| ")]
    return {cells[0].strip(): float(cells[-1].strip().removesuffix("x")) for cells in rows
            if cells[-1].strip().endswith("x")}


def check_steps(section: Section, device: torch.device, dry_run: bool, work: Path) -> None:
    train, dit = str(ROOT / "scripts" / "bench_train.py"), str(ROOT / "scripts" / "bench_dit.py")
    # the dry run compiles the micro ViT with LN alone (a compile of a ViT step takes a minute on a CPU)
    vit = (["--backbone", "vit_micro", "--img-size", "16", "--num-classes", "10", "--batch", "2", "--warmup",
            "1", "--steps", "1", "--rounds", "1"] if dry_run else
           ["--backbone", "vit_base", "--img-size", "224", "--num-classes", "1000", "--batch", "64",
            "--warmup", "2", "--steps", "5", "--rounds", "3"])
    vit += ["--precision", "bf16", "--layout", "none", "--device", str(device)]
    norms = ["ln", *STEP_TARGETS]
    dit_size = (["--backbone", "dit_micro", "--batch", "2", "--input-size", "8", "--warmup", "1",
                 "--steps", "1", "--rounds", "1"] if dry_run else
                ["--backbone", "dit_b4", "--batch", "64", "--input-size", "32", "--warmup", "2",
                 "--steps", "4", "--rounds", "3"])
    dit_size += ["--norms", "ln", *DIT_TARGETS, "dyt", "--device", str(device)]
    estimate = (lambda key: 0.0) if dry_run else ESTIMATE_S.get

    # 1. the targets: ViT-B's bf16 step compiled, DiT-B/4's fp32 step (DiT trains in fp32)
    out, figures = work / "steps_compiled.md", work / "steps_compiled.json"
    if run_logged([sys.executable, train, *vit, "--compile", "--no-timm", "--trainer-steps", "0",
                   "--norms", *(["ln"] if dry_run else norms), "--out", str(out), "--json", str(figures)],
                  section, "ViT step, bf16, compiled", estimate("vit_b compiled")):
        section.lines += ["## ViT step, bf16, torch.compile on", "", *embed(out),
                          "Targets (the issue's, ViT-B):", "",
                          *target_rows(step_ratios(figures), STEP_TARGETS, "ours ln")]
    out = work / "dit.md"
    if run_logged([sys.executable, dit, *dit_size, "--out", str(out)], section, "DiT step, fp32",
                  estimate("dit fp32")):
        section.lines += ["## DiT step, fp32", "", *embed(out), "Targets (the issue's, DiT-B/4):", "",
                          *target_rows(table_ratios(out), DIT_TARGETS, "ln")]
    # 2. as time allows: eager against timm's model and the trainer's overhead (their targets: bench_train's
    # table), DiT in bf16
    out = work / "steps_eager.md"
    if run_logged([sys.executable, train, *vit, "--trainer-steps", "2" if dry_run else "4", "--norms",
                   *norms, "--out", str(out)], section, "ViT step, bf16, eager, against timm",
                  estimate("vit_b eager")):
        section.lines += ["## ViT step, bf16, torch.compile off, against timm's model", "", *embed(out)]
    out = work / "dit_bf16.md"
    if run_logged([sys.executable, dit, *dit_size, "--amp", "bf16", "--out", str(out)], section,
                  "DiT step, bf16", estimate("dit bf16")):
        section.lines += ["## DiT step, bf16", "", *embed(out)]


class TimmFastLayerNorm(nn.Module):
    """timm's fast norm of a LayerNorm (``timm.layers.fast_norm.fast_layer_norm``): under autocast it casts
    the input and the affine parameters to the autocast dtype and normalizes there, without autocast's
    float32 upcast (Apex's behaviour), so it reads and writes bf16."""

    def __init__(self, ln: nn.LayerNorm) -> None:
        super().__init__()
        self.ln = ln

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from timm.layers.fast_norm import fast_layer_norm

        return fast_layer_norm(x, list(self.ln.normalized_shape), self.ln.weight, self.ln.bias, self.ln.eps)


def timed_layers(dim: int, context: dict[str, Any], backend: str
                 ) -> list[tuple[str, bool, Callable[[], nn.Module]]]:
    """(label, has the issue's target, builder) of the layer benchmark: the three LN baselines first (LN
    compiled by ``backend``), then DyT, Derf, every other point-wise function, RMSNorm and DTN, each on its
    default (fused) path."""
    ln = norm_layer_factory("ln")

    def compiled_ln() -> nn.Module:
        return torch.compile(ln(dim, **context), backend=backend)

    rows: list[tuple[str, bool, Callable[[], nn.Module]]] = [
        ("ln eager", False, lambda: ln(dim, **context)), ("ln compiled", False, compiled_ln),
        ("ln timm fast norm", False, lambda: TimmFastLayerNorm(ln(dim, **context)))]
    fns = [fn for fn in option_choices("pointwise", "fn") or [] if fn != "erf"]  # erf: derf
    for label, norm, hparams in [("dyt", "dyt", {}), ("derf", "derf", {}),
                                 *[(f"pointwise {fn}", "pointwise", {"fn": fn}) for fn in fns],
                                 ("rms", "rms", {}), ("dtn", "dtn", {})]:
        rows.append((label, norm in ("dyt", "derf", "pointwise"),
                     lambda norm=norm, hparams=hparams: norm_layer_factory(norm, **hparams)(dim, **context)))
    return rows


@dataclass
class TimedLayer:
    label: str
    target: bool
    layer: nn.Module
    warmup_s: float
    out_dtype: torch.dtype
    ms: list[float] = field(default_factory=list)


def check_layers(section: Section, device: torch.device, dry_run: bool, work: Path) -> None:
    kernels.COMPILE_AFTER_CALLS = 0  # the steady state of a long run: fused kernels from the first call
    b, dim, heads, grid = (2, 32, 4, (4, 4)) if dry_run else (64, 768, 12, (14, 14))
    warmup, repeats, rounds = (1, 2, 1) if dry_run else (3, 20, 3)
    context = {"data_format": "channels_last", "num_heads": heads, "num_prefix_tokens": 1,
               "layout": TokenLayout(grid=grid, num_prefix_tokens=1)}
    gen = torch.Generator().manual_seed(0)
    shape = (b, 1 + grid[0] * grid[1], dim)
    x = torch.randn(shape, generator=gen).to(device, torch.bfloat16).requires_grad_()
    grad32 = torch.randn(shape, generator=gen).to(device)
    grads = {torch.float32: grad32, torch.bfloat16: grad32.bfloat16()}

    def fwd_bwd(layer: nn.Module) -> torch.dtype:
        x.grad = None
        with torch.autocast(device.type, dtype=torch.bfloat16):
            y = layer(x)
        y.backward(grads[y.dtype])
        return y.dtype

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    layers: list[TimedLayer] = []
    # the dry run stops short of inductor: its C++ build of LN takes 10 s on a CPU and says nothing of Triton
    rows, skipped, slowest = timed_layers(dim, context, "aot_eager" if dry_run else "inductor"), [], 0.0
    for label, target, build in rows:
        baseline = label.startswith("ln ")
        if not baseline and section.left() < slowest + TIMING_RESERVE_S:
            skipped.append(label)
            continue
        start = time.monotonic()
        torch.manual_seed(0)
        layer = build().to(device).train()
        for _ in range(warmup):  # compiles the fused kernels (counted in the budget)
            out_dtype = fwd_bwd(layer)
        sync()
        layers.append(TimedLayer(label, target, layer, time.monotonic() - start, out_dtype))
        slowest = max(slowest, layers[-1].warmup_s)
    done = 0
    for _ in range(rounds):  # interleaved: every layer once per round
        start = time.monotonic()
        for timed in layers:
            sync()
            t0 = time.perf_counter()
            for _ in range(repeats):
                fwd_bwd(timed.layer)
            sync()
            timed.ms.append((time.perf_counter() - t0) * 1e3 / repeats)
        done += 1
        if section.left() < time.monotonic() - start:
            break
    base = {t.label: statistics.median(t.ms) for t in layers if t.label.startswith("ln ")}
    section.lines += [
        f"Forward+backward of one layer on {'tiny' if dry_run else 'ViT-B'} tokens {shape} (grid "
        f"{grid[0]}x{grid[1]} + 1 prefix token, {heads} heads), bf16 autocast: bf16 input (as after a "
        f"Linear), float32 parameters; each on its default path (fused kernels compiled from the first "
        f"call), warm-up {warmup} (compiles included, counted in the budget), {done} of {rounds} "
        f"interleaved rounds of {repeats} repeats, median over rounds. The three LayerNorm baselines run in "
        f"the same rounds: eager (autocast upcasts it to float32), torch.compile-d, and timm's fast norm "
        f"(bf16 in and out). Target (the issue's): DyT, Derf and every point-wise function <= "
        f"{LAYER_TARGET:.1f}x compiled LN.", "",
        "| norm | out dtype | warm-up s | fwd+bwd ms | x LN eager | x LN compiled | x LN timm fast norm | "
        "target |", "|---|---|---|---|---|---|---|---|"]
    for t in layers:
        ms = statistics.median(t.ms)
        ratio = ms / base["ln compiled"]
        target = (f"{'met' if ratio <= LAYER_TARGET else 'NOT MET'} (<= {LAYER_TARGET:.1f}x LN compiled)"
                  if t.target else "")
        section.lines.append(
            f"| {t.label} | {str(t.out_dtype).removeprefix('torch.')} | {t.warmup_s:.1f} | {ms:.3f} | "
            f"{ms / base['ln eager']:.2f} | {ratio:.2f} | {ms / base['ln timm fast norm']:.2f} | {target} |")
    section.lines.append("")
    if skipped:
        section.cut(f"NOT RUN (budget): {', '.join(skipped)}: less than the slowest warm-up so far "
                    f"({slowest:.0f} s) + {TIMING_RESERVE_S} s for the timed rounds was left\n")
    if done < rounds:
        section.cut(f"CUT (budget): {done} of {rounds} timed rounds\n")

    # every registered normalizer, time and memory, as time allows
    script = str(ROOT / "scripts" / "bench_norms.py")
    size = (["--batch", "2", "--warmup", "1", "--repeats", "1", "--rounds", "1", "--shapes", "vit_s",
             "--norms", "ln", "dyt", "dtn"] if dry_run else
            ["--batch", "64", "--warmup", "2", "--repeats", "10", "--rounds", "3", "--shapes", "vit_b"])
    for dtype in ("bfloat16", "float32"):
        out = work / f"layers_{dtype}.md"
        if run_logged([sys.executable, script, *size, "--device", str(device), "--dtype", dtype,
                       "--out", str(out)], section, f"scripts/bench_norms.py, {dtype}",
                      0.0 if dry_run else ESTIMATE_S[f"bench_norms {dtype}"]):
            section.lines += [f"## scripts/bench_norms.py, {dtype} tensors (no autocast)", "", *embed(out)]


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


def check_run(section: Section, device: torch.device, dry_run: bool, work: Path, gpus: int, log_dir: Path
              ) -> None:
    if not section.fits("the torchrun runs", 0.0 if dry_run else ESTIMATE_S["run"]):
        return
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
    procs: dict[str, subprocess.Popen] = {}  # by log file
    started: dict[str, float] = {}
    ended: dict[str, float] = {}

    def launch(root: Path, log: str) -> None:
        """The run under an output root of its own (its record: the one directory there), its whole output
        into ``log`` (a file, not a pipe: runs go on side by side), for whoever reads the table."""
        print(f"$ NORMEXP_OUTPUT_DIR={root}", " ".join(torchrun + overrides), f"> {log}", flush=True)
        started[log] = time.monotonic()
        with open(log_dir / log, "w") as sink:
            procs[log] = subprocess.Popen([*torchrun, *overrides], cwd=ROOT, stdout=sink,
                                          env={**env, "NORMEXP_OUTPUT_DIR": str(root)},
                                          stderr=subprocess.STDOUT, start_new_session=True)

    def record(root: Path) -> Path:
        return next(root.glob("classification/*"), root / "not-started")

    def wait(logs: list[str], until: Callable[[], bool] = lambda: False) -> list[str]:
        """Wait until the runs of ``logs`` ended or ``until()``; at the section's end kill every run still
        going. The logs of the runs killed so."""
        while True:
            for log, proc in procs.items():
                if proc.poll() is not None:
                    ended.setdefault(log, time.monotonic())
            if all(log in ended for log in logs) or until():
                return []
            if section.left() <= 0:
                running = [log for log in procs if log not in ended]
                for log in running:
                    kill_tree(procs[log].pid)
                    procs[log].wait()
                return running
            time.sleep(0.2)

    def output(log: str) -> str:
        return (log_dir / log).read_text(errors="replace")

    # the uninterrupted run and the one to be killed go side by side: they share the GPU, not results
    try:
        launch(work / "run_reference", "run_uninterrupted.log")
        launch(work / "run_killed", "run_killed.log")
        checkpoint = work / "run_killed"
        cut = wait(["run_killed.log"], until=lambda: (record(checkpoint) / "checkpoint.pth").exists())
        kill_tree(procs["run_killed.log"].pid)
        procs["run_killed.log"].wait()
        after_kill = status_of(record(work / "run_killed"))
        if not cut:
            launch(work / "run_killed", "run_resumed.log")  # the same command continues it
            cut = wait(["run_uninterrupted.log", "run_resumed.log"])
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                kill_tree(proc.pid)
                proc.wait()
    reference, killed = record(work / "run_reference"), record(work / "run_killed")
    code = procs["run_uninterrupted.log"].returncode
    out = output("run_uninterrupted.log")
    breaks, recompiles = count_compile_events(out)
    seconds = ended.get("run_uninterrupted.log", time.monotonic()) - started["run_uninterrupted.log"]
    section.lines += [f"Command: `torchrun --standalone --nproc_per_node={nproc} -m normexp "
                      f"{' '.join(overrides)}` (each under an output root of its own; the uninterrupted and "
                      f"the killed run side by side)", "",
                      "| run | exit | status | epochs | wall s | graph breaks | recompiles |",
                      "|---|---|---|---|---|---|---|",
                      f"| uninterrupted | {code} | {status_of(reference)} | {len(epoch_rows(reference))} | "
                      f"{seconds:.0f} | {breaks} | {recompiles} |"]
    resumed = procs.get("run_resumed.log")
    code, out = (resumed.returncode, output("run_resumed.log")) if resumed else (None, "")
    section.lines.append(f"| killed after its first checkpoint ({after_kill}), then the same command | "
                         f"{code} | {status_of(killed)} | {len(epoch_rows(killed))} | | "
                         f"{'/'.join(map(str, count_compile_events(out)))} | |")
    if cut:
        section.cut(f"\nCUT (budget): {', '.join(cut)} still running at the section's end: killed")
        return
    uninterrupted = output("run_uninterrupted.log")
    if procs["run_uninterrupted.log"].returncode != 0:
        section.fail(f"\nFAIL: the uninterrupted run exited {procs['run_uninterrupted.log'].returncode}: "
                     f"{uninterrupted.strip().splitlines()[-1:]}")
    if breaks or recompiles > EXPECTED_RECOMPILES:
        lines = [line for line in uninterrupted.splitlines()
                 if "Graph break" in line or "Recompiling" in line]
        section.fail(f"\nFAIL: {breaks} graph breaks, {recompiles} recompiles (expected 0 and at most "
                     f"{EXPECTED_RECOMPILES}); first: {lines[:1]}")
    if after_kill == "completed":
        section.fail("\nFAIL: the run completed before it could be killed: lengthen it")
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


# ----------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {SECTIONS}")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--gpus", type=int, default=None,
                        help="processes of the real run (default: every GPU)")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "bench" / "gpu")
    parser.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                        help=f"wall seconds for the whole check (default {DEFAULT_BUDGET_S}; 0: no limit), "
                        f"split over the chosen sections as {PLAN_S}")
    parser.add_argument("--fused-mode", default="compiled", choices=["compiled", "eager"],
                        help="the fused path checked against the plain ops: compiled (the point of the "
                        "check), or its kernels op by op (seconds instead of minutes on a CPU)")
    parser.add_argument("--dry-run", action="store_true",
                        help="on the CPU at tiny sizes: every code path, no meaningful figures")
    args = parser.parse_args(argv)
    chosen = {s.strip() for s in args.sections.split(",") if s.strip()}
    unknown = sorted(chosen - set(SECTIONS))
    if unknown:
        parser.error(f"unknown section(s) {unknown}; choose from {', '.join(SECTIONS)}")
    sections = [s for s in SECTIONS if s in chosen]  # most valuable first, whatever the order asked
    device = torch.device("cpu" if args.dry_run else args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: CUDA is not available here: run this on a GPU machine, or pass --dry-run to exercise "
              "the same code paths on the CPU", file=sys.stderr)
        return 2
    gpus = args.gpus or (torch.cuda.device_count() if device.type == "cuda" else 1)
    args.out.mkdir(parents=True, exist_ok=True)
    head = header(device)
    budget = args.budget_s if args.budget_s > 0 else math.inf
    head.append(f"- budget: {budget:.0f} s for sections {', '.join(sections)}" if budget < math.inf
                else "- budget: none")
    print("\n".join(head), flush=True)
    start = time.monotonic()  # the budget counts from here (the header above takes a second)
    work = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    titles = {"fused": f"Fused kernels ({args.fused_mode}) = plain ops on the device",
              "layers": "Normalizer layers: forward+backward against three LayerNorm baselines",
              "steps": "Whole training steps",
              "run": "A real run: DeiT recipe, ViT-S, torchrun, kill -9 and resume"}
    checks: dict[str, Callable[[Section], None]] = {
        "fused": lambda s: check_fused(s, device, args.dry_run, args.fused_mode),
        "layers": lambda s: check_layers(s, device, args.dry_run, work),
        "steps": lambda s: check_steps(s, device, args.dry_run, work),
        "run": lambda s: check_run(s, device, args.dry_run, work, gpus, args.out),
    }
    # each section ends by its share of the budget counted from the start: what one leaves goes on
    total, planned = sum(PLAN_S[s] for s in sections), 0.0
    results: list[Section] = []
    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        for name in sections:
            planned += PLAN_S[name]
            section = Section(name, titles[name], deadline=start + budget * planned / total,
                              planned=budget * PLAN_S[name] / total)
            section_start = time.monotonic()
            if STOPPED:
                section.cut("NOT RUN: the check was stopped (SIGTERM) before this section")
            elif section.left() <= 0:
                section.cut("NOT RUN (budget): no time was left for this section")
            else:
                try:
                    checks[name](section)
                except Exception as e:  # a crash in one section is that section's failure, not the end
                    if not STOPPED:
                        section.fail(f"FAIL: {type(e).__name__}: {e}")
                if STOPPED:
                    section.cut("\nCUT: the check was stopped (SIGTERM) here")
            section.seconds = time.monotonic() - section_start
            path = section.write(args.out, head)
            results.append(section)
            print(f"== {name}: {section.status} in {section.seconds:.0f} s -> {path}", flush=True)
    finally:
        signal.signal(signal.SIGTERM, previous)
        shutil.rmtree(work, ignore_errors=True)
    print("\n".join(f"{s.name}: {s.status} ({s.seconds:.0f} s)" for s in results))
    print(f"total {time.monotonic() - start:.0f} s of a budget of {budget:.0f} s")
    if not all(s.ok for s in results):
        return 1
    return 0 if all(s.complete for s in results) else 3


if __name__ == "__main__":
    sys.exit(main())
