"""Training data: user arrays checked at the public boundary, files read where they lie,
and the bundled digits set.

Training data from files: NumPy ``.npy``/``.npz``, Zarr groups and HDF5.

:func:`load_dataset` returns ``(X, y)``: features ``(n_samples, n_features)`` and
integer labels ``(n_samples,)``. Small data sets come back as NumPy arrays; data sets
larger than ``max_in_memory`` bytes come back as dask arrays chunked by whole batches
of rows (``chunk_rows``), read lazily from the file.

Accepted paths:

=============================== ===========================================================
``data.npz``                    arrays ``X`` and ``y`` (names configurable)
``X.npy`` / ``train_X.npy``     the features; labels from the sibling ``y.npy`` /
                                ``train_y.npy`` (the last ``X`` of the name becomes ``y``),
                                or from ``y_path``
``dir/`` with ``X.npy, y.npy``  a directory holding the two files
``data.zarr``                   a Zarr group with arrays ``X`` and ``y``
``data.h5`` / ``.hdf5``         an HDF5 file with datasets ``X`` and ``y`` (needs h5py)
=============================== ===========================================================

Nothing is unpickled: ``.npy``/``.npz`` are read with ``allow_pickle=False`` and object
arrays are refused in every format.
"""

from __future__ import annotations

import os

import numpy as np

from dask_ipar.errors import IparError

__all__ = ["as_features", "as_inputs", "as_labels", "load_digits_split", "load_digits_images", "load_dataset",
           "train_test_split", "FORMATS"]


def _materialize(a, what):
    if hasattr(a, "dask") and hasattr(a, "compute"):
        a = a.compute()
    try:
        return np.asarray(a)
    except Exception as exc:  # e.g. ragged lists
        raise IparError(f"{what} could not be converted to an array: {exc}") from exc


def as_features(X, n_features: int | None, dtype) -> np.ndarray:
    """Check and convert features ``(n_samples, n_features)``: numeric, finite, 2-D.

    Dask arrays are computed (the data set is held by the client and sent to the
    workers batch by batch).
    """
    X = _materialize(X, "X")
    if X.dtype.kind not in "biuf":
        raise IparError(
            f"X must be numeric, got dtype {X.dtype}. Convert it first, for example "
            "X.astype('float32'), after encoding any categorical or text columns."
        )
    if X.ndim != 2:
        raise IparError(
            f"X must be 2-D (n_samples, n_features), got shape {X.shape}. "
            "Reshape images with X.reshape(len(X), -1)."
        )
    if n_features is not None and X.shape[1] != n_features:
        raise IparError(
            f"X has {X.shape[1]} features but the model's first layer expects {n_features}. "
            f"Build the model with input_dim={X.shape[1]} or select {n_features} features."
        )
    X = X.astype(dtype, copy=False)
    if not np.isfinite(X).all():
        bad = np.argwhere(~np.isfinite(X))[0]
        raise IparError(
            f"X contains NaN or inf (first at sample {bad[0]}, feature {bad[1]}). "
            "Impute or drop those values before training."
        )
    return X


def as_inputs(X, input_dim, input_shape, dtype, scaling=None):
    """Checked model inputs: ``(n, features)``, or ``(n, C, H, W)`` images when
    ``input_shape`` (C, H, W) is given (images may come flattened), standardized by
    ``scaling``. Data outside the client's memory (dask arrays, Zarr, HDF5, memmaps)
    comes back as :class:`dask_ipar.io.lazy.LazyInputs`, checked from its metadata: the
    cells read and check its values block by block."""
    from dask_ipar.io.lazy import LazyInputs, is_lazy, lazy_inputs

    if isinstance(X, LazyInputs) or is_lazy(X):
        X = X if isinstance(X, LazyInputs) else lazy_inputs(X, dtype, input_dim, input_shape)
        return X if scaling is None else X.scaled(scaling)
    if input_shape is None:
        X = as_features(X, input_dim, dtype)
        return X if scaling is None else scaling.apply(X)
    shape = getattr(X, "shape", None)
    if shape is not None and len(shape) == 3 and input_shape[0] == 1:
        X, shape = X[:, None], (shape[0], 1) + tuple(shape[1:])  # grayscale (n, H, W)
    if shape is not None and len(shape) == 4:
        if tuple(shape[1:]) != input_shape:
            raise IparError(
                f"images have shape {tuple(shape[1:])} (C, H, W), the model expects "
                f"{input_shape} (input_shape)."
            )
        X = X.reshape(shape[0], -1)
    X = as_features(X, input_dim, dtype)
    X = X.reshape(X.shape[0], *input_shape)
    return X if scaling is None else scaling.apply(X)


