"""Forward+backward time and activation memory of every registered normalizer at ViT token shapes.

Each normalizer is built through ``norm_layer_factory`` exactly as a model would build it (tokens
(B, 1 + 14*14, C): one class token + a 14x14 grid, ``num_heads`` and a ``TokenLayout`` as context) and run
in training mode. Reported per shape:

* time: median over ``--repeats`` timed iterations (after ``--warmup``) of forward + backward with a fixed
  random output gradient (CUDA: synchronised);
* memory, one honest method per device:
  - ``saved``: bytes of the tensors autograd saves for backward (``torch.autograd.graph.saved_tensors_hooks``,
    unique storages, parameters and buffers excluded, the input included); device independent;
  - ``peak`` (CUDA only): ``torch.cuda.max_memory_allocated`` during forward+backward minus the memory
    allocated before it (input, output gradient, parameters);
* ratios to LN measured in the same run, and the targets DyT <= 0.9x LN and DTN <= 2.0x LN (pass/fail,
  for time and for memory).

PowerNorm is timed after its warm-up (``warmup_iters=0``): the steady state of a long run.

    OMP_NUM_THREADS=1 python scripts/bench_norms.py --batch 8 --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from normexp.norms import TokenLayout, list_norms, norm_layer_factory

SHAPES = {"vit_s": (384, 6), "vit_b": (768, 12)}  # (C, heads); grid 14x14 + 1 class token
TARGETS = {"dyt": 0.9, "dtn": 2.0, "dtn-dense": 2.0}  # max ratio to LN
# row name -> (registered normalizer, hyper-parameters)
VARIANTS = {
    "power": ("power", {"warmup_iters": 0}),  # steady state, see module docstring
    "dtn-dense": ("dtn", {"separable": False}),  # the official dense [H, T, T] position matrix
}


@dataclass
class Result:
    norm: str
    fwd_ms: float
    fwd_bwd_ms: float
    saved_mb: float
    peak_mb: float | None


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


def time_ms(fn: Callable[[], None], device: torch.device, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def bench_one(name: str, dim: int, heads: int, batch: int, device: torch.device, dtype: torch.dtype,
              warmup: int, repeats: int) -> Result:
    layout = TokenLayout(grid=(14, 14), num_prefix_tokens=1)
    norm, hparams = VARIANTS.get(name, (name, {}))
    build = norm_layer_factory(norm, **hparams)
    module = build(dim, data_format="channels_last", num_heads=heads, layout=layout, num_prefix_tokens=1)
    module = module.to(device=device, dtype=dtype).train()
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(batch, 1 + 14 * 14, dim, generator=gen).to(device, dtype).requires_grad_()
    grad = torch.randn(x.shape, generator=gen).to(device, dtype)

    def fwd() -> None:
        with torch.no_grad():
            module(x)

    def fwd_bwd() -> None:
        x.grad = None
        module(x).backward(grad)

    fwd_ms = time_ms(fwd, device, warmup, repeats)
    fwd_bwd_ms = time_ms(fwd_bwd, device, warmup, repeats)
    saved = saved_bytes(module, x) / 2**20
    peak = None
    if device.type == "cuda":
        x.grad = None
        _sync(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fwd_bwd()
        _sync(device)
        peak = (torch.cuda.max_memory_allocated(device) - base) / 2**20
    return Result(name, fwd_ms, fwd_bwd_ms, saved, peak)


def verdict(name: str, ratio: float) -> str:
    if name not in TARGETS:
        return ""
    return f"{'pass' if ratio <= TARGETS[name] else 'FAIL'} (<={TARGETS[name]}x)"


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
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    args = parser.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    norms = args.norms or sorted([*list_norms(), *VARIANTS])
    if "ln" not in norms:
        norms = ["ln", *norms]
    mem_method = "saved = autograd saved_tensors_hooks bytes (unique storages, excl. params)"
    if device.type == "cuda":
        mem_method += "; peak = cuda max_memory_allocated over fwd+bwd minus baseline"
    print(f"device={device} dtype={args.dtype} batch={args.batch} threads={torch.get_num_threads()} "
          f"torch={torch.__version__}\nmemory: {mem_method}\n")
    for shape in args.shapes:
        dim, heads = SHAPES[shape]
        results = {n: bench_one(n, dim, heads, args.batch, device, dtype, args.warmup, args.repeats)
                   for n in norms}
        ln = results["ln"]
        print(f"== {shape}: tokens ({args.batch}, 197, {dim}), {heads} heads, grid 14x14 + 1 prefix ==")
        header = (f"{'norm':<10}{'fwd ms':>9}{'fwd+bwd ms':>12}{'x LN':>7}{'saved MB':>10}{'x LN':>7}"
                  + (f"{'peak MB':>9}{'x LN':>7}" if device.type == "cuda" else "")
                  + f"  {'time target':<16}{'memory target':<16}")
        print(header)
        print("-" * len(header))
        for name, r in results.items():
            t_ratio = r.fwd_bwd_ms / ln.fwd_bwd_ms
            m_ratio = r.saved_mb / ln.saved_mb
            mem = m_ratio
            line = (f"{name:<10}{r.fwd_ms:>9.2f}{r.fwd_bwd_ms:>12.2f}{t_ratio:>7.2f}"
                    f"{r.saved_mb:>10.1f}{m_ratio:>7.2f}")
            if r.peak_mb is not None and ln.peak_mb:
                mem = r.peak_mb / ln.peak_mb
                line += f"{r.peak_mb:>9.1f}{mem:>7.2f}"
            print(f"{line}  {verdict(name, t_ratio):<16}{verdict(name, mem):<16}")
        print()


if __name__ == "__main__":
    main()
