"""The CPU path of the point-wise family and RMSNorm (``norm.kernels=native``): the one-pass loops of
``native.cpp``, called through ctypes with the signatures of :mod:`.pointwise`'s and :mod:`.rms`'s kernels.
Built on first use (or by ``make install``) with torch.compile's C++ compiler and OpenMP into a cache keyed by
source, flags, compiler and CPU; where it cannot be built, the layers take the compiled path (logged once)."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

Tensor = torch.Tensor
log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("native.cpp")
# -D__FAST_MATH__ lets glibc declare its vector math (libmvec) without -ffast-math, whose finite-math
# assumption would drop the NaNs the kinks must give (pointwise.py's docstring)
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-D__FAST_MATH__", "-fopenmp",
         "-std=c++17", "-shared", "-fPIC")
DTYPES = {torch.float32: 0, torch.float64: 1}

_P, _I, _D = ctypes.c_void_p, ctypes.c_int, ctypes.c_double
_SIGNATURES = {
    "normexp_pointwise_forward": [_I, _I, _P, _P, _P, _D, _P, _P, _P, _P, _I],
    "normexp_pointwise_backward": [_I, _I, _P, _P, _P, _P, _P, _D, _P, ctypes.c_int64, _P, _P, _I],
    "normexp_rms_forward": [_I, _P, _P, _P, _P, _P, _D, _I],
    "normexp_rms_backward": [_I, _P, _P, _P, _P, _P, _P, _P, _D, _I],
}


def _compiler() -> str | None:
    from torch._inductor import config

    return shutil.which(config.cpp.cxx[-1] or "g++")


def _cpu_identity() -> str:
    """The CPU model and feature flags (what -march=native compiles for)."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        lines = cpuinfo.read_text().splitlines()
        return "\n".join(next((x for x in lines if x.startswith(k)), "") for k in ("model name", "flags"))
    return f"{platform.machine()} {platform.processor()}"


def cache_dir() -> Path:
    return Path(os.environ.get("NORMEXP_KERNEL_CACHE") or Path.home() / ".cache" / "normexp" / "kernels")


def library_path(compiler: str) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), *FLAGS, version, _cpu_identity()]).encode())
    return cache_dir() / f"normexp_native_{key.hexdigest()[:16]}.so"


def build(compiler: str) -> Path:
    """The library, compiled unless cached (renamed into place: concurrent processes never load a partial
    file)."""
    path = library_path(compiler)
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    log.info("building the native CPU kernels into %s (once per machine and source, about 20 s)", path)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    try:
        result = subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", tmp], capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {result.stderr.strip()[-500:]}")
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return path


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded library, or None where it cannot be built here (logged once)."""
    compiler = _compiler() if sys.platform.startswith("linux") else None
    if compiler is None:
        log.info("native CPU kernels need g++ with OpenMP on Linux; using the compiled path")
        return None
    try:
        lib = ctypes.CDLL(str(build(compiler)))
    except (OSError, RuntimeError) as e:
        log.warning("native CPU kernels unavailable (%s); using the compiled path", e)
        return None
    for name, argtypes in _SIGNATURES.items():
        getattr(lib, name).argtypes = argtypes
        getattr(lib, name).restype = None
    lib.normexp_function_name.restype = ctypes.c_char_p
    return lib


def available() -> bool:
    return library() is not None


def supports(x: Tensor) -> bool:
    """Whether the native loops take this input: a CPU float32/float64 tensor, where the library builds."""
    return x.device.type == "cpu" and x.dtype in DTYPES and available()


@functools.cache
def function_ids() -> dict[str, int]:
    lib = library()
    return {lib.normexp_function_name(i).decode(): i for i in range(lib.normexp_function_count())}


def _channel_dim(x: Tensor, channels_first: bool) -> int:
    return 1 if channels_first and x.dim() > 2 else x.dim() - 1


def _shape(x: Tensor, channels_first: bool) -> ctypes.Array:
    """(outer, C, inner): x's layout as the loops see it (channels last: inner 1)."""
    dim = _channel_dim(x, channels_first)
    outer, inner = math.prod(x.shape[:dim]), math.prod(x.shape[dim + 1:])
    return (ctypes.c_int64 * 3)(outer, x.shape[dim], inner)


@functools.cache
def _options(options: Any) -> ctypes.Array:
    """pointwise.py's ``PointOptions`` as the loops read them (native.cpp's ``Options``), the last entry
    whether any is set."""
    o = options
    return (ctypes.c_double * 7)(o.prescale, o.flat, math.nan if o.clip is None else o.clip, float(o.negate),
                                 o.blend, o.output_shift, float(bool(o.changed())))


