"""Checkpoints of the model and optimizer state in Zarr, written in parallel by the block owners.

Layout of a checkpoint directory ``<dir>/ckpt-<step>/`` (a Zarr v3 group)::

    zarr.json              group attributes: format, version, step, grid, dtype,
                           sizes, layers (name, n_in, n_out, bias, activation),
                           has_velocity, extra (user metadata, JSON), arrays (shape,
                           chunks, SHA-256 per chunk), checksum (of all the rest)
    dense0/w               float array n_out x (n_in + bias), the last column the bias
    dense0/v               its momentum (absent before the first step)
    dense1/w ...

(:mod:`dask_ipar.io.checkpoint_format` defines and validates the metadata.) Arrays are
chunked by the saving grid's blocks (the largest row block by the largest column block,
so chunks equal blocks when the sizes divide evenly). Every chunk is written by exactly
one worker: the owner of the block holding the chunk's first element; when blocks are
uneven, the few neighbouring rows or columns it needs are cut from the neighbour's block
on the neighbour and travel to it under a key of their own, released after the write.
Chunks are compressed (zstd) and carry a CRC32C checksum; the writer records a SHA-256
of each chunk's values, and every reader checks the chunks it decodes.

Writes are atomic. The blocks go into ``<dir>/ckpt-<step>.tmp-<uuid>/``; every file is
fsynced (chunk files by the worker that wrote them); the directory is renamed to
``ckpt-<step>``; then the ``LATEST`` pointer file is replaced (written beside, fsynced,
renamed). A crash at any moment leaves the previous checkpoints and ``LATEST`` intact;
:func:`latest` never returns a ``.tmp`` directory, and the next save removes such
leftovers. A file system that refuses a write raises :class:`CheckpointStorageError`
at once, naming the directory.

Loading works on any grid: each worker of the new grid reads its own block straight
from the arrays (:func:`load`), weights and momentum both, so a run saved on 2x2 goes
on, with the same results, on 4x1 or 1x1. Only numeric float arrays are read (no
pickle, object arrays are rejected). A checkpoint that does not verify (damaged or
missing chunks, edited metadata) raises :class:`CheckpointCorrupt`; with
``fallback=True`` the next older one is tried. Another model's checkpoint raises
:class:`~dask_ipar.errors.IparError`.

:func:`train_with_checkpoints` is a training loop that saves every N steps and, when a
worker dies (its blocks are lost), says so, re-binds the model to the live workers and
resumes from the last checkpoint: the final weights equal an uninterrupted run's.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import json
import math
import os
import re
import shutil
import time
import uuid

import numpy as np

from dask_ipar.io import checkpoint_format as fmt
from dask_ipar.io.checkpoint_format import FORMAT, VERSION, CheckpointCorrupt, CheckpointStorageError
from dask_ipar.runtime.workers import scheduler_workers, wait_for_workers
from dask_ipar.errors import IparError

__all__ = [
    "FORMAT",
    "VERSION",
    "CheckpointCorrupt",
    "CheckpointStorageError",
    "WorkerLost",
    "save",
    "load",
    "latest",
    "checkpoints",
    "read_metadata",
    "recover",
    "batch_indices",
    "train_with_checkpoints",
]

_NAME = re.compile(r"^ckpt-(\d+)$")
_LATEST = "LATEST"
#: what crashed or failed writes leave behind: unpublished checkpoints, replaced ones
#: moved aside, unfinished LATEST pointers
_LEFTOVER = re.compile(r"^(ckpt-\d+\.(tmp|old)-[0-9a-f]+|LATEST\.tmp-[0-9a-f]+)$")


class WorkerLost(RuntimeError):
    """A worker holding model blocks left the cluster; the blocks it held are gone.

    Attributes
    ----------
    workers : list of str
        Addresses of the grid workers that are gone.
    """

    def __init__(self, workers, what):
        self.workers = list(workers)
        super().__init__(
            f"worker(s) {', '.join(self.workers)} left the cluster during {what}; the model "
            "blocks they held are lost. Resume from the last checkpoint: "
            "checkpoint.recover(model, directory) (or dask-ipar train --resume)."
        )


def _zarr():
    try:
        import zarr
    except ImportError:
        raise IparError(
            "checkpoints need zarr, which is not installed. Install it with: "
            "pip install 'dask-ipar[checkpoint]'"
        ) from None
    return zarr


# ------------------------------------------------------------- fs helpers
def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - some filesystems refuse
        pass
    finally:
        os.close(fd)


def _fsync_tree(root: str) -> None:
    for here, dirs, files in os.walk(root, topdown=False):
        for f in files:
            _fsync_file(os.path.join(here, f))
        _fsync_dir(here)


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(os.path.abspath(path)))


# ---------------------------------------------------------- worker tasks
# A worker task never raises on bad storage or damaged data: it returns what went wrong
# (``_Failure`` or an ``{"error": ...}`` result), so dask logs no "Compute Failed" dump and
# the client raises one clear error.
class _Failure:
    """What a read task returns instead of a block when the block cannot be trusted."""

    def __init__(self, message: str):
        self.message = message


def _owned_range(b0: int, b1: int, chunk: int, n: int):
    """Rows ``[lo, hi)`` of the chunks whose first element lies in ``[b0, b1)``."""
    first = -(-b0 // chunk)
    stop = -(-b1 // chunk)
    if first >= stop:
        return None
    return first * chunk, min(stop * chunk, n)


def _take(block, r0, r1, c0, c1):
    """A host copy of ``block[r0:r1, c0:c1]``, made on the block's owner.

    A save sends a neighbour only this slice, under a key of its own that the save
    releases: never the block itself, whose key the next steps keep (momentum is
    updated in place), so no copy of it outlives the save.
    """
    from dask_ipar.kernels.dense import to_host

    return np.array(to_host(block[r0:r1, c0:c1]), copy=True)


def _write_region(path, r0, r1, c0, c1, bounds, *blocks):
    """Write rows ``r0:r1`` x columns ``c0:c1`` of the array at ``path`` and fsync its chunks.

    Runs on the worker that owns the region's first block. ``bounds[k]`` gives the
    ``(br0, br1, bc0, bc1)`` of ``blocks[k]`` (each block overlaps the region).
    Returns ``{"nbytes", "sha256": {chunk id: digest}}``, or ``{"error", "errno"}`` when
    the storage refused the write.
    """
    from dask_ipar.kernels.dense import to_host

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
        from dask_ipar.kernels.dense import to_device

        try:
            return to_device(out, module)
        except Exception as exc:
            return _Failure(f"array {name} could not be copied to the device ({_describe(exc)})")
    return out


def _read_status(block):
    """None when a read task produced its block, else its message (a small result)."""
    return block.message if isinstance(block, _Failure) else None


# --------------------------------------------------------- client helpers
def _alive(client) -> set:
    """Addresses of the workers connected now (asked from the scheduler directly)."""
    return set(scheduler_workers(client))


def _gone_soon(client, workers, grace_s=20.0):
    """Grid workers missing from the scheduler, allowing it ``grace_s`` to notice a death."""
    deadline = time.monotonic() + grace_s
    while True:
        gone = [w for w in workers if w not in _alive(client)]
        if gone or time.monotonic() > deadline:
            return gone
        time.sleep(0.1)


def _wait_alive(client, futures, workers, what, timeout_s=None, poll_s=0.5):
    """Wait for ``futures`` while checking that every grid worker is still there.

    Raises :class:`WorkerLost` when one left (its pinned tasks would wait forever),
    IparError on timeout, and re-raises a task's own error.
    """
    from distributed import wait

    futures = list(futures)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        try:
            wait(futures, timeout=poll_s)
            break
        except TimeoutError:
            pass
        except Exception:  # cancelled: lost dependencies, forgotten keys
            gone = _gone_soon(client, workers)
            if gone:
                raise WorkerLost(gone, what) from None
            raise
        gone = [w for w in workers if w not in _alive(client)]
        if gone:
            raise WorkerLost(gone, what)
        if deadline is not None and time.monotonic() > deadline:
            raise IparError(f"{what} did not finish within {timeout_s:.0f} s.")
    bad = [f for f in futures if f.status != "finished"]
    errored = [f for f in bad if f.status == "error"]
    if errored and not [w for w in workers if w not in _alive(client)]:
        errored[0].result()  # the task's own error (e.g. a damaged chunk), raised at once
    if bad:
        gone = _gone_soon(client, workers)
        if gone:
            raise WorkerLost(gone, what)
        bad[0].result()  # raises the task's error
        raise WorkerLost([], what)  # pragma: no cover - cancelled without a visible cause
    return futures


def _model_meta(model) -> dict:
    sizes = [None if s is None else int(s) for s in model.sizes]
    if getattr(model, "is_cnn", False):  # one weight matrix per conv and dense layer
        model._require()
        layers = [{"name": lay.name, "n_in": int(lay.n_in), "n_out": int(lay.n_out),
                   "bias": bool(lay.bias), "activation": lay.activation}
                  for lay in model.engine.param_layouts]
        return {"sizes": sizes, "dtype": str(model.dtype), "layers": layers,
                "input_shape": list(model.input_shape)}
    return {
        "sizes": sizes,
        "dtype": str(model.dtype),
        "layers": [
            {"name": f"dense{k}", "n_in": sizes[k], "n_out": int(lay.units),
             "bias": bool(lay.bias), "activation": lay.activation}
            for k, lay in enumerate(model.layers)
        ],
    }


def checkpoints(directory) -> list[tuple[int, str]]:
    """Complete checkpoints in ``directory`` as ``[(step, path), ...]``, oldest first.

    ``.tmp-*`` directories (unfinished or crashed writes) are never listed. Complete
    means renamed into place; whether a checkpoint verifies is for :func:`load`.
    """
    return [(s, p) for s, p in _ckpt_dirs(os.fspath(directory))
            if os.path.isfile(os.path.join(p, "zarr.json"))]


def _ckpt_dirs(directory: str) -> list[tuple[int, str]]:
    """Every ``ckpt-<step>`` directory, complete or not, oldest first."""
    if not os.path.isdir(directory):
        return []
    out = []
    for name in os.listdir(directory):
        m = _NAME.match(name)
        if m and os.path.isdir(os.path.join(directory, name)):
            out.append((int(m.group(1)), os.path.join(directory, name)))
    return sorted(out)


def latest(directory) -> str | None:
    """Path of the newest complete checkpoint in ``directory`` (the highest step), or None
    when there is none; never a ``.tmp`` directory.

    The ``LATEST`` file names the same checkpoint for other tools; it is not needed to
    find it (a ``LATEST`` that is missing, stale or garbage changes nothing).
    """
    found = checkpoints(os.fspath(directory))
    return found[-1][1] if found else None


def read_metadata(path) -> dict:
    """The metadata of the checkpoint at ``path``, validated.

    Raises :class:`CheckpointCorrupt` when it is unreadable, incomplete, fails its
    checksum or contradicts itself (e.g. a step other than its directory's), IparError
    for another format or version.
    """
    zarr = _zarr()
    path = os.fspath(path)
    if not os.path.isfile(os.path.join(path, "zarr.json")):
        raise IparError(
            f"{path!r} is not a dask-ipar checkpoint (no zarr.json). Pass a ckpt-<step> "
            "directory or the checkpoint directory that holds them."
        )
    try:
        attrs = dict(zarr.open_group(path, mode="r").attrs)
    except Exception as exc:
        raise CheckpointCorrupt(
            f"the metadata of checkpoint {path!r} could not be read ({_describe(exc)}); the "
            "checkpoint is corrupted. Load an older one."
        ) from None
    m = _NAME.match(os.path.basename(os.path.normpath(path)))
    return fmt.validate_metadata(attrs, repr(path), int(m.group(1)) if m else None)


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


def _remove_stale(directory: str, before: float, keep_path: str) -> None:
    """Remove leftovers of crashed or failed writes older than ``before`` (a time)."""
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if path == keep_path or not _LEFTOVER.match(name):
            continue
        try:
            if os.lstat(path).st_mtime >= before:
                continue  # possibly a write in progress
        except OSError:
            continue
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.remove(path)


# ------------------------------------------------------------------ save
def save(model, directory, *, step: int | None = None, keep: int | None = None,
         extra: dict | None = None, timeout_s: float | None = None) -> str:
    """Write the model's weights and momentum to ``<directory>/ckpt-<step>``, atomically.

    Parameters
    ----------
    model : Sequential
        A distributed model (``model.distribute(client, grid)`` done).
    directory : str or path-like
        Created if needed; also holds the ``LATEST`` pointer.
    step : int, optional
        Training steps done (recorded, and part of the name). Default: one more than the
        newest checkpoint in ``directory`` (0 for the first).
    keep : int, optional
        Keep only the newest ``keep`` checkpoints (older ones are deleted afterwards).
    extra : dict, optional
        JSON-serialisable metadata stored with the checkpoint (e.g. optimizer settings).
    timeout_s : float, optional
        Give up (IparError) when the block writes take longer.

    Returns
    -------
    str
        Path of the new checkpoint.

    Raises
    ------
    CheckpointStorageError
        The directory cannot be written (disk full, read-only, no permission); nothing
        is published and the earlier checkpoints are untouched.
    WorkerLost
        A grid worker died during the write (the checkpoint is not published).
    """
    zarr = _zarr()
    from zarr.codecs import Crc32cCodec, ZstdCodec

    if step is not None and (not isinstance(step, (int, np.integer)) or isinstance(step, bool)
                             or step < 0):
        raise IparError(f"checkpoint step must be an integer >= 0, got {step!r}.")
    if keep is not None and (not isinstance(keep, int) or isinstance(keep, bool) or keep < 1):
        raise IparError(f"keep must be a positive integer or None, got {keep!r}.")
    sb = model.state_blocks()  # refuses closed models and lost state
    directory = os.fspath(directory)
    t_start = time.time()
    with _storage_errors(directory, "a checkpoint"):
        os.makedirs(directory, exist_ok=True)
    if step is None:
        found = checkpoints(directory)
        step = found[-1][0] + 1 if found else 0
    step = int(step)
    client = model.client
    workers = sorted({w for lay in sb["layers"] for w in lay["workers"].values()})
    # the momentum blocks are rewritten in place by the update that makes the weights:
    # they are this step's once the weights are done
    _wait_alive(client, [f for lay in sb["layers"] for f in lay["w"].values()], workers,
                f"the steps before checkpoint {step}", timeout_s)
    pr, pc = sb["grid"]
    has_v = all(lay["v"] is not None for lay in sb["layers"])
    meta = {
        "format": fmt.FORMAT, "version": fmt.VERSION, "step": step, "grid": [pr, pc],
        "has_velocity": has_v, **_model_meta(model),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "extra": extra or {},
    }
    try:
        json.dumps(meta, allow_nan=False)
        fmt.meta_digest(meta)  # the canonical form (sorted keys) must exist too
    except (TypeError, ValueError) as exc:
        raise IparError(f"checkpoint extra metadata must be JSON-serialisable with string "
                        f"keys: {exc}") from None

    final = os.path.join(directory, f"ckpt-{step}")
    tmp = f"{final}.tmp-{uuid.uuid4().hex[:12]}"
    what = f"checkpoint ckpt-{step}"
    writes, slices = [], []
    try:
        with _storage_errors(directory, what):
            group = zarr.create_group(tmp, zarr_format=3, attributes=meta, overwrite=False)
        arrays = {}
        for lay in sb["layers"]:
            n_rows, n_cols = lay["n_out"], lay["n_in"] + int(lay["bias"])
            rows, cols = lay["rows"], lay["wcols"]
            ch = max(b - a for a, b in rows)
            cw = max(b - a for a, b in cols)
            with _storage_errors(directory, what):
                g = group.require_group(lay["name"])
            for kind in ("w", "v") if has_v else ("w",):
                with _storage_errors(directory, what):
                    g.create_array(kind, shape=(n_rows, n_cols), chunks=(ch, cw),
                                   dtype=sb["dtype"], fill_value=np.nan,
                                   compressors=[ZstdCodec(level=1), Crc32cCodec()])
                name = f"{lay['name']}/{kind}"
                arrays[name] = {"shape": [n_rows, n_cols], "chunks": [ch, cw], "sha256": {}}
                path = os.path.join(tmp, lay["name"], kind)
                for i, (r0, r1) in enumerate(rows):
                    rr = _owned_range(r0, r1, ch, n_rows)
                    for j, (c0, c1) in enumerate(cols):
                        cc = _owned_range(c0, c1, cw, n_cols)
                        if rr is None or cc is None:
                            continue
                        owner = lay["workers"][(i, j)]
                        bounds, blocks = [], []
                        for ii, (a0, a1) in enumerate(rows):
                            for jj, (b0, b1) in enumerate(cols):
                                lo, hi = max(a0, rr[0]), min(a1, rr[1])
                                le, ri = max(b0, cc[0]), min(b1, cc[1])
                                if lo >= hi or le >= ri:
                                    continue
                                if (ii, jj) == (i, j):
                                    bounds.append((a0, a1, b0, b1))
                                    blocks.append(lay[kind][(ii, jj)])
                                    continue
                                # a neighbour's rows: a sliced copy under a key of its own
                                part = client.submit(
                                    _take, lay[kind][(ii, jj)], lo - a0, hi - a0, le - b0,
                                    ri - b0, workers=[lay["workers"][(ii, jj)]],
                                    allow_other_workers=False, pure=False,
                                    key=f"ckpt-slice-{uuid.uuid4().hex}")
                                slices.append(part)
                                bounds.append((lo, hi, le, ri))
                                blocks.append(part)
                        writes.append((name, client.submit(
                            _write_region, path, *rr, *cc, bounds, *blocks,
                            workers=[owner], allow_other_workers=False,
                            pure=False, key=f"ckpt-write-{uuid.uuid4().hex}",
                        )))
        _wait_alive(client, [f for _, f in writes], workers, f"checkpoint write {final}",
                    timeout_s)
        results = client.gather([f for _, f in writes])
        del slices[:]  # the neighbours' slices are forgotten, with every copy of them
        for (name, _), res in zip(writes, results):
            if "error" in res:
                raise _storage_error(directory, what, res["error"], res["errno"])
            arrays[name]["sha256"].update(res["sha256"])
        meta["arrays"] = arrays
        meta["checksum"] = fmt.meta_digest(meta)
        with _storage_errors(directory, what):
            group.attrs.update({"arrays": arrays, "checksum": meta["checksum"]})
            _fsync_tree(tmp)
            _publish(tmp, final, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        del writes, slices
    _remove_stale(directory, t_start, final)
    if keep is not None:
        for _, old in checkpoints(directory)[:-keep]:
            if old != final:
                shutil.rmtree(old, ignore_errors=True)
    return final


def _publish(tmp: str, final: str, directory: str) -> None:
    """Rename the finished ``tmp`` to ``final``, then point ``LATEST`` at it."""
    aside = None
    if os.path.exists(final):  # re-saving the same step: move the old one aside first
        aside = f"{final}.old-{uuid.uuid4().hex[:8]}"
        os.rename(final, aside)
    os.rename(tmp, final)
    _fsync_dir(directory)
    try:
        _write_atomic(os.path.join(directory, _LATEST), os.path.basename(final) + "\n")
    except OSError:  # not published after all: put everything back as it was
        with contextlib.suppress(OSError):
            os.rename(final, tmp)
            if aside is not None:
                os.rename(aside, final)
        raise
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


# ------------------------------------------------------------------ load
def _resolve(path) -> str:
    path = os.fspath(path)
    if os.path.isfile(os.path.join(path, "zarr.json")):
        return path
    if os.path.isdir(path):
        found = latest(path)
        if found is None:
            raise IparError(
                f"no complete checkpoint in {path!r} (looked for ckpt-<step> directories). "
                "Train with checkpoints first, or pass the right directory."
            )
        return found
    raise IparError(f"checkpoint {path!r} does not exist.")


def _check_model(model, meta, path):
    mine = _model_meta(model)
    theirs_layers = meta["layers"]
    if len(theirs_layers) != len(mine["layers"]):
        raise IparError(
            f"checkpoint {path!r} holds a model of {len(theirs_layers)} layers (sizes "
            f"{meta['sizes']}), but this model has {len(mine['layers'])} (sizes {model.sizes}). "
            "Build the model with the same layers as the checkpoint."
        )
    if model.input_dim is not None and meta["sizes"][0] != model.input_dim:
        raise IparError(
            f"checkpoint {path!r} was saved for {meta['sizes'][0]} input features, this model "
            f"has input_dim={model.input_dim}. Build the model with input_dim="
            f"{meta['sizes'][0]}."
        )
    for k, (a, b) in enumerate(zip(theirs_layers, mine["layers"])):
        for field in ("n_out", "bias", "activation"):
            if a.get(field) != b[field]:
                raise IparError(
                    f"checkpoint {path!r} does not match this model: layer {k} has "
                    f"{field}={a.get(field)!r} in the checkpoint but {b[field]!r} here "
                    f"(checkpoint sizes {meta['sizes']}, model sizes {model.sizes}). Build "
                    "the model with the checkpoint's layers."
                )
        if model.input_dim is not None and a["n_in"] != b["n_in"]:
            raise IparError(
                f"checkpoint {path!r} does not match this model: layer {k} has "
                f"{a['n_in']} inputs in the checkpoint but {b['n_in']} here. Build the model "
                "with the checkpoint's layers."
            )
    if meta["dtype"] != mine["dtype"]:
        raise IparError(
            f"checkpoint {path!r} holds {meta['dtype']} weights but the model is "
            f"{mine['dtype']}. Build the model with dtype={meta['dtype']!r}."
        )


def _check_array(zarr, path, shape, dtype, chunks=None):
    """Raise :class:`CheckpointCorrupt` unless the array at ``path`` is what the metadata
    promises: float, ``shape``, ``dtype``, ``chunks`` (version 2), every chunk file there."""
    def bad(what):
        raise CheckpointCorrupt(f"checkpoint array {path!r} {what}")

    try:
        arr = zarr.open_array(path, mode="r")
    except Exception as exc:
        bad(f"is missing or unreadable ({type(exc).__name__}); the checkpoint is incomplete "
            "or corrupted. Load an older one.")
    if arr.dtype.kind != "f":
        bad(f"has dtype {arr.dtype}; only float arrays are read (object and other "
            "non-numeric arrays are refused: no pickle).")
    if arr.dtype != np.dtype(dtype):
        bad(f"has dtype {arr.dtype}, metadata says {dtype}.")
    if tuple(arr.shape) != tuple(shape):
        bad(f"has shape {tuple(arr.shape)}, expected {tuple(shape)} for this model "
            "(n_out x (n_in + bias)). The checkpoint is of another model or corrupted.")
    if chunks is not None and tuple(arr.chunks) != tuple(chunks):
        bad(f"has chunks {tuple(arr.chunks)}, the metadata says {tuple(chunks)}; corrupted.")
    if arr.nchunks_initialized != arr.nchunks:
        bad(f"has {arr.nchunks_initialized} of {arr.nchunks} chunk files; the checkpoint is "
            "incomplete or corrupted. Load an older one.")


def load(model, path, *, timeout_s: float | None = None, fallback: bool = False,
         log=None) -> dict:
    """Restore weights and momentum from a checkpoint onto the model's current grid.

    Every block is checked, on the worker that reads it, against the checksums the
    checkpoint's metadata records, and the metadata against its own checksum.

    Parameters
    ----------
    model : Sequential
        Same layers and dtype as the saved model, distributed on any grid.
    path : str or path-like
        A ``ckpt-<step>`` directory, or a directory of checkpoints (its :func:`latest`).
    timeout_s : float, optional
        Give up (IparError) when the block reads take longer.
    fallback : bool
        With a directory of checkpoints: when the newest does not verify
        (:class:`CheckpointCorrupt`), say so through ``log`` and try the next older one,
        down to the oldest.
    log : callable, optional
        Gets one line per skipped checkpoint.

    Returns
    -------
    dict
        The checkpoint metadata (``step``, ``grid``, ``extra``, ...) and ``path``, the
        checkpoint loaded.

    Raises
    ------
    CheckpointCorrupt
        Missing or damaged chunk files, edited metadata, wrong shapes or dtypes (with
        ``fallback``: no checkpoint in the directory verifies).
    IparError
        No checkpoint, another model's checkpoint.
    WorkerLost
        A grid worker died while reading.
    """
    model._require_bound()  # a clear error for closed models and lost state
    p = os.fspath(path)
    if not fallback or os.path.isfile(os.path.join(p, "zarr.json")) or not os.path.isdir(p):
        return _load_one(model, _resolve(p), timeout_s)
    candidates = [c for _, c in reversed(_ckpt_dirs(p))]  # newest first
    if not any(os.path.isfile(os.path.join(c, "zarr.json")) for c in candidates):
        _resolve(p)  # raises: no complete checkpoint
    skipped = []
    for cand in candidates:
        try:
            if not os.path.isfile(os.path.join(cand, "zarr.json")):
                raise CheckpointCorrupt(f"checkpoint {cand!r} has no zarr.json: it is "
                                        "incomplete (a partial copy?)")
            return _load_one(model, cand, timeout_s)
        except CheckpointCorrupt as exc:
            skipped.append(f"{os.path.basename(cand)} ({exc})")
            if log is not None:
                log(f"skipped checkpoint {cand}: {exc}")
    raise CheckpointCorrupt(
        f"none of the {len(candidates)} checkpoints in {p!r} verifies: " + "; ".join(skipped)
    )


def _load_one(model, path, timeout_s):
    zarr = _zarr()
    meta = read_metadata(path)
    _check_model(model, meta, path)
    if model.input_dim is None:
        model.input_dim = int(meta["sizes"][0])
    has_v = bool(meta["has_velocity"])
    recorded = meta.get("arrays")  # version 2: shapes, chunks and checksums
    if recorded is None:
        import warnings

        warnings.warn(f"checkpoint {path!r} has format version 1 (written before checksums): "
                      "its values cannot be verified.", UserWarning, stacklevel=3)
    for name, shape in fmt.expected_arrays(meta).items():
        rec = None if recorded is None else recorded[name]
        _check_array(zarr, os.path.join(path, *name.split("/")), shape, meta["dtype"],
                     None if rec is None else rec["chunks"])
    w_names, v_names = model.reserve_state_keys(has_v)
    sb = model.state_blocks()
    client = model.client
    futures, status = {}, []
    label = os.path.basename(os.path.normpath(path))
    for lay, wn, vn in zip(sb["layers"], w_names, v_names):
        for kind, key_name in (("w", wn), ("v", vn)):
            if key_name is None:
                continue
            name = f"{lay['name']}/{kind}"
            apath = os.path.join(path, lay["name"], kind)
            digests = None if recorded is None else recorded[name]["sha256"]
            for (i, j), owner in lay["workers"].items():
                r0, r1 = lay["rows"][i]
                c0, c1 = lay["wcols"][j]
                key = (key_name, i, j)
                futures[key] = client.submit(
                    _read_block, apath, f"{label}/{name}", r0, r1, c0, c1, meta["dtype"],
                    digests, model.block_module, key=key, workers=[owner],
                    allow_other_workers=False,
                )
                status.append(client.submit(_read_status, futures[key], workers=[owner],
                                            allow_other_workers=False, pure=False,
                                            key=f"ckpt-check-{uuid.uuid4().hex}"))
    workers = sorted({w for lay in sb["layers"] for w in lay["workers"].values()})
    _wait_alive(client, status, workers, f"checkpoint load {path}", timeout_s)
    problems = [m for m in client.gather(status) if m is not None]
    if problems:
        more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
        raise CheckpointCorrupt(f"checkpoint {path!r}: {problems[0]}{more}; it is damaged. "
                                "Load an older one.")
    model.adopt_state(w_names, v_names, futures)
    meta = dict(meta)
    meta["path"] = path
    return meta


def recover(model, directory, *, grid=None, wait_timeout_s: float = 120.0, log=None) -> dict:
    """After a worker died: re-bind ``model`` to the live workers and load the last checkpoint.

    The model's blocks on the cluster are dropped (some are lost), the cluster is given
    up to ``wait_timeout_s`` to have ``Pr*Pc`` workers again (a nanny restarts a killed
    worker under a new address), the grid is bound afresh and the newest checkpoint
    that verifies is loaded (``load(..., fallback=True)``). Returns its metadata.
    """
    grid = model.grid if grid is None else grid
    client = model.client
    if grid is None or client is None:
        raise IparError("recover needs a model that was distributed before.")
    model.drop_state()
    try:
        wait_for_workers(client, grid.size, wait_timeout_s, log)
    except IparError as exc:
        raise IparError(
            f"{exc} (after a worker fault; start workers, then resume from the last "
            "checkpoint with dask-ipar train --resume)"
        ) from None
    model.distribute(client, grid)  # binds by worker name, asking the scheduler directly
    return load(model, directory, fallback=True, log=log)


# -------------------------------------------------------------- training
@contextlib.contextmanager
def _faults_as_worker_lost(model, what):
    """Turn any cluster error raised while a grid worker is gone into :class:`WorkerLost`.

    A dead worker shows up in many ways (cancelled futures, lost dependencies, closed
    comms), depending on the moment it died; the test is whether a grid worker left.
    """
    workers = model.binding.workers
    try:
        yield
    except (WorkerLost, KeyboardInterrupt, CheckpointStorageError, CheckpointCorrupt):
        raise  # storage and data faults end the run at once: no worker to wait for
    except Exception as exc:  # IparError too: a lineage cut that found a grid worker gone
        gone = _gone_soon(model.client, workers)
        if gone:
            raise WorkerLost(gone, what) from exc
        raise


def batch_indices(n: int, batch_size: int, step: int, seed: int) -> np.ndarray:
    """Sample indices of training step ``step`` (0-based): a pure function of its arguments.

    Epoch ``e = step // (n // batch_size)`` shuffles the samples with
    ``default_rng([seed, e])``; the step takes the next ``batch_size`` of them (a short
    last batch is dropped), so a resumed run sees exactly the batches of an
    uninterrupted one.
    """
    per_epoch = n // batch_size
    if per_epoch < 1:
        raise IparError(f"batch size {batch_size} exceeds the {n} samples.")
    epoch, k = divmod(step, per_epoch)
    order = np.random.default_rng([seed, epoch]).permutation(n)
    return order[k * batch_size:(k + 1) * batch_size]


def train_with_checkpoints(model, X, y, *, steps: int, every: int, directory,
                           batch_size: int = 32, optimizer=None, seed: int = 0,
                           resume: bool = True, keep: int | None = 2, max_restarts: int = 3,
                           wait_timeout_s: float = 120.0, step_timeout_s: float | None = None,
                           log=None, on_step=None) -> dict:
    """Train ``steps`` SGD steps, saving a checkpoint every ``every`` steps and at the end.

    When a grid worker dies, the step (or save) in flight fails with :class:`WorkerLost`;
    the loop reports it through ``log``, calls :func:`recover` (re-bind to the live
    workers, load :func:`latest`) and replays the steps since that checkpoint. Batches
    come from :func:`batch_indices`, so the result equals an uninterrupted run's.

    Parameters
    ----------
    model : Sequential
        Distributed (``model.distribute(client, grid)``).
    X, y : arrays
        Features ``(n, d)`` and integer labels ``(n,)``.
    steps, every : int
        Total steps, and steps between checkpoints (``every >= 1``).
    directory : str or path-like
        Checkpoint directory.
    batch_size, optimizer, seed
        As for :meth:`Sequential.fit`; ``seed`` drives the batch order.
    resume : bool
        Start from :func:`latest` in ``directory`` when there is one (else from step 0,
        saved first as ``ckpt-0`` so a fault before the first checkpoint is recoverable).
    keep : int or None
        Checkpoints kept on disk.
    max_restarts : int
        Worker faults survived before the last one is re-raised.
    log : callable, optional
        Gets one line per checkpoint, fault and recovery.
    on_step : callable, optional
        ``on_step(step, loss)`` after each step completes (1-based step).

    Returns
    -------
    dict
        ``{"steps", "restarts", "losses" (per step, final run), "checkpoint"}``.
    """
    from dask_ipar.io.data import as_features, as_labels
    from dask_ipar.optim import SGD

    optimizer = optimizer or SGD()
    for name, v, lo in (("steps", steps, 1), ("every", every, 1), ("batch_size", batch_size, 1)):
        if not isinstance(v, int) or isinstance(v, bool) or v < lo:
            raise IparError(f"{name} must be an integer >= {lo}, got {v!r}.")
    if model.binding is None:
        raise IparError("train_with_checkpoints needs model.distribute(client, grid) first.")
    X = as_features(X, model.input_dim, model.dtype)
    y = as_labels(y, X.shape[0], model.n_classes)
    if model.input_dim is None:
        model.input_dim = X.shape[1]
    grid = model.grid
    if batch_size < grid.pc:
        raise IparError(
            f"batch size {batch_size} is smaller than the grid's Pc = {grid.pc} columns; use "
            f"a batch of at least {grid.pc}."
        )
    say = log or (lambda msg: None)
    extra = {"optimizer": {"lr": optimizer.lr, "momentum": optimizer.momentum,
                           "weight_decay": optimizer.weight_decay},
             "batch_size": batch_size, "seed": seed}
    directory = os.fspath(directory)
    start = 0
    if resume and latest(directory) is not None:
        meta = load(model, directory, fallback=True, log=say)
        start = int(meta["step"])
        last_ckpt = meta["path"]
        say(f"resumed from {last_ckpt} (step {start})")
    else:
        found = checkpoints(directory)
        if found:
            raise IparError(
                f"{directory!r} already holds checkpoints (steps {found[0][0]} to "
                f"{found[-1][0]}) and resume is off. Resume from them (resume=True, "
                "--resume), or use an empty directory."
            )
        model.state_blocks()  # builds the initial weights
        last_ckpt = save(model, directory, step=0, keep=keep, extra=extra)
    losses: dict[int, float] = {}
    restarts = 0
    step = start
    while True:
        try:
            while step < steps:
                idx = batch_indices(X.shape[0], batch_size, step, seed)
                with _faults_as_worker_lost(model, f"training step {step + 1}"):
                    futs = model.train_step(X[idx], y[idx], optimizer)
                    _wait_alive(model.client, futs, model.binding.workers,
                                f"training step {step + 1}", step_timeout_s)
                    loss_sum, correct = np.sum(model.client.gather(futs), axis=0)
                if not math.isfinite(loss_sum):
                    raise IparError(
                        f"training diverged at step {step + 1}: the loss is {loss_sum}. "
                        "Lower the learning rate or standardize the inputs."
                    )
                step += 1
                losses[step] = float(loss_sum / len(idx))
                if on_step is not None:
                    on_step(step, losses[step])
                if step % every == 0 or step == steps:
                    with _faults_as_worker_lost(model, f"checkpoint of step {step}"):
                        last_ckpt = save(model, directory, step=step, keep=keep, extra=extra,
                                         timeout_s=step_timeout_s)
                    say(f"checkpoint {last_ckpt} (step {step})")
            break
        except WorkerLost as exc:
            fault = exc
            # worker programs still waiting for the lost worker's blocks hold their threads
            model.abort_programs(str(fault))
            while True:  # a replacement worker may die too: recover again
                restarts += 1
                say(f"step {step + 1}: {fault}")
                if restarts > max_restarts:
                    raise fault
                try:
                    with _faults_as_worker_lost(model, "recovery"):
                        meta = recover(model, directory, grid=grid,
                                       wait_timeout_s=wait_timeout_s, log=say)
                    break
                except WorkerLost as again:
                    fault = again
            step = int(meta["step"])
            last_ckpt = meta["path"]
            say(f"recovered on workers {', '.join(model.binding.workers)}; resuming after "
                f"step {step} from {last_ckpt} (restart {restarts} of at most {max_restarts})")
            for s in [s for s in losses if s > step]:
                del losses[s]
    return {"steps": step, "restarts": restarts,
            "losses": [losses[s] for s in sorted(losses)], "checkpoint": last_ckpt}
