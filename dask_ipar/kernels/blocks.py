"""Block plumbing: the array namespace of a block, joins, slices, sums and device copies.

The local ends of the collectives (:mod:`dask_ipar.nn.collectives`): joining the blocks an
all-gather brings, cutting the pieces a reduce-scatter or halo exchange sends, adding the
pieces that come back. Module level (they pickle by reference) and array-API generic, like
every kernel: the same code runs on NumPy and CuPy blocks.
"""

from __future__ import annotations

import importlib
import sys

import numpy as np
from dask.sizeof import sizeof

from dask_ipar.errors import IparError

try:  # the compat layer gives CuPy and older NumPy the standard names
    from array_api_compat import array_namespace as _compat_namespace
except ImportError:  # pragma: no cover - depends on the environment
    _compat_namespace = None

__all__ = ["xp_of", "ufuncs_of", "concat_rows", "concat_cols", "concat_axis", "assemble_blocks", "slice_axis",
           "identity", "sum_pieces", "fetched", "first_of", "take_rows", "assemble", "rows_slice",
           "add_rows", "zeros_like", "DEVICE_MODULES", "to_device", "to_host", "check_device"]


@sizeof.register_lazy("array_api_strict")
def _register_array_api_strict():
    """Byte sizes of ``array_api_strict`` blocks (dask's default ``sizeof`` says 64), so
    transfer logs count them right when the tests run the engine on them."""
    from array_api_strict._array_object import Array

    @sizeof.register(Array)
    def _sizeof_strict(x):
        return int(np.from_dlpack(x).nbytes)



def xp_of(x):
    """The array namespace of ``x`` (NumPy, CuPy, or any array API library)."""
    if _compat_namespace is not None:
        return _compat_namespace(x)
    ns = getattr(x, "__array_namespace__", None)
    return ns() if ns is not None else np



def ufuncs_of(x):
    """NumPy or CuPy when ``x`` is one of their arrays (their ufuncs write into ``out=``),
    else None: other array API libraries get the out-of-place forms."""
    if isinstance(x, np.ndarray):
        return np
    if type(x).__module__.split(".")[0] == "cupy":
        return sys.modules["cupy"]
    return None


def concat_rows(*blocks):
    """Stack blocks along the feature axis (an all-gather's local result)."""
    if len(blocks) == 1:
        return blocks[0]
    return xp_of(blocks[0]).concat(list(blocks), axis=0)



def concat_cols(*blocks):
    """Join column slices of a weight block row (an all-gather's local result)."""
    if len(blocks) == 1:
        return blocks[0]
    return xp_of(blocks[0]).concat(list(blocks), axis=1)



def assemble_blocks(pr, pc, *blocks):
    """The whole matrix from its ``pr x pc`` blocks, given row by row (an all-gather)."""
    if len(blocks) == 1:
        return blocks[0]
    rows = [concat_cols(*blocks[i * pc:(i + 1) * pc]) for i in range(pr)]
    return concat_rows(*rows)



def identity(x):
    """The block itself (a task whose key names the phase that moves it)."""
    return x



def concat_axis(axis, *blocks):
    """Blocks joined along ``axis`` (an all-gather's local result)."""
    if len(blocks) == 1:
        return blocks[0]
    return xp_of(blocks[0]).concat(list(blocks), axis=axis)



def slice_axis(x, axis, a, b):
    """A copy of ``x[..., a:b, ...]`` along ``axis`` (of ``x[0]`` when ``x`` is a tuple)."""
    x = x[0] if isinstance(x, tuple) else x
    index = tuple(slice(a, b) if k == axis else slice(None) for k in range(x.ndim))
    return xp_of(x).asarray(x[index], copy=True)



def sum_pieces(own, *remote):
    """``own`` (this task's fresh array) plus the pieces sent by the other cells."""
    for r in remote:
        own += r
    return own



def fetched(*blocks):
    """Nothing: a task whose only work is to bring its dependencies to its worker."""
    return None



def first_of(pair):
    """The first item of a task's tuple result (a layer's input gradient)."""
    return pair[0]



#: Array module of the blocks of each non-CPU device (imported on the workers).
DEVICE_MODULES = {"cuda": "cupy"}



def to_device(x, module: str = "cupy"):
    """Copy a host (NumPy) block into device memory (``module``'s arrays: CuPy for
    ``"cuda"``), on the worker that owns it."""
    return importlib.import_module(module).asarray(x)



def to_host(x):
    """A NumPy copy of a block (CuPy blocks leave the GPU; NumPy blocks pass through;
    other array API arrays go through DLPack)."""
    if isinstance(x, np.ndarray):
        return x
    get = getattr(x, "get", None)  # CuPy: device to host
    if callable(get):
        return get()
    return np.from_dlpack(x) if hasattr(x, "__dlpack__") else np.asarray(x)


def take_rows(x, a, b):
    """Rows ``a:b`` (axis 2) of an NCHW block, as a new array."""
    return xp_of(x).asarray(x[:, :, a:b, :], copy=True)



def assemble(*pieces):
    """The input rows a cell reads: its own rows and the halo pieces, in row order."""
    xp = xp_of(pieces[0])
    return xp.concat(list(pieces), axis=2) if len(pieces) > 1 else pieces[0]



def rows_slice(grad, a, b):
    """Rows ``a:b`` of a cell's input-row gradient (the first item of a backward result)."""
    g = grad[0] if isinstance(grad, tuple) else grad
    return xp_of(g).asarray(g[:, :, a:b, :], copy=True)



def add_rows(own, *offsets_and_pieces):
    """The owner's input-gradient rows plus ghost rows sent back by neighbours.

    ``offsets_and_pieces`` alternates ``offset, piece``: a piece's rows start at ``offset``
    of the owner's block.
    """
    for k in range(0, len(offsets_and_pieces), 2):
        off, piece = offsets_and_pieces[k], offsets_and_pieces[k + 1]
        own[:, :, off:off + piece.shape[2], :] += piece
    return own



def zeros_like(x):
    return xp_of(x).zeros_like(x)


def check_device(device: str, dtype):
    """The block dtype (float32 or float64) for a model on ``device``, or a clear error
    (an unknown device, CuPy missing for ``"cuda"``)."""
    dt = np.dtype(dtype)
    if dt not in (np.float32, np.float64):
        raise IparError(f"dtype must be float32 or float64, got {dtype!r}.")
    if device != "cpu" and device not in DEVICE_MODULES:
        names = " or ".join(repr(d) for d in ("cpu", *DEVICE_MODULES))
        raise IparError(f"device must be {names}, got {device!r}.")
    if device == "cuda":
        try:
            import cupy  # noqa: F401
        except ImportError as exc:
            raise IparError(
                "device='cuda' needs CuPy on the client and the workers: "
                "pip install 'dask-ipar[gpu]'."
            ) from exc
    return dt
