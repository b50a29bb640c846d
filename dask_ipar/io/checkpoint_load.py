"""Reading a checkpoint: :func:`read_metadata` and :func:`load`, every block read and
verified by the worker of the current grid that owns it, on any grid.

Part of :mod:`dask_ipar.io.checkpoint` (which re-exports both and documents the
checks).
"""

from __future__ import annotations

import os
import uuid

import numpy as np

from dask_ipar.io import checkpoint_format as fmt
from dask_ipar.io.checkpoint_dirs import _NAME, _ckpt_dirs, _resolve
from dask_ipar.io.checkpoint_faults import _wait_alive
from dask_ipar.io.checkpoint_format import CheckpointCorrupt
from dask_ipar.io.checkpoint_save import _model_meta, _zarr
from dask_ipar.io.checkpoint_tasks import _describe, _read_block, _read_status, _stack_moments
from dask_ipar.errors import IparError

__all__ = ["load", "read_metadata"]


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
    adam = has_v and meta.get("optimizer_state") == "adam"
    moments = {}  # Adam: (v name, i, j) -> the futures of its two moments
    for lay, wn, vn in zip(sb["layers"], w_names, v_names):
        kinds = (("w", wn), ("m", vn), ("s", vn)) if adam else (("w", wn), ("v", vn))
        for kind, key_name in kinds:
            if key_name is None:
                continue
            name = f"{lay['name']}/{kind}"
            apath = os.path.join(path, lay["name"], kind)
            digests = None if recorded is None else recorded[name]["sha256"]
            for (i, j), owner in lay["workers"].items():
                r0, r1 = lay["rows"][i]
                c0, c1 = lay["wcols"][j]
                key = (key_name, i, j)
                part = kind in ("m", "s")
                fut = client.submit(
                    _read_block, apath, f"{label}/{name}", r0, r1, c0, c1, meta["dtype"],
                    digests, None if part else model.block_module, workers=[owner],
                    allow_other_workers=False,
                    **({"pure": False} if part else {"key": key}),
                )
                if part:
                    moments.setdefault(key, []).append(fut)
                else:
                    futures[key] = fut
                status.append(client.submit(_read_status, fut, workers=[owner],
                                            allow_other_workers=False, pure=False,
                                            key=f"ckpt-check-{uuid.uuid4().hex}"))
    workers = sorted({w for lay in sb["layers"] for w in lay["workers"].values()})
    _wait_alive(client, status, workers, f"checkpoint load {path}", timeout_s)
    problems = [m for m in client.gather(status) if m is not None]
    if problems:
        more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
        raise CheckpointCorrupt(f"checkpoint {path!r}: {problems[0]}{more}; it is damaged. "
                                "Load an older one.")
    for key, (m, s_) in moments.items():
        futures[key] = client.submit(_stack_moments, m, s_, model.block_module, key=key,
                                     workers=[model.binding.worker(*key[1:])],
                                     allow_other_workers=False)
    del moments
    model.adopt_state(w_names, v_names, futures)
    model._store.opt = (("adam" if adam else "sgd") if has_v else None,
                        int(meta.get("optimizer_steps", meta["step"])))
    meta = dict(meta)
    meta["path"] = path
    return meta

