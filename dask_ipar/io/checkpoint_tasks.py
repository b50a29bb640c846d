"""The tasks a checkpoint runs on the workers (region writes, block reads checked against
their digests) and how storage errors are described and raised as
:class:`~dask_ipar.io.checkpoint_format.CheckpointStorageError`.

Part of :mod:`dask_ipar.io.checkpoint`; the tasks are submitted by
:mod:`.checkpoint_save` and :mod:`.checkpoint_load`.
"""

from __future__ import annotations

import contextlib
import errno
import os
import time

import numpy as np

from dask_ipar.io import checkpoint_format as fmt
from dask_ipar.io.checkpoint_dirs import _fsync_file
from dask_ipar.io.checkpoint_format import CheckpointStorageError

__all__: list[str] = []


# A worker task never raises on bad storage or damaged data: it returns what went wrong
# (``_Failure`` or an ``{"error": ...}`` result), so dask logs no "Compute Failed" dump and
# the client raises one clear error.
class _Failure:
    """What a read task returns instead of a block when the block cannot be trusted."""

    def __init__(self, message: str):
        self.message = message


def _take(block, r0, r1, c0, c1):
    """A host copy of ``block[r0:r1, c0:c1]``, made on the block's owner.

    A save sends a neighbour only this slice, under a key of its own that the save
    releases: never the block itself, whose key the next steps keep (momentum is
    updated in place), so no copy of it outlives the save.
    """
    from dask_ipar.kernels.blocks import to_host

    return np.array(to_host(block[r0:r1, c0:c1]), copy=True)


def _moment(state, k):
    """Adam's moment ``k`` (0: first, 1: second) of a ``(2, rows, cols)`` state block, as
    a 2-D host copy made on the owner (released after the save, like :func:`_take`'s)."""
    from dask_ipar.kernels.blocks import to_host

    return np.array(to_host(state[k]), copy=True)


def _stack_moments(m, s, module=None):
    """The ``(2, rows, cols)`` Adam state block of a cell from its two moments."""
    from dask_ipar.kernels.blocks import to_device

    out = np.stack([np.asarray(m), np.asarray(s)])
    return out if module is None else to_device(out, module)


