"""Training data from .npz, .npy pairs, Zarr groups and HDF5 files."""

from __future__ import annotations

import numpy as np
import pytest

from dask_ipar.io.data import load_dataset, train_test_split
from dask_ipar.errors import IparError

pytestmark = pytest.mark.fast  # no cluster: graphs, kernels and formulas only


@pytest.fixture
def arrays():
    rng = np.random.default_rng(0)
    return rng.standard_normal((37, 5)).astype("float32"), rng.integers(0, 4, 37)


def test_npz(tmp_path, arrays):
    X, y = arrays
    np.savez(tmp_path / "d.npz", X=X, y=y)
    Xl, yl = load_dataset(tmp_path / "d.npz")
    assert isinstance(Xl, np.ndarray) and Xl.dtype == np.float32
    np.testing.assert_array_equal(Xl, X)
    np.testing.assert_array_equal(yl, y)
    np.savez(tmp_path / "o.npz", feats=X, labels=y)
    Xl, yl = load_dataset(tmp_path / "o.npz", x_key="feats", y_key="labels")
    np.testing.assert_array_equal(yl, y)
    with pytest.raises(IparError, match=r"no array 'X'.*\['feats', 'labels'\]"):
        load_dataset(tmp_path / "o.npz")


def test_npy_pairs(tmp_path, arrays):
    X, y = arrays
    np.save(tmp_path / "train_X.npy", X)
    np.save(tmp_path / "train_y.npy", y)
    Xl, yl = load_dataset(tmp_path / "train_X.npy")
    np.testing.assert_array_equal(Xl, X)
    np.testing.assert_array_equal(yl, y)
    d = tmp_path / "dir"
    d.mkdir()
    np.save(d / "X.npy", X)
    np.save(d / "y.npy", y[:, None])  # (n, 1) labels are accepted
    Xl, yl = load_dataset(d)
    assert yl.shape == (37,)
    np.save(tmp_path / "feats.npy", X)
    with pytest.raises(IparError, match="y_path"):
        load_dataset(tmp_path / "feats.npy")
    Xl, yl = load_dataset(tmp_path / "feats.npy", y_path=tmp_path / "train_y.npy")
    np.testing.assert_array_equal(yl, y)
    np.save(tmp_path / "bad_X.npy", X)
    np.save(tmp_path / "bad_y.npy", y[:-1])
    with pytest.raises(IparError, match="37 samples .* but 36 labels"):
        load_dataset(tmp_path / "bad_X.npy")


def test_object_arrays_are_refused(tmp_path, arrays):
    X, y = arrays
    np.savez(tmp_path / "obj.npz", X=np.array([object()] * 3), y=y[:3])
    with pytest.raises(IparError, match="holds Python objects, which are not read"):
        load_dataset(tmp_path / "obj.npz")
    (tmp_path / "text.npz").write_text("not numpy at all\n")
    with pytest.raises(IparError, match="not a file of numeric NumPy arrays"):
        load_dataset(tmp_path / "text.npz")
    np.savez(tmp_path / "str.npz", X=X, y=np.array(["a"] * 37))
    with pytest.raises(IparError, match="dtype <U1"):
        load_dataset(tmp_path / "str.npz")


def test_zarr_group_small_and_large(tmp_path, arrays):
    zarr = pytest.importorskip("zarr")
    X, y = arrays
    g = zarr.open_group(tmp_path / "d.zarr", mode="w")
    g.create_array("X", data=X, chunks=(10, 5))
    g.create_array("y", data=y, chunks=(10,))
    Xl, yl = load_dataset(tmp_path / "d.zarr")
    assert isinstance(Xl, np.ndarray)
    np.testing.assert_array_equal(Xl, X)
    # large data sets stay lazy, chunked by whole batches of rows
    Xd, yd = load_dataset(tmp_path / "d.zarr", chunk_rows=8, max_in_memory=100)
    import dask.array as da

    assert isinstance(Xd, da.Array) and Xd.chunks == ((8, 8, 8, 8, 5), (5,))
    assert yd.chunks == ((8, 8, 8, 8, 5),)
    np.testing.assert_array_equal(Xd.compute(), X)
    np.testing.assert_array_equal(yd.compute(), y)
    g2 = zarr.open_group(tmp_path / "e.zarr", mode="w")
    g2.create_array("X", data=X)
    with pytest.raises(IparError, match=r"no array 'y'"):
        load_dataset(tmp_path / "e.zarr")