def as_labels(y, n_samples: int, n_classes: int, lazy: bool = True) -> np.ndarray:
    """Check and convert integer class labels in ``[0, n_classes)`` (labels outside the
    client's memory: :class:`dask_ipar.io.lazy.LazyLabels`, their values checked as the
    cells read them; unless ``lazy`` is False: inputs in memory take labels in memory,
    which are then read here)."""
    from dask_ipar.io.lazy import LazyLabels, as_lazy, is_lazy, labels_of, lazy_labels

    if lazy and isinstance(y, LazyLabels):
        return y
    if is_lazy(y):
        if lazy:
            return lazy_labels(y, n_samples, n_classes)
        y = labels_of(as_lazy(y))
    y = _materialize(y, "y")
    if y.ndim == 2 and y.shape[1] == 1:
        y = y[:, 0]
    if y.ndim != 1:
        raise IparError(f"y must be 1-D class labels, got shape {y.shape}.")
    if y.shape[0] != n_samples:
        raise IparError(f"X has {n_samples} samples but y has {y.shape[0]} labels.")
    if y.dtype.kind == "f":
        if not np.isfinite(y).all() or (y != np.round(y)).any():
            raise IparError("y must hold integer class labels; got non-integer values.")
    elif y.dtype.kind not in "biu":
        raise IparError(
            f"y must hold integer class labels, got dtype {y.dtype}. "
            "Encode string labels first, e.g. with numpy.unique(y, return_inverse=True)."
        )
    y = y.astype(np.int64)
    if y.size and (y.min() < 0 or y.max() >= n_classes):
        raise IparError(
            f"labels must lie in [0, {n_classes}) for a last layer of {n_classes} units; "
            f"got labels from {y.min()} to {y.max()}. Widen the last layer to "
            f"{max(int(y.max()) + 1, n_classes)} units or remap the labels."
        )
    return y


def _load_digits():
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise IparError(
            "the digits data set needs scikit-learn: pip install 'dask-ipar[train]'"
        ) from exc
    return load_digits(return_X_y=True)


def _test_mask(y, test_fraction, seed):
    """The same share of every class held out, drawn with ``seed``."""
    rng = np.random.default_rng(seed)
    test = np.zeros(len(y), dtype=bool)
    for c in np.unique(y):
        idx = np.flatnonzero(y == c)
        rng.shuffle(idx)
        test[idx[: int(round(test_fraction * len(idx)))]] = True
    return test


def load_digits_images(test_fraction: float = 0.2, seed: int = 0, upsample: int = 1):
    """The digits of :func:`load_digits_split` (same split) as NCHW images.

    Shape ``(n, 1, 8*upsample, 8*upsample)``: each pixel repeated ``upsample`` times
    along both axes (more rows to split over ``Pr``), standardized with the training
    pixels' global mean and deviation (images keep their contrast).
    """
    X, y = _load_digits()
    test = _test_mask(y, test_fraction, seed)
    imgs = X.reshape(-1, 1, 8, 8)
    if upsample > 1:
        imgs = imgs.repeat(upsample, axis=2).repeat(upsample, axis=3)
    mean, std = imgs[~test].mean(), imgs[~test].std()
    imgs = (imgs - mean) / std
    return imgs[~test], y[~test].astype(np.int64), imgs[test], y[test].astype(np.int64)


def load_digits_split(test_fraction: float = 0.2, seed: int = 0):
    """scikit-learn's bundled 8x8 digits (no download), standardized, split per class.

    Returns ``X_train, y_train, X_test, y_test`` (float64 features, int64 labels).
    """
    X, y = _load_digits()
    test = _test_mask(y, test_fraction, seed)
    Xtr, Xte = X[~test], X[test]
    mean, std = Xtr.mean(axis=0), Xtr.std(axis=0)
    std[std == 0] = 1.0
    return (Xtr - mean) / std, y[~test].astype(np.int64), (Xte - mean) / std, y[test].astype(np.int64)


