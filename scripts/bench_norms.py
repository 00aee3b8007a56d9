"""Forward+backward time and activation memory of every registered normalizer at ViT token shapes.

Each normalizer is built through ``norm_layer_factory`` exactly as a model would build it (tokens
(B, 1 + 14*14, C): one class token + a 14x14 grid, ``num_heads`` and a ``TokenLayout`` as context) and run
in training mode. Reported per shape, in interleaved rounds (every normalizer once per round, so that a slow
spell of a shared machine hits all of them; the median over rounds):

* time: median over ``--repeats`` timed iterations (after ``--warmup``, which also compiles any fused
  kernels) of forward + backward with a fixed random output gradient (CUDA: synchronised);
* the memory-bound floor of the shape: ``y = x * s`` forward and backward (``s`` a runtime scalar, so
  nothing folds away), compiled by ``torch.compile`` into one read + write pass each way -- or, where
  torch.compile cannot build kernels, the same two ATen multiplications (the header says which);
* memory, one honest method per device:
  - ``saved``: bytes of the tensors autograd saves for backward (``torch.autograd.graph.saved_tensors_hooks``,
    unique storages, parameters and buffers excluded, the input included); device independent;
  - ``peak`` (CUDA only): ``torch.cuda.max_memory_allocated`` during forward+backward minus the memory
    allocated before it (input, output gradient, parameters);
* ratios to LN and to the floor measured in the same run, and the project's targets (``TARGETS``; issue 48:
  at ViT-S tokens DyT and RMS <= 1.0x LN, every point-wise function <= 1.5x LN with at most LN's saved
  memory; the DyT paper's Table 15 finds DyT as fast as a fused norm).

Rows: every registered normalizer (the registry, not a hand list) with its defaults; a family of functions
(``norm=pointwise``) one row per ``fn`` (``pointwise-<fn>``); ``-plain`` rows are the same normalizer with
``kernels=autograd`` (plain ops, autograd's backward), to show what the fused kernels of the default rows buy.
PowerNorm is timed after its warm-up (``warmup_iters=0``): the steady state of a long run. The
normalization-free methods (``none``, ``skipinit``, ``fixup``, ``sigma_reparam``) put the identity in the norm
slot and have no layer to time: the tables name them, and ``scripts/bench_train.py`` times their models.

    python scripts/bench_norms.py --batch 64 --threads 2
"""

from __future__ import annotations

import argparse
import fnmatch
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from normexp.norms import TokenLayout, get_norm_class, kernels, list_norms, norm_layer_factory  # noqa: E402
from normexp.norms.kernels import compiler_available  # noqa: E402
from normexp.norms.normfree import NoNorm  # noqa: E402
from normexp.norms.registry import hyperparameters  # noqa: E402

SHAPES = {"vit_s": (384, 6), "vit_b": (768, 12)}  # (C, heads); grid 14x14 + 1 class token
# (shape, max forward+backward time ratio to LN)
# (row pattern, shape) -> (max forward+backward time x LN, max saved memory x LN or None)
TARGETS = {("dyt", "vit_s"): (1.0, 1.0), ("dyt", "vit_b"): (1.0, None), ("rms", "vit_s"): (1.0, None),
           ("derf", "vit_s"): (1.5, 1.0), ("pointwise-*", "vit_s"): (1.5, 1.0)}
# a family of normalizers behind one name: one row per choice of this hyper-parameter
FAMILIES = {"pointwise": "fn"}
# row name -> (registered normalizer, hyper-parameters), beside the registered names and the families' rows
VARIANTS = {
    "power": ("power", {"warmup_iters": 0}),  # steady state, see module docstring
    "dtn-dense": ("dtn", {"separable": False}),  # the official dense [H, T, T] position matrix
}
FLOOR = "floor"


def family_rows() -> dict[str, tuple[str, dict]]:
    """``<norm>-<choice>`` -> (norm, {option: choice}) for every choice of every family's option."""
    rows = {}
    for norm, option in FAMILIES.items():
        (param,) = [p for p in hyperparameters(norm) or [] if p.name == option]
        rows.update({f"{norm}-{choice}": (norm, {option: choice}) for choice in param.checks["choices"]})
    return rows


def identity_norms() -> list[str]:
    """Registered normalizers that put the identity in the slot (their method acts on the model)."""
    return [n for n in list_norms() if issubclass(get_norm_class(n), NoNorm)]


def plain_rows() -> dict[str, tuple[str, dict]]:
    """``<norm>-plain`` -> (norm, {"kernels": "autograd"}) for every normalizer with fused kernels."""
    return {f"{n}-plain": (n, {"kernels": "autograd"}) for n in list_norms()
            if any(p.name == "kernels" for p in hyperparameters(n) or [])}