def test_hdf5(tmp_path, arrays):
    h5py = pytest.importorskip("h5py")
    X, y = arrays
    with h5py.File(tmp_path / "d.h5", "w") as f:
        f["X"] = X
        f["y"] = y
        f["img"] = np.zeros((37, 2, 2, 2, 2))
    Xl, yl = load_dataset(tmp_path / "d.h5")
    np.testing.assert_array_equal(Xl, X)
    np.testing.assert_array_equal(yl, y)
    Xd, yd = load_dataset(tmp_path / "d.h5", chunk_rows=16, max_in_memory=10)
    assert Xd.chunks[0] == (16, 16, 5)
    np.testing.assert_array_equal(Xd.compute(), X)
    with pytest.raises(IparError, match=r"expected \(n_samples, n_features\), or images"):
        load_dataset(tmp_path / "d.h5", x_key="img")
    with pytest.raises(IparError, match="no array 'labels'"):
        load_dataset(tmp_path / "d.h5", y_key="labels")


def test_lazy_load_reads_nothing(tmp_path, arrays):
    """load_dataset(lazy=True): Zarr, HDF5 and .npy come back as LazyData of their files
    (read later by the workers), whatever their size; .npz (a compressed archive) as NumPy;
    a split stays lazy and reads the right rows."""
    h5py = pytest.importorskip("h5py")
    zarr = pytest.importorskip("zarr")
    from dask_ipar.io.data import train_test_split
    from dask_ipar.io.lazy import LazyData

    X, y = arrays
    with h5py.File(tmp_path / "d.h5", "w") as f:
        f["X"], f["y"] = X, y
    np.save(tmp_path / "X.npy", X)
    np.save(tmp_path / "y.npy", y)
    g = zarr.open_group(str(tmp_path / "d.zarr"), mode="w")
    g["X"], g["y"] = X, y
    np.savez(tmp_path / "d.npz", X=X, y=y)
    for path in ("d.h5", "X.npy", "d.zarr", "."):
        Xl, yl = load_dataset(tmp_path / path, lazy=True)
        assert isinstance(Xl, LazyData) and isinstance(yl, LazyData), path
        assert Xl.shape == X.shape and yl.shape == y.shape
        Xa, ya, Xb, yb = train_test_split(Xl, yl, 0.25, 3)
        wa, wya, wb, wyb = train_test_split(X, y, 0.25, 3)
        np.testing.assert_array_equal(Xb.read_all(), wb)
        np.testing.assert_array_equal(ya.read_all(), wya)
    Xn, _ = load_dataset(tmp_path / "d.npz", lazy=True)
    assert isinstance(Xn, np.ndarray)


def test_bad_paths(tmp_path):
    with pytest.raises(IparError, match="does not exist"):
        load_dataset(tmp_path / "missing.npz")
    (tmp_path / "d.csv").write_text("1,2\n")
    with pytest.raises(IparError, match="unknown format"):
        load_dataset(tmp_path / "d.csv")
    with pytest.raises(IparError, match="neither a Zarr group"):
        load_dataset(tmp_path)


def test_train_test_split(arrays):
    X, y = arrays
    Xtr, ytr, Xte, yte = train_test_split(X, y, 0.25, seed=1)
    assert len(Xtr) + len(Xte) == 37 and len(Xte) == 9
    both = np.concatenate([Xtr, Xte])
    assert sorted(map(tuple, both)) == sorted(map(tuple, X))
    with pytest.raises(IparError):
        train_test_split(X, y, 1.0)
