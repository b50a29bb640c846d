"""The matrix products of the kernels, and whose BLAS runs them on NumPy blocks.

Every product of the dense, convolution and row-parallel kernels goes through
:func:`matmul` (or :func:`matmul_add`, a product added into an array). On CuPy and other
array API blocks it is the array library's own. On NumPy blocks it is NumPy's BLAS (the
OpenBLAS its wheels bundle), or PyTorch's CPU BLAS (Intel MKL in the x86 wheels) on the same
memory through ``torch.from_numpy``: no copy, the result a NumPy array NumPy allocated.
Which one is the ``ipar.matmul`` setting:

* ``auto`` (the default): PyTorch's on Intel CPUs where PyTorch is installed in the
  worker, else NumPy's;
* ``numpy``: always NumPy's;
* ``torch``: PyTorch's (:func:`check_setting` refuses it before a run where PyTorch is not
  installed).

Why: on this project's 2-core Intel test machine PyTorch's sgemm ran the engine's block
shapes 2-15% faster than NumPy's OpenBLAS on one and on two threads, and a 1x1 step of the
4096-wide MLP 10% faster (``docs/benchmarks.md``, "Session 40"). On a 2-core AMD EPYC
(Zen 4) one it was the other way round: MKL's sgemm 1-32% slower than OpenBLAS's on one
thread, the same 1x1 step 1.17x the NumPy reference with it and 1.00x with NumPy's
("Session 46"), so ``auto`` asks the CPU's vendor (:func:`cpu_vendor`). PyTorch is
imported on the first product of at least :data:`MIN_FLOPS`
(about 1.3 s and 200 MB of shared libraries per worker), so small models never load it.
Products below that size stay on NumPy, whose per-call cost is lower. Both BLAS libraries
round float32 products differently, within float32 precision; within one run every worker
of one kind of CPU uses the same one, so the executors and grids still agree with each
other as closely as before.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import threading
import warnings

import numpy as np

from dask_ipar.errors import IparError
from dask_ipar.kernels.blocks import ufuncs_of

__all__ = ["MATMUL_CHOICES", "MIN_FLOPS", "matmul", "matmul_add", "backend", "check_setting",
           "cpu_vendor"]

#: Accepted values of ``ipar.matmul``.
MATMUL_CHOICES = ("auto", "numpy", "torch")

#: Products of fewer floating-point operations (2 m n k per matrix) stay on NumPy: below
#: about 2**22 (a 128-cubed product, some 20-40 us) PyTorch's per-call overhead of a few
#: microseconds is no longer small beside the product.
MIN_FLOPS = 1 << 22

_WHERE = "in dask-ipar.yaml, or DASK_IPAR__MATMUL"
_TORCH_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
_torch_module = None  # PyTorch once imported for the kernels; False where it is missing
_torch_error = None  # why PyTorch failed to import, where it did
_import_lock = threading.Lock()


def _setting() -> str:
    import dask.config

    value = dask.config.get("ipar.matmul", "auto")
    return "auto" if value is None else str(value)


def check_setting(value=None) -> str:
    """``ipar.matmul`` (or ``value``) checked: one of :data:`MATMUL_CHOICES`, and
    ``torch`` only where PyTorch is installed; an :class:`IparError` saying what to set
    otherwise."""
    value = _setting() if value is None else str(value)
    if value not in MATMUL_CHOICES:
        raise IparError(f"matmul: {value!r} is not one of {', '.join(MATMUL_CHOICES)}. "
                        f"Set matmul ({_WHERE}) to auto (PyTorch's BLAS on Intel CPUs "
                        "where installed), numpy or torch.")
    if value == "torch" and importlib.util.find_spec("torch") is None:
        raise IparError("matmul: torch needs PyTorch, which is not installed here. Install "
                        f"it (pip install torch) or set matmul ({_WHERE}) to auto or numpy.")
    return value


def _torch():
    """PyTorch, imported once (other threads wait for the import); None where it is not
    installed or fails to import (the error kept in ``_torch_error``)."""
    global _torch_module, _torch_error
    if _torch_module is not None:
        return _torch_module or None
    with _import_lock:
        if _torch_module is not None:
            return _torch_module or None
        got = False  # set once imported (or failed): threads outside the lock see None until
        if importlib.util.find_spec("torch") is not None:
            try:
                import torch
            except Exception as exc:  # a broken install: auto falls back to NumPy's BLAS
                _torch_error = f"{type(exc).__name__}: {exc}"
            else:
                got = torch
                # blocks received over the network are read-only, which PyTorch's views of
                # them warn about once per process: the kernels never write into them
                warnings.filterwarnings("ignore", message=".*NumPy array is not writable",
                                        category=UserWarning)
        _torch_module = got
    return _torch_module or None


@functools.cache
def cpu_vendor() -> str:
    """The CPU's vendor as Linux names it (``GenuineIntel``, ``AuthenticAMD``, ...; the
    first ``vendor_id`` of ``/proc/cpuinfo``), or ``""`` where that is not readable."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return ""