#: What :func:`load_dataset` reads.
FORMATS = (".npz", ".npy", "zarr", ".h5/.hdf5")


def _check(X, y, source, x_key, y_key):
    """Validate shapes and dtypes (metadata only: nothing of a lazy array is read)."""
    for name, key, a in (("features", x_key, X), ("labels", y_key, y)):
        kind = np.dtype(a.dtype).kind
        if kind not in "biuf":
            raise IparError(
                f"{source}: the {name} array {key!r} has dtype {a.dtype}; expected numbers "
                "(object, string and structured arrays are refused). Store them as "
                "float (features) and int (labels)."
            )
    if len(X.shape) not in (2, 3, 4):
        raise IparError(
            f"{source}: features {x_key!r} have shape {tuple(X.shape)}, expected "
            "(n_samples, n_features), or images (n, C, H, W) or (n, H, W)."
        )
    if len(y.shape) == 2 and y.shape[1] == 1:
        y = y[:, 0]
    if len(y.shape) != 1:
        raise IparError(
            f"{source}: labels {y_key!r} have shape {tuple(y.shape)}, expected 1-D "
            "(n_samples,) integer class labels."
        )
    if X.shape[0] != y.shape[0]:
        raise IparError(
            f"{source}: {X.shape[0]} samples in {x_key!r} but {y.shape[0]} labels in "
            f"{y_key!r}; they must have the same length."
        )
    if X.shape[0] == 0:
        raise IparError(f"{source}: the data set is empty.")
    return X, y


def _finish(X, y, source, x_key, y_key, chunk_rows, max_in_memory):
    """NumPy when small, else dask arrays chunked by ``chunk_rows`` rows."""
    X, y = _check(X, y, source, x_key, y_key)
    nbytes = int(np.prod(X.shape)) * np.dtype(X.dtype).itemsize
    if nbytes <= max_in_memory:
        return np.asarray(X[...]), np.asarray(y[...])
    import dask.array as da

    rows = max(1, int(chunk_rows))
    Xd = X if isinstance(X, da.Array) else da.from_array(X, chunks=(rows, X.shape[1]))
    yd = y if isinstance(y, da.Array) else da.from_array(y, chunks=(rows,))
    return Xd.rechunk((rows, X.shape[1])), yd.rechunk((rows,))


def _keys_error(source, missing, available):
    return IparError(
        f"{source} has no array {missing!r}; it holds {sorted(available) or 'nothing'}. "
        "Store the features as 'X' and the labels as 'y', or pass x_key=/y_key= "
        "(data.x_key / data.y_key)."
    )


def _npy(path, y_path, source):
    if y_path is None:
        d, base = os.path.split(path)
        stem = base[:-4]
        k = stem.rfind("X")
        if k < 0:
            raise IparError(
                f"{source}: cannot tell where the labels are: the file name has no 'X' to "
                "turn into 'y'. Name the pair X.npy and y.npy (or train_X.npy and "
                "train_y.npy), or pass y_path=."
            )
        y_path = os.path.join(d, stem[:k] + "y" + stem[k + 1:] + ".npy")
    if not os.path.isfile(y_path):
        raise IparError(f"{source}: the labels file {y_path!r} does not exist.")
    try:
        X = np.load(path, mmap_mode="r", allow_pickle=False)
        y = np.load(y_path, mmap_mode="r", allow_pickle=False)
    except ValueError as exc:  # object arrays need pickle
        raise IparError(_unreadable(source, exc, "numpy.save(path, X)")) from None
    return X, y


def _unreadable(source, exc, how) -> str:
    """What to say of a .npy/.npz file NumPy reads only by unpickling (object arrays), or
    one that is no NumPy file at all (NumPy then takes it for a pickle)."""
    if "pickle" in str(exc):
        return (f"{source} is not a file of numeric NumPy arrays: it is another kind of file, "
                f"or holds Python objects, which are not read (no unpickling). Save the "
                f"features and labels as numeric arrays: {how}.")
    return f"{source}: {exc}."


