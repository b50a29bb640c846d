"""A trained model as one file: :meth:`Sequential.save` / :meth:`Sequential.load`.

The file is a NumPy ``.npz`` archive read with ``allow_pickle=False`` (nothing in it can
run code): ``meta`` holds JSON (format, version, dtype, seed, input shape, the layer
specs as ``{"type": "Dense", "units": ..., ...}``), ``W<k>``/``b<k>`` the weights of the
k-th layer that has them (``W`` as :meth:`Sequential.get_weights` returns it), and
``scaling_mean``/``scaling_scale`` the input standardization when the model has one. A
checkpoint directory (:mod:`dask_ipar.io.checkpoint`) carries the optimizer state for
resuming; this file carries what ``predict`` and ``evaluate`` need.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import zipfile

import numpy as np

from dask_ipar.errors import IparError
from dask_ipar.nn import layers as L

__all__ = ["FORMAT", "VERSION", "save_model", "load_model"]

FORMAT = "dask-ipar-model"
VERSION = 1
_LAYERS = {c.__name__: c for c in (L.Dense, L.Conv2d, L.MaxPool2d, L.AvgPool2d, L.Flatten)}


def _spec(layer) -> dict:
    out = {"type": type(layer).__name__}
    for f in dataclasses.fields(layer):
        v = getattr(layer, f.name)
        out[f.name] = list(v) if isinstance(v, tuple) else v
    return out


def _layer(spec: dict):
    spec = dict(spec)
    cls = _LAYERS.get(spec.pop("type", None))
    if cls is None:
        raise IparError(f"unknown layer type in the model file: {spec!r}.")
    kw = {k: tuple(v) if isinstance(v, list) else v for k, v in spec.items()}
    return cls(**kw)


def save_model(model, path) -> str:
    """Write ``model`` (weights gathered from the cluster, or its initial ones) to ``path``
    atomically (a file beside it, renamed). Returns the path."""
    path = os.fspath(path)
    params = model.get_weights()
    meta = {
        "format": FORMAT, "version": VERSION, "dtype": model.dtype.name, "seed": model.seed,
        "input_dim": model.input_dim,
        "input_shape": None if model.input_shape is None else list(model.input_shape),
        "layers": [_spec(lay) for lay in model.layers],
    }
    arrays = {"meta": np.array(json.dumps(meta))}
    for k, (W, b) in enumerate(params):
        arrays[f"W{k}"] = W
        if b is not None:
            arrays[f"b{k}"] = b
    if model.scaling is not None:
        arrays["scaling_mean"] = model.scaling.mean
        arrays["scaling_scale"] = model.scaling.scale
    folder = os.path.dirname(os.path.abspath(path))
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".npz", dir=folder)
        with os.fdopen(fd, "wb") as fh:
            np.savez(fh, **arrays)
            fh.flush()
            os.fsync(fh.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # as a plain open() would (mkstemp makes it 0600)
        os.replace(tmp, path)
    except OSError as exc:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
        raise IparError(f"cannot write the model file {path!r}: {exc.strerror or exc}.") from None
    return path


def load_model(cls, path, **kwargs):
    """The model (a ``cls``: :class:`~dask_ipar.model.Sequential`) saved in ``path``, not
    yet distributed; ``distribute`` places its weights. ``kwargs`` go to the constructor
    (``device``)."""
    from dask_ipar.io.scaling import Standardizer

    path = os.fspath(path)
    try:
        with np.load(path, allow_pickle=False) as z:
            data = {k: z[k] for k in z.files}
    except FileNotFoundError:
        raise IparError(f"model file {path!r} does not exist.") from None
    except (OSError, ValueError, zipfile.BadZipFile) as exc:
        raise IparError(f"{path!r} is not a dask-ipar model file ({exc}); save one with "
                        "model.save(path) or dask-ipar train --save FILE.") from None
    try:
        meta = json.loads(str(data["meta"]))
        if meta.get("format") != FORMAT:
            raise ValueError(f"format {meta.get('format')!r}")
        version = int(meta.get("version", 0))
    except (KeyError, ValueError, TypeError) as exc:
        raise IparError(f"{path!r} is not a dask-ipar model file ({exc}).") from None
    if version > VERSION:
        raise IparError(f"{path!r} was written by a newer dask-ipar (model file version "
                        f"{version}, this one reads {VERSION}); upgrade dask-ipar.")
    try:
        layers = [_layer(s) for s in meta["layers"]]
        shape, input_dim, dtype, seed = (meta["input_shape"], meta["input_dim"],
                                         meta["dtype"], meta["seed"])
    except IparError:
        raise
    except (KeyError, ValueError, TypeError) as exc:
        raise IparError(f"{path!r} is not a dask-ipar model file ({exc!r} in its "
                        "metadata).") from None
    model = cls(layers, input_dim, input_shape=None if shape is None else tuple(shape),
                dtype=dtype, seed=seed, **kwargs)
    n = sum(1 for k in data if k.startswith("W"))
    params = [(data[f"W{k}"], data.get(f"b{k}")) for k in range(n)]
    model._init_params = params  # checked against the layers by distribute()
    if "scaling_mean" in data:
        model.scaling = Standardizer(data["scaling_mean"], data["scaling_scale"])
    return model
