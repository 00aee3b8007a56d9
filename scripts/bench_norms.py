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
* ratios to LN and to the floor measured in the same run, and the project's target (DyT forward+backward
  <= 1.0x LN at the ViT-B token shape; the DyT paper's Table 15 finds DyT as fast as a fused norm).

``-plain`` rows are the same normalizer with ``kernels=autograd`` (plain ops, autograd's backward), to show
what the fused kernels of the default rows buy. PowerNorm is timed after its warm-up (``warmup_iters=0``):
the steady state of a long run.

    python scripts/bench_norms.py --batch 64 --threads 2
"""

from __future__ import annotations

import argparse
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

from normexp.norms import TokenLayout, kernels, list_norms, norm_layer_factory  # noqa: E402
from normexp.norms.kernels import compiler_available  # noqa: E402

kernels.COMPILE_AFTER_CALLS = 0  # the steady state of a long run: fused kernels from the first call

SHAPES = {"vit_s": (384, 6), "vit_b": (768, 12)}  # (C, heads); grid 14x14 + 1 class token
# (shape, max forward+backward time ratio to LN)
TARGETS = {"dyt": ("vit_b", 1.0)}
# row name -> (registered normalizer, hyper-parameters)
VARIANTS = {
    "power": ("power", {"warmup_iters": 0}),  # steady state, see module docstring
    "dtn-dense": ("dtn", {"separable": False}),  # the official dense [H, T, T] position matrix
    "dyt-plain": ("dyt", {"kernels": "autograd"}),
    "dtn-plain": ("dtn", {"kernels": "autograd"}),
}
FLOOR = "floor"


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


class Bench:
    """One normalizer at one shape: its module, input and output gradient, and its timings."""

    def __init__(self, name: str, dim: int, heads: int, batch: int, device: torch.device, dtype: torch.dtype,
                 compiled_floor: bool) -> None:
        if name == FLOOR:
            module = Floor(compiled_floor)
        else:
            layout = TokenLayout(grid=(14, 14), num_prefix_tokens=1)
            norm, hparams = VARIANTS.get(name, (name, {}))
            build = norm_layer_factory(norm, **hparams)
            module = build(dim, data_format="channels_last", num_heads=heads, layout=layout,
                           num_prefix_tokens=1)
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
    """The CPU model and logical CPU count (from /proc/cpuinfo where there is one)."""
    name = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        models = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                  if line.startswith("model name")]
        name = models[0] if models else name
    return f"{name}, {os.cpu_count()} logical CPUs"


def verdict(name: str, shape: str, ratio: float) -> str:
    if name not in TARGETS or TARGETS[name][0] != shape:
        return ""
    target = TARGETS[name][1]
    return f"{'pass' if ratio <= target else 'FAIL'} (<={target}x LN)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64, help="batch size (default 64)")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--norms", nargs="+", default=None,
                        help=f"normalizers (default: all registered + {', '.join(VARIANTS)})")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (median over rounds)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    parser.add_argument("--out", type=Path, default=None, help="also write the tables to this markdown file")
    args = parser.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    norms = args.norms or sorted([*list_norms(), *VARIANTS])
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
             f"- floor: {floor}", f"- memory: {mem_method}", ""]
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
            table.append(f"{line} {verdict(name, shape, t_ratio)} |")
        print("\n".join(table) + "\n", flush=True)
        lines += [*table, ""]
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("# Normalizer benchmark (scripts/bench_norms.py)\n\n" + "\n".join(lines))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