def row_definitions() -> dict[str, tuple[str, dict]]:
    """Every row name beyond a registered normalizer's own -> (normalizer, hyper-parameters)."""
    return {**family_rows(), **plain_rows(), **VARIANTS}


def default_rows() -> list[str]:
    """Every registered normalizer with a layer to time, a family as its members, and the variants."""
    names = {*list_norms(), *row_definitions()} - {*FAMILIES, *identity_norms()}
    return sorted(names)


@dataclass
class Result:
    norm: str
    fwd_ms: list[float] = field(default_factory=list)
    fwd_bwd_ms: list[float] = field(default_factory=list)
    saved_mb: float = float("nan")
    peak_mb: float | None = None

    @property
    def fwd(self) -> float:
        return statistics.median(self.fwd_ms)

    @property
    def fwd_bwd(self) -> float:
        return statistics.median(self.fwd_bwd_ms)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def saved_bytes(module: nn.Module, x: torch.Tensor) -> int:
    """Bytes of the unique storages autograd saves during one forward (parameters/buffers excluded)."""
    exclude = {t.untyped_storage().data_ptr() for t in [*module.parameters(), *module.buffers()]}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in exclude:
            storages[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = module(x)
    del y
    return sum(storages.values())


def time_ms(fn: Callable[[], None], device: torch.device, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


class Floor(nn.Module):
    """``x * s``: one read and one write of the tensor each way; compiled into one loop where possible."""

    def __init__(self, compiled: bool) -> None:
        super().__init__()
        self.register_buffer("scale", torch.tensor(1.0))
        self.fn = torch.compile(torch.mul) if compiled else torch.mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x, self.scale)


def build_row(name: str, dim: int, heads: int) -> nn.Module:
    """The row's normalizer as a ViT builds it for tokens of a 14x14 grid + 1 class token."""
    norm, hparams = row_definitions().get(name, (name, {}))
    layout = TokenLayout(grid=(14, 14), num_prefix_tokens=1)
    build = norm_layer_factory(norm, **hparams)
    return build(dim, data_format="channels_last", num_heads=heads, layout=layout, num_prefix_tokens=1)


class Bench:
    """One normalizer at one shape: its module, input and output gradient, and its timings."""

    def __init__(self, name: str, dim: int, heads: int, batch: int, device: torch.device, dtype: torch.dtype,
                 compiled_floor: bool) -> None:
        module = Floor(compiled_floor) if name == FLOOR else build_row(name, dim, heads)
        self.module = module.to(device=device, dtype=dtype).train()
        gen = torch.Generator(device="cpu").manual_seed(0)
        self.x = torch.randn(batch, 1 + 14 * 14, dim, generator=gen).to(device, dtype).requires_grad_()
        self.grad = torch.randn(self.x.shape, generator=gen).to(device, dtype)
        self.device, self.result = device, Result(name)

    def fwd(self) -> None:
        with torch.no_grad():
            self.module(self.x)

    def fwd_bwd(self) -> None:
        self.x.grad = None
        self.module(self.x).backward(self.grad)

    def warm_up(self, warmup: int) -> None:
        for _ in range(warmup):
            self.fwd()
            self.fwd_bwd()
        self.result.saved_mb = saved_bytes(self.module, self.x) / 2**20
        if self.device.type == "cuda":
            self.x.grad = None
            _sync(self.device)
            base = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.fwd_bwd()
            _sync(self.device)
            self.result.peak_mb = (torch.cuda.max_memory_allocated(self.device) - base) / 2**20

    def time(self, repeats: int) -> None:
        self.result.fwd_ms.append(time_ms(self.fwd, self.device, repeats))
        self.result.fwd_bwd_ms.append(time_ms(self.fwd_bwd, self.device, repeats))


def cpu_name() -> str:
    """The CPU model, its physical cores and logical CPUs (from /proc/cpuinfo where there is one)."""
    name, cores = platform.processor() or platform.machine(), ""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        processors = [dict(line.split(":", 1) for line in block.splitlines() if ":" in line)
                      for block in cpuinfo.read_text().split("\n\n") if block.strip()]
        fields = [{k.strip(): v.strip() for k, v in p.items()} for p in processors]
        name = fields[0].get("model name", name) if fields else name
        physical = {(f.get("physical id"), f.get("core id")) for f in fields if "core id" in f}
        cores = f"{len(physical)} cores, " if physical else ""
    return f"{name}, {cores}{os.cpu_count()} logical CPUs"


def verdict(name: str, shape: str, time_ratio: float, memory_ratio: float) -> str:
    """The row's targets at this shape, each marked pass or FAIL ('' where it has none)."""
    marks = []
    for (pattern, target_shape), (max_time, max_memory) in TARGETS.items():
        if target_shape != shape or not fnmatch.fnmatchcase(name, pattern):
            continue
        marks.append(f"{'pass' if time_ratio <= max_time else 'FAIL'} (time <={max_time}x LN)")
        if max_memory is not None:
            marks.append(f"{'pass' if memory_ratio <= max_memory else 'FAIL'} (memory <={max_memory}x LN)")
    return ", ".join(marks)


def main() -> None:
    kernels.COMPILE_AFTER_CALLS = 0  # the steady state of a long run: fused kernels from the first call
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64, help="batch size (default 64)")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--norms", nargs="+", default=None,
                        help=f"rows (default: every registered normalizer, {', '.join(FAMILIES)} one row per "
                        f"{', '.join(FAMILIES.values())}, <norm>-plain where it has fused kernels, and "
                        f"{', '.join(VARIANTS)})")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (median over rounds)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    parser.add_argument("--out", type=Path, default=None, help="also write the tables to this markdown file")
    args = parser.parse_args()

    start = time.perf_counter()
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    norms = args.norms or default_rows()
    norms = ["ln", *[n for n in norms if n not in ("ln", FLOOR)], FLOOR]
    compiled_floor = compiler_available(device.type)
    machine = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    floor = ("torch.compile(x * s) forward and backward, one read + write pass each" if compiled_floor else
             "eager x * s forward and backward (torch.compile cannot build kernels here)")
    mem_method = "saved = autograd saved_tensors_hooks bytes (unique storages, excl. params)"
    if device.type == "cuda":
        mem_method += "; peak = cuda max_memory_allocated over fwd+bwd minus baseline"
    lines = [f"- machine: {machine}, {torch.get_num_threads()} torch threads, {platform.platform()}",
             f"- versions: python {platform.python_version()}, torch {torch.__version__}",
             f"- command: `{' '.join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]])}`",
             f"- device={device} dtype={args.dtype} batch={args.batch}; warm-up {args.warmup}, {args.rounds} "
             f"interleaved rounds of {args.repeats} repeats, median",
             f"- floor: {floor}", f"- memory: {mem_method}",
             f"- no layer to time (the identity in the norm slot; their cost is in the model, "
             f"scripts/bench_train.py): {', '.join(identity_norms())}", ""]
    print("\n".join(lines), flush=True)
    for shape in args.shapes:
        dim, heads = SHAPES[shape]
        benches = [Bench(n, dim, heads, args.batch, device, dtype, compiled_floor) for n in norms]
        for bench in benches:
            bench.warm_up(args.warmup)
        for _ in range(args.rounds):
            for bench in benches:
                bench.time(args.repeats)
        results = {b.result.norm: b.result for b in benches}
        ln, fl = results["ln"], results[FLOOR]
        cuda = device.type == "cuda"
        table = [f"### {shape}: tokens ({args.batch}, 197, {dim}), {heads} heads, grid 14x14 + 1 prefix", "",
                 f"{machine}, {torch.get_num_threads()} torch threads, torch {torch.__version__}, "
                 f"{args.dtype}", "",
                 "| norm | fwd ms | fwd+bwd ms | x LN | x floor | saved MB | x LN |"
                 + (" peak MB | x LN |" if cuda else "") + " target |",
                 "|---" * (8 + 2 * cuda) + "|"]
        for name, r in results.items():
            t_ratio = r.fwd_bwd / ln.fwd_bwd
            line = (f"| {name} | {r.fwd:.2f} | {r.fwd_bwd:.2f} | {t_ratio:.2f} | "
                    f"{r.fwd_bwd / fl.fwd_bwd:.2f} | "
                    f"{r.saved_mb:.1f} | {r.saved_mb / ln.saved_mb:.2f} |")
            if cuda:
                line += f" {r.peak_mb:.1f} | {r.peak_mb / ln.peak_mb:.2f} |"
            table.append(f"{line} {verdict(name, shape, t_ratio, r.saved_mb / ln.saved_mb)} |")
        print("\n".join(table) + "\n", flush=True)
        lines += [*table, ""]
    lines.append(f"Whole run: {time.perf_counter() - start:.0f} s (compiles included).")
    print(lines[-1])
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("# Normalizer benchmark (scripts/bench_norms.py)\n\n" + "\n".join(lines) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
