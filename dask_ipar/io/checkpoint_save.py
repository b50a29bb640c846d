"""Writing a checkpoint: :func:`save`, each chunk written by the worker that owns it,
the whole published atomically.

Part of :mod:`dask_ipar.io.checkpoint` (which re-exports :func:`save` and documents the
layout).
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import time
import uuid

import numpy as np

from dask_ipar.io import checkpoint_format as fmt
from dask_ipar.io.checkpoint_dirs import _fsync_tree, _publish, _remove_stale, checkpoints
from dask_ipar.io.checkpoint_faults import _wait_alive
from dask_ipar.io.checkpoint_tasks import (_moment, _storage_error, _storage_errors, _take,
                                           _write_region)
from dask_ipar.errors import IparError

__all__ = ["save"]


def _zarr():
    try:
        import zarr
    except ImportError:
        raise IparError(
            "checkpoints need zarr, which is not installed. Install it with: "
            "pip install 'dask-ipar[checkpoint]'"
        ) from None
    return zarr


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


def _owned_range(b0: int, b1: int, chunk: int, n: int):
    """Rows ``[lo, hi)`` of the chunks whose first element lies in ``[b0, b1)``."""
    first = -(-b0 // chunk)
    stop = -(-b1 // chunk)
    if first >= stop:
        return None
    return first * chunk, min(stop * chunk, n)


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
    opt_kind, opt_steps = model._store.opt
    adam = has_v and opt_kind == "adam"
    meta = {
        "format": fmt.FORMAT, "version": fmt.ADAM_VERSION if adam else fmt.VERSION,
        "step": step, "grid": [pr, pc],
        "has_velocity": has_v, **_model_meta(model),
        "optimizer_state": "adam" if adam else "momentum", "optimizer_steps": int(opt_steps),
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
        if adam:  # the moments of each state block, as 2-D host copies on its owner
            for lay in sb["layers"]:
                for k, kind in enumerate(("m", "s")):
                    lay[kind] = {c: client.submit(_moment, f, k, workers=[lay["workers"][c]],
                                                  allow_other_workers=False, pure=False,
                                                  key=f"ckpt-moment-{uuid.uuid4().hex}")
                                 for c, f in lay["v"].items()}
                    slices.extend(lay[kind].values())
        kinds = ("w", "m", "s") if adam else ("w", "v") if has_v else ("w",)
        for lay in sb["layers"]:
            n_rows, n_cols = lay["n_out"], lay["n_in"] + int(lay["bias"])
            rows, cols = lay["rows"], lay["wcols"]
            ch = max(b - a for a, b in rows)
            cw = max(b - a for a, b in cols)
            with _storage_errors(directory, what):
                g = group.require_group(lay["name"])
            for kind in kinds:
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