def load_dataset(path, *, y_path=None, x_key: str = "X", y_key: str = "y",
                 chunk_rows: int = 4096, max_in_memory: int = 2**30, lazy: bool = False):
    """Load ``(X, y)`` from a ``.npz``, ``.npy`` pair, Zarr group or HDF5 file.

    Parameters
    ----------
    path : str or path-like
        See the module docstring for the accepted layouts.
    y_path : str, optional
        The labels ``.npy`` when ``path`` is a features ``.npy`` with another name.
    x_key, y_key : str
        Array names inside ``.npz``, Zarr and HDF5 files.
    chunk_rows : int
        Rows per chunk of the dask arrays returned for large data (use a multiple of
        the batch size).
    max_in_memory : int
        Feature arrays up to this many bytes are read into NumPy.
    lazy : bool
        Zarr, HDF5 and ``.npy`` data as :class:`dask_ipar.io.lazy.LazyData` whatever
        its size: nothing is read here; the workers of the grid read their own blocks
        (``.npz`` files are compressed archives and come back as NumPy).

    Returns
    -------
    X, y : numpy.ndarray or dask.array.Array
        ``(n_samples, n_features)`` features and ``(n_samples,)`` labels, as stored
        (convert and validate with :func:`dask_ipar.io.data.as_features` / ``as_labels``,
        which :meth:`Sequential.fit` does).

    Raises
    ------
    IparError
        Missing file or array, unknown format, wrong shapes or non-numeric arrays.

    Examples
    --------
    >>> X, y = load_dataset("train.npz")             # doctest: +SKIP
    >>> X, y = load_dataset("/scratch/train.zarr")   # doctest: +SKIP
    """
    path = os.fspath(path)
    source = repr(path)
    if not os.path.exists(path):
        raise IparError(
            f"data path {source} does not exist. Give a .npz, .npy, Zarr or HDF5 path "
            "(or no path for the bundled digits)."
        )
    low = path.lower().rstrip("/")
    if lazy:
        out = _lazy(path, low, source, y_path, x_key, y_key, chunk_rows)
        if out is not None:
            return out
    args = (source, x_key, y_key, chunk_rows, max_in_memory)
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "zarr.json")) or os.path.isfile(
                os.path.join(path, ".zgroup")):
            return _zarr_group(path, *args)
        xf, yf = os.path.join(path, "X.npy"), os.path.join(path, "y.npy")
        if os.path.isfile(xf) and os.path.isfile(yf):
            return _finish(*_npy(xf, yf, source), source, "X.npy", "y.npy", chunk_rows,
                           max_in_memory)
        raise IparError(
            f"data directory {source} is neither a Zarr group nor holds X.npy and y.npy."
        )
    if low.endswith(".npz"):
        try:
            with np.load(path, allow_pickle=False) as f:
                if x_key not in f.files or y_key not in f.files:
                    raise _keys_error(source, x_key if x_key not in f.files else y_key, f.files)
                X, y = f[x_key], f[y_key]
        except ValueError as exc:
            if isinstance(exc, IparError):
                raise
            raise IparError(_unreadable(source, exc, "numpy.savez(path, X=X, y=y)")) from None
        return _finish(X, y, *args)
    if low.endswith(".npy"):
        return _finish(*_npy(path, y_path, source), source, os.path.basename(path),
                       "labels", chunk_rows, max_in_memory)
    if low.endswith((".h5", ".hdf5", ".hdf")):
        return _hdf5(path, *args)
    raise IparError(
        f"data path {source} has an unknown format; expected one of {', '.join(FORMATS)}."
    )