def backend() -> str:
    """``"torch"`` or ``"numpy"``: whose BLAS this process runs large NumPy products with."""
    value = _setting()
    if value == "numpy":
        return "numpy"
    if value == "torch":
        check_setting(value)
        if _torch() is None:
            raise IparError(f"matmul: torch, but PyTorch fails to import here "
                            f"({_torch_error}). Repair the install, or set matmul "
                            f"({_WHERE}) to auto or numpy.")
        return "torch"
    # auto: MKL (PyTorch's x86 BLAS) on Intel only; elsewhere OpenBLAS was the faster
    return "torch" if cpu_vendor() == "GenuineIntel" and _torch() is not None else "numpy"


def _flops(a, b) -> int:
    m, k = a.shape[-2:]
    n = b.shape[-1]
    if a.ndim == 2 and b.ndim == 2:  # the dense kernels' products: no NumPy calls (20 us)
        return 2 * m * n * k
    batch = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    return 2 * m * n * k * math.prod(batch)


def _torch_matmul(torch, a, b, out):
    """``a @ b`` by PyTorch into ``out`` (a new NumPy array when None); None where PyTorch
    cannot view the operands (negative strides)."""
    try:
        ta, tb = torch.from_numpy(a), torch.from_numpy(b)
    except ValueError:
        return None
    if out is None:
        shape = np.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1])
        out = np.empty(shape, dtype=np.result_type(a, b))
    torch.matmul(ta, tb, out=torch.from_numpy(out))
    return out


def _on_torch(a, b, out) -> bool:
    """Whether PyTorch's BLAS takes ``a @ b`` (into ``out``, of their dtype and writeable):
    NumPy blocks of one float dtype, at least :data:`MIN_FLOPS`, and ``ipar.matmul`` picking
    PyTorch."""
    return (type(a) is np.ndarray and type(b) is np.ndarray and a.ndim >= 2 and b.ndim >= 2
            and a.dtype == b.dtype and a.dtype in _TORCH_DTYPES
            and (out is None or (out.dtype == a.dtype and out.flags.writeable))
            and _flops(a, b) >= MIN_FLOPS and backend() == "torch")


def matmul_add(c, a, b, tmp=None):
    """``c + a @ b``, written into ``c`` where it is the caller's own NumPy or CuPy matrix
    (other array libraries: a new array); returns ``(the sum, tmp)``, ``tmp`` a scratch array
    of ``c``'s shape to hand to the next call (or None). ``c`` must not overlap ``a`` or ``b``.

    On PyTorch's BLAS (:func:`matmul`'s rule; 2-D, ``c`` C-contiguous) the product adds
    into ``c`` itself (``addmm_``: no scratch, and the write and read-back of one, about 6%
    of a 512 x 512 x 1024 product's time on one thread). Its rounding then differs from the
    product's rounded sum added apart, as one BLAS's does from another's. Elsewhere the
    product goes into ``tmp`` (made when None), then is added."""
    if (a.ndim == 2 and b.ndim == 2 and type(c) is np.ndarray and c.dtype == a.dtype
            and c.flags.c_contiguous and _on_torch(a, b, c)
            and not np.may_share_memory(c, a) and not np.may_share_memory(c, b)):
        torch = _torch()
        try:
            ta, tb = torch.from_numpy(a), torch.from_numpy(b)
        except ValueError:  # negative strides: the product apart
            pass
        else:
            torch.from_numpy(c).addmm_(ta, tb)
            return c, tmp
    m = ufuncs_of(c)
    if m is None:
        return c + matmul(a, b), tmp
    tmp = m.empty_like(c) if tmp is None else tmp
    c += matmul(a, b, out=tmp)
    return c, tmp


def matmul(a, b, out=None):
    """``a @ b`` (into ``out`` where given, which NumPy and CuPy blocks take); on NumPy
    blocks of float32 or float64 and at least :data:`MIN_FLOPS`, by the BLAS
    ``ipar.matmul`` picks."""
    if _on_torch(a, b, out):
        r = _torch_matmul(_torch(), a, b, out)
        if r is not None:
            return r
    return a @ b if out is None else ufuncs_of(a).matmul(a, b, out=out)
