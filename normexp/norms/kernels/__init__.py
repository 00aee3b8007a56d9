"""The fused paths of the point-wise family, RMSNorm and DTN: autograd Functions with hand-written backward
passes whose kernels run op by op (``eager``), ``torch.compile``-d (``compiled``) or, for the point-wise
family and RMSNorm on the CPU, as hand-written loops (``native``, :mod:`.native`); ``norm.kernels`` picks
the path, resolved per input."""

from __future__ import annotations

import collections
import functools
import logging
import shutil
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

from . import native

KERNEL_MODES = ("auto", "native", "compiled", "eager", "autograd")
# "auto" compiles only inputs at least this large (small tensors stay in cache, where fusing saves little) ...
COMPILE_MIN_NUMEL = 2**19
# ... and only shapes a layer kind has already run this many times: a compile costs seconds per shape and
# kernel, which shapes met a few times (the evaluation batches of a short run, a last partial batch) never
# win back. Benchmarks of the steady state set it to 0.
COMPILE_AFTER_CALLS = 50
_calls: collections.Counter = collections.Counter()
RECOMPILE_LIMIT = 64

# C++ kernels may fuse a*b+c into one FMA (more accurate, and it halves the arithmetic of polynomials)
_COMPILE_OPTIONS = {"cpp.enable_floating_point_contract_flag": "fast"}
# Inductor options for kernels whose intermediate values have several consumers: recompute them in each
# loop rather than store and re-read them (extra arithmetic is nearly free there, extra passes are not)
RECOMPUTE = {"realize_reads_threshold": 100, "realize_opcount_threshold": 1000,
             "realize_acc_reads_threshold": 100}

log = logging.getLogger(__name__)
_compile_failed: set[str] = set()


def check_kernels(mode: str) -> str:
    if mode not in KERNEL_MODES:
        raise ValueError(f"kernels must be one of {KERNEL_MODES}, got '{mode}'")
    return mode


def compiler_available(device_type: str) -> bool:
    """Whether torch.compile can build fused kernels here (a C++ compiler for CPU, Triton for CUDA)."""
    return device_type not in _compile_failed and _has_compiler(device_type)


@functools.cache
def _has_compiler(device_type: str) -> bool:
    if device_type == "cpu":
        from torch._inductor import config

        return shutil.which(config.cpp.cxx[-1] or "g++") is not None
    if device_type == "cuda":
        from torch.utils._triton import has_triton

        return has_triton()
    return False


def resolve_kernels(mode: str, x: torch.Tensor, kind: Any = None, has_native: bool = False) -> str:
    """The path for input ``x``: ``autograd`` inside an outer ``torch.compile``; ``auto`` is ``autograd`` for
    small inputs, else ``native`` where the layer has native loops (``has_native``) that take ``x`` (CPU,
    float32/float64), else ``compiled`` once layers of ``kind`` ran ``COMPILE_AFTER_CALLS`` times on the
    shape; ``native`` where its loops do not take ``x`` is ``compiled``."""
    if torch.compiler.is_compiling():
        return "autograd"
    if mode == "native" and not (has_native and native.supports(x)):
        return "compiled"
    if mode == "auto":
        if x.numel() < COMPILE_MIN_NUMEL:
            return "autograd"
        if has_native and native.supports(x):
            return "native"  # built once per machine: no per-shape compile to win back
        if not compiler_available(x.device.type):
            return "autograd"
        key = (kind, tuple(x.shape), x.dtype, x.device.type, torch.is_grad_enabled())
        _calls[key] += 1
        return "compiled" if _calls[key] > COMPILE_AFTER_CALLS else "autograd"
    return mode


class Kernels:
    """Named kernel functions and their ``torch.compile``-d versions; a build failure is reported once and
    that device runs them op by op."""

    def __init__(self, options: dict[str, Any] | None = None, native: SimpleNamespace | None = None,
                 **functions: Callable[..., Any]) -> None:
        self.eager = SimpleNamespace(**functions)
        self.native = native  # the same functions as native loops (CPU, float32/float64)
        self.options = {**_COMPILE_OPTIONS, **(options or {})}  # inductor options
        self._compiled: SimpleNamespace | None = None

    def get(self, mode: str) -> SimpleNamespace:
        """The kernels for ``mode`` (``native``, ``compiled`` or ``eager``)."""
        if mode == "native" and self.native is not None:
            return self.native
        if mode != "compiled":
            return self.eager
        if self._compiled is None:
            # each specialisation (layout, squash, dtype, autocast, static then dynamic shapes) recompiles
            # the same function; past dynamo's limit (8 per function) the rest would silently run op by op
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
            compiled = {name: _with_fallback(torch.compile(fn, options=self.options), fn)
                        for name, fn in vars(self.eager).items()}
            self._compiled = SimpleNamespace(**compiled)
        return self._compiled


def _with_fallback(compiled: Callable[..., Any], eager: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any) -> Any:
        device = next((a.device.type for a in args if isinstance(a, torch.Tensor)), "cpu")
        if device not in _compile_failed:
            try:
                return compiled(*args)
            except Exception as e:  # a broken toolchain must not stop training: same math, op by op
                _compile_failed.add(device)
                log.warning("torch.compile of %s failed on %s (%s: %s); running its kernels op by op",
                            eager.__name__, device, type(e).__name__, e)
        return eager(*args)

    return run
