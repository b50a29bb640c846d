"""Training data from files: NumPy ``.npy``/``.npz``, Zarr groups and HDF5.

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

__all__ = ["load_dataset", "train_test_split", "FORMATS"]

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
    if len(X.shape) != 2:
        raise IparError(
            f"{source}: features {x_key!r} have shape {tuple(X.shape)}, expected 2-D "
            "(n_samples, n_features). Reshape images with X.reshape(len(X), -1) before saving."
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
        raise IparError(
            f"{source}: {exc}. Object arrays are refused; save numeric arrays."
        ) from None
    return X, y


def load_dataset(path, *, y_path=None, x_key: str = "X", y_key: str = "y",
                 chunk_rows: int = 4096, max_in_memory: int = 2**30):
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

    Returns
    -------
    X, y : numpy.ndarray or dask.array.Array
        ``(n_samples, n_features)`` features and ``(n_samples,)`` labels, as stored
        (convert and validate with :func:`dask_ipar.data.as_features` / ``as_labels``,
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
            raise IparError(
                f"{source}: {exc}. Object arrays are refused; save numeric arrays."
            ) from None
        return _finish(X, y, *args)
    if low.endswith(".npy"):
        return _finish(*_npy(path, y_path, source), source, os.path.basename(path),
                       "labels", chunk_rows, max_in_memory)
    if low.endswith((".h5", ".hdf5", ".hdf")):
        return _hdf5(path, *args)
    raise IparError(
        f"data path {source} has an unknown format; expected one of {', '.join(FORMATS)}."
    )


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