def _lazy(path, low, source, y_path, x_key, y_key, chunk_rows):
    """``(X, y)`` as :class:`~dask_ipar.io.lazy.LazyData` of their files, or None (npz)."""
    from dask_ipar.io.lazy import LazyData
    from dask_ipar.io.sources import H5Source, NpySource, ZarrSource

    def npy(xf, yf):
        X, y = _check(*_npy(xf, yf, source), source, os.path.basename(xf), "labels")
        return (LazyData(NpySource(xf, X.shape, X.dtype, chunk_rows)),
                LazyData(NpySource(yf or _npy_labels(xf), y.shape, y.dtype, chunk_rows)))

    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "zarr.json")) or os.path.isfile(
                os.path.join(path, ".zgroup")):
            import zarr

            g = zarr.open_group(path, mode="r")
            names = set(g.array_keys())
            for k in (x_key, y_key):
                if k not in names:
                    raise _keys_error(source, k, names)
            X, y = _check(g[x_key], g[y_key], source, x_key, y_key)
            return LazyData(ZarrSource(g[x_key])), LazyData(ZarrSource(g[y_key]))
        xf, yf = os.path.join(path, "X.npy"), os.path.join(path, "y.npy")
        if os.path.isfile(xf) and os.path.isfile(yf):
            return npy(xf, yf)
        return None
    if low.endswith(".npy"):
        return npy(path, y_path)
    if low.endswith((".h5", ".hdf5", ".hdf")):
        try:
            import h5py
        except ImportError:
            raise IparError(f"{source} is an HDF5 file; reading it needs h5py: pip install "
                            "h5py.") from None
        with h5py.File(path, "r") as f:
            names = set(f.keys())
            for k in (x_key, y_key):
                if k not in names or not isinstance(f[k], h5py.Dataset):
                    raise _keys_error(source, k, names)
            X, y = _check(f[x_key], f[y_key], source, x_key, y_key)
            return tuple(LazyData(H5Source(path, k, f[k].shape, f[k].dtype, f[k].chunks))
                         for k in (x_key, y_key))
    return None


def _npy_labels(xf):
    d, base = os.path.split(xf)
    stem = base[:-4]
    k = stem.rfind("X")
    return os.path.join(d, stem[:k] + "y" + stem[k + 1:] + ".npy")


def _zarr_group(path, source, x_key, y_key, chunk_rows, max_in_memory):
    try:
        import zarr
    except ImportError:
        raise IparError(
            f"{source} is a Zarr group; reading it needs zarr: pip install "
            "'dask-ipar[checkpoint]' (or pip install zarr)."
        ) from None
    g = zarr.open_group(path, mode="r")
    names = set(g.array_keys())
    for k in (x_key, y_key):
        if k not in names:
            raise _keys_error(source, k, names)
    X, y = g[x_key], g[y_key]
    _check(X, y, source, x_key, y_key)
    nbytes = int(np.prod(X.shape)) * X.dtype.itemsize
    if nbytes <= max_in_memory:
        return _finish(X, y, source, x_key, y_key, chunk_rows, max_in_memory)
    import dask.array as da

    rows = max(1, int(chunk_rows))
    Xd = da.from_zarr(os.path.join(path, x_key)).rechunk((rows, X.shape[1]))
    yd = da.from_zarr(os.path.join(path, y_key))
    if yd.ndim == 2:
        yd = yd[:, 0]
    return Xd, yd.rechunk((rows,))


def _hdf5(path, source, x_key, y_key, chunk_rows, max_in_memory):
    try:
        import h5py
    except ImportError:
        raise IparError(
            f"{source} is an HDF5 file; reading it needs h5py: pip install h5py."
        ) from None
    f = h5py.File(path, "r")
    try:
        names = set(f.keys())
        for k in (x_key, y_key):
            if k not in names or not isinstance(f[k], h5py.Dataset):
                raise _keys_error(source, k, names)
        X, y = f[x_key], f[y_key]
        _check(X, y, source, x_key, y_key)
        nbytes = int(np.prod(X.shape)) * X.dtype.itemsize
        if nbytes <= max_in_memory:
            out = np.asarray(X[...]), np.asarray(y[...]).reshape(-1)
            f.close()
            return out
    except BaseException:
        f.close()
        raise
    # large: lazy, the file stays open for the dask arrays (h5py reads under a lock)
    return _finish(X, y, source, x_key, y_key, chunk_rows, max_in_memory)


def train_test_split(X, y, test_fraction: float = 0.2, seed: int = 0):
    """Split ``(X, y)`` into ``X_train, y_train, X_test, y_test`` (a seeded shuffle).

    Works on NumPy and dask arrays alike (dask arrays stay lazy).
    """
    if not 0 <= test_fraction < 1:
        raise IparError(f"test_fraction must be in [0, 1), got {test_fraction!r}.")
    n = X.shape[0]
    order = np.random.default_rng(seed).permutation(n)
    n_test = int(round(test_fraction * n))
    test, train = np.sort(order[:n_test]), np.sort(order[n_test:])
    return X[train], y[train], X[test], y[test]