def _per_channel(v: Tensor | None, x: Tensor, channels: int) -> Tensor:
    """A contiguous per-channel vector of x's dtype: a scalar broadcast, None zeros."""
    if v is None:
        return x.new_zeros(channels)
    if v.dtype != x.dtype or v.numel() != channels or not v.is_contiguous():
        v = v.detach().to(x.dtype).expand(channels).contiguous()
    return v


def _pointwise_forward(x: Tensor, alpha: Tensor, shift: Tensor | None, weight: Tensor, bias: Tensor, fn: str,
                       channels_first: bool, options: Any) -> Tensor:
    x = x.contiguous()
    shape = _shape(x, channels_first)
    shift, weight, bias = (_per_channel(v, x, shape[1]) for v in (shift, weight, bias))
    y = torch.empty_like(x)
    library().normexp_pointwise_forward(DTYPES[x.dtype], function_ids()[fn], x.data_ptr(), y.data_ptr(),
                                        shape, float(alpha), shift.data_ptr(), weight.data_ptr(),
                                        bias.data_ptr(), _options(options), torch.get_num_threads())
    return y


def _pointwise_backward(gy: Tensor, x: Tensor, alpha: Tensor, shift: Tensor | None, weight: Tensor, fn: str,
                        channels_first: bool, options: Any, alpha_grad: bool,
                        shift_grad: bool) -> tuple[Tensor | None, ...]:
    """(dL/dx, dL/dalpha, dL/dshift, dL/dgamma, dL/dbeta), as pointwise.py's ``_backward``."""
    x, gy = x.contiguous(), gy.to(x.dtype).contiguous()
    shape = _shape(x, channels_first)
    channels, shift_size = shape[1], 1 if shift is None else shift.numel()
    gx, grads = torch.empty_like(x), x.new_empty(1 + shift_size + 2 * channels)
    # held in names until the call returns: a temporary's memory is freed as soon as data_ptr() is read
    shift_vector, weight_vector = _per_channel(shift, x, channels), _per_channel(weight, x, channels)
    library().normexp_pointwise_backward(DTYPES[x.dtype], function_ids()[fn], gy.data_ptr(), x.data_ptr(),
                                         gx.data_ptr(), grads.data_ptr(), shape, float(alpha),
                                         shift_vector.data_ptr(), shift_size, weight_vector.data_ptr(),
                                         _options(options), torch.get_num_threads())
    g_alpha, g_shift, g_weight, g_bias = grads.split([1, shift_size, channels, channels])
    return (gx, g_alpha if alpha_grad else None, g_shift if shift_grad else None, g_weight.to(weight.dtype),
            g_bias.to(weight.dtype))


def _rms_forward(x: Tensor, weight: Tensor | None, eps: float, channels_first: bool) -> tuple[Tensor, Tensor]:
    x = x.contiguous()
    shape = _shape(x, channels_first)
    w = _per_channel(weight, x, shape[1]) if weight is not None else x.new_ones(shape[1])
    y = torch.empty_like(x)
    dim = _channel_dim(x, channels_first)
    sum_square = x.new_empty(x.shape[:dim] + (1,) + x.shape[dim + 1:])  # the channel dim kept, as rms.py's
    library().normexp_rms_forward(DTYPES[x.dtype], x.data_ptr(), y.data_ptr(), sum_square.data_ptr(), shape,
                                  w.data_ptr(), eps, torch.get_num_threads())
    return y, sum_square


def _rms_backward(gy: Tensor, x: Tensor, sum_square: Tensor, weight: Tensor | None, eps: float,
                  channels_first: bool) -> tuple[Tensor, Tensor | None]:
    x, gy, sum_square = x.contiguous(), gy.to(x.dtype).contiguous(), sum_square.contiguous()
    shape = _shape(x, channels_first)
    w = _per_channel(weight, x, shape[1]) if weight is not None else x.new_ones(shape[1])
    gx, weight_grad = torch.empty_like(x), torch.empty(shape[1], dtype=torch.float64)
    library().normexp_rms_backward(DTYPES[x.dtype], gy.data_ptr(), x.data_ptr(), sum_square.data_ptr(),
                                   gx.data_ptr(), weight_grad.data_ptr(), shape, w.data_ptr(), eps,
                                   torch.get_num_threads())
    return gx, None if weight is None else weight_grad.to(weight.dtype)


POINTWISE = SimpleNamespace(forward=_pointwise_forward, backward=_pointwise_backward)
RMS = SimpleNamespace(forward=_rms_forward, backward=_rms_backward)


if __name__ == "__main__":  # make install: build ahead, say where
    logging.basicConfig(level=logging.INFO)
    print(f"native CPU kernels: {build(_compiler()) if available() else 'unavailable (see the log above)'}")