def _write_region(path, r0, r1, c0, c1, bounds, *blocks):
    """Write rows ``r0:r1`` x columns ``c0:c1`` of the array at ``path`` and fsync its chunks.

    Runs on the worker that owns the region's first block. ``bounds[k]`` gives the
    ``(br0, br1, bc0, bc1)`` of ``blocks[k]`` (each block overlaps the region).
    Returns ``{"nbytes", "sha256": {chunk id: digest}}``, or ``{"error", "errno"}`` when
    the storage refused the write.
    """
    from dask_ipar.kernels.blocks import to_host

    try:
        import zarr

        arr = zarr.open_array(path, mode="r+")
        region = np.empty((r1 - r0, c1 - c0), dtype=arr.dtype)
        filled = 0
        for (br0, br1, bc0, bc1), blk in zip(bounds, blocks):
            lo, hi = max(r0, br0), min(r1, br1)
            le, ri = max(c0, bc0), min(c1, bc1)
            region[lo - r0:hi - r0, le - c0:ri - c0] = to_host(blk)[lo - br0:hi - br0,
                                                                    le - bc0:ri - bc0]
            filled += (hi - lo) * (ri - le)
        if filled != region.size:  # pragma: no cover - a bug in the block bookkeeping
            raise RuntimeError(f"checkpoint region {r0}:{r1}x{c0}:{c1} of {path} not covered")
        arr[r0:r1, c0:c1] = region
        hook = os.environ.get("DASK_IPAR_CHECKPOINT_WRITE_HOOK")
        if hook:  # test hook: a file to touch, then a delay, to crash mid-write on purpose
            open(hook, "a").close()
            time.sleep(float(os.environ.get("DASK_IPAR_CHECKPOINT_WRITE_DELAY_S", "60")))
        ch, cw = arr.chunks
        digests = {}
        for ci in range(r0 // ch, -(-r1 // ch)):
            for cj in range(c0 // cw, -(-c1 // cw)):
                digests[fmt.chunk_id(ci, cj)] = fmt.chunk_digest(
                    region[ci * ch - r0:min((ci + 1) * ch, r1) - r0,
                           cj * cw - c0:min((cj + 1) * cw, c1) - c0])
                f = os.path.join(path, "c", str(ci), str(cj))
                if os.path.exists(f):
                    _fsync_file(f)
    except Exception as exc:
        return {"error": _describe(exc), "errno": getattr(exc, "errno", None)}
    return {"nbytes": region.nbytes, "sha256": digests}


def _describe(exc: BaseException) -> str:
    """``[Errno 28] No space left on device`` for OS errors, ``Type: message`` otherwise."""
    if isinstance(exc, OSError) and exc.errno is not None:
        return f"[Errno {exc.errno}] {exc.strerror or os.strerror(exc.errno)}"
    if "computed checksum do not match" in str(exc):  # zarr's Crc32cCodec
        return "a chunk file fails its CRC32C checksum"
    return f"{type(exc).__name__}: {exc}"


def _read_block(path, name, r0, r1, c0, c1, dtype, digests=None, module=None):
    """Block ``[r0:r1, c0:c1]`` of the float array at ``path``, every chunk it touches
    checked against ``digests`` (``{chunk id: sha256}``; None: version-1 checkpoint).

    Reads one whole chunk at a time (what zarr decodes anyway), so each can be checked
    and the memory in use stays the block plus one chunk. Returns the block (as
    ``module``'s array when given, e.g. CuPy), or a ``_Failure``. ``name`` is how
    messages call the array (``ckpt-300/dense1/v``).
    """
    try:
        import zarr

        arr = zarr.open_array(path, mode="r")
        if arr.dtype != np.dtype(dtype):
            return _Failure(f"array {name} has dtype {arr.dtype}, the metadata says {dtype}")
        ch, cw = arr.chunks
        n, m = arr.shape
        out = np.empty((r1 - r0, c1 - c0), dtype=arr.dtype)
        for ci in range(r0 // ch, -(-r1 // ch)):
            a0, a1 = ci * ch, min((ci + 1) * ch, n)
            for cj in range(c0 // cw, -(-c1 // cw)):
                b0, b1 = cj * cw, min((cj + 1) * cw, m)
                if digests is None:  # nothing to check: read only the overlap
                    a0, a1, b0, b1 = max(a0, r0), min(a1, r1), max(b0, c0), min(b1, c1)
                part = arr[a0:a1, b0:b1]
                if digests is not None and (fmt.chunk_digest(part)
                                            != digests.get(fmt.chunk_id(ci, cj))):
                    return _Failure(f"chunk {ci}.{cj} of array {name} does not match its "
                                    "checksum")
                lo, hi, le, ri = max(a0, r0), min(a1, r1), max(b0, c0), min(b1, c1)
                out[lo - r0:hi - r0, le - c0:ri - c0] = part[lo - a0:hi - a0, le - b0:ri - b0]
    except Exception as exc:
        return _Failure(f"array {name} could not be read ({_describe(exc)})")
    if not np.isfinite(out).all():
        return _Failure(f"array {name} has missing or non-finite values in rows {r0}:{r1}, "
                        f"columns {c0}:{c1} (a chunk file is missing or damaged)")
    if module is not None:
        from dask_ipar.kernels.blocks import to_device

        try:
            return to_device(out, module)
        except Exception as exc:
            return _Failure(f"array {name} could not be copied to the device ({_describe(exc)})")
    return out


def _read_status(block):
    """None when a read task produced its block, else its message (a small result)."""
    return block.message if isinstance(block, _Failure) else None


@contextlib.contextmanager
def _storage_errors(directory: str, what: str):
    """Turn OS errors of the training process's own checkpoint I/O into
    :class:`CheckpointStorageError` naming the directory."""
    try:
        yield
    except OSError as exc:
        raise _storage_error(directory, what, _describe(exc), exc.errno) from None


def _storage_error(directory, what, why, errno_=None) -> CheckpointStorageError:
    if errno_ in (errno.ENOSPC, errno.EDQUOT):
        fix = "free space there or choose another checkpoint directory"
    elif errno_ in (errno.EROFS, errno.EACCES, errno.EPERM):
        fix = "choose a checkpoint directory that this process and every worker can write"
    else:
        fix = "check the file system, or choose another checkpoint directory"
    return CheckpointStorageError(
        f"cannot write {what} in {directory!r}: {why}. The checkpoints saved before are "
        f"intact; {fix}."
    )

