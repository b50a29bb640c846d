"""Data read where it lives (:mod:`dask_ipar.io.lazy`): every grid cell's worker reads its
own block from Zarr, HDF5, a memmap or a dask graph, and training, inference and
gradients equal the NumPy path bit for bit (float64, same batches)."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

zarr = pytest.importorskip("zarr")
da = pytest.importorskip("dask.array")

from dask_ipar import SGD, Dense, Sequential  # noqa: E402
from dask_ipar.errors import IparError  # noqa: E402
from dask_ipar.nn.layers import Conv2d, Flatten, MaxPool2d  # noqa: E402
from dask_ipar.runtime.loop import BatchPlan  # noqa: E402


def _store(path, X, y, xchunks, ychunks, compress=True):
    g = zarr.open_group(str(path), mode="w")
    kw = {} if compress else {"compressors": None}
    g.create_array("X", shape=X.shape, chunks=xchunks, dtype=X.dtype, **kw)[:] = X
    g.create_array("y", shape=y.shape, chunks=ychunks, dtype=y.dtype, **kw)[:] = y
    return da.from_zarr(str(path / "X")), da.from_zarr(str(path / "y"))


def _mlp(client, grid="2x2"):
    return Sequential([Dense(16, "relu"), Dense(5)], input_dim=12, dtype="float64",
                      seed=3).distribute(client, grid)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    rng = np.random.default_rng(0)
    X = rng.normal(size=(384, 12))
    y = rng.integers(0, 5, 384)
    Xz, yz = _store(tmp_path_factory.mktemp("z") / "d.zarr", X, y, (48, 12), (48,))
    return X, y, Xz, yz


def test_mlp_from_zarr_equals_numpy(client, data):
    """fit (shuffle off), evaluate, predict, forward and gradients: Zarr == NumPy; the
    client sends no sample (input client row 0), and the cells' reads are measured."""
    X, y, Xz, yz = data
    out = []
    for Xi, yi in ((X, y), (Xz, yz)):
        m = _mlp(client)
        h = m.fit(Xi, yi, epochs=2, batch_size=48, shuffle=False, optimizer=SGD(0.1))
        pred = m.predict(Xi, batch_size=100)
        logits = m.forward(Xi, batch_size=100)
        out.append((m.get_weights(), [s.loss for s in h.steps], m.evaluate(Xi, yi),
                    pred, logits, m.gradients(Xi, yi), h.comm))
        m.close()
    (w0, l0, e0, p0, f0, g0, c0), (w1, l1, e1, p1, f1, g1, c1) = out
    assert l0 == l1
    for (a, b), (c, d) in zip(w0, w1):
        assert np.array_equal(a, c) and np.array_equal(b, d)
    assert e0 == e1
    assert isinstance(p1, da.Array) and isinstance(f1, da.Array)
    assert p1.chunks[0][0] <= 50  # chunked by samples (batch of 100 over Pc = 2)
    assert np.array_equal(p0, p1.compute()) and np.array_equal(f0, f1.compute())
    assert g0[0] == g1[0] and g0[1] == g1[1]
    for (a, b), (c, d) in zip(g0[2], g1[2]):
        assert np.array_equal(a, c) and np.array_equal(b, d)
    rows0 = {(r.layer, r.phase): r for r in c0.rows + c0.input_rows}
    rows1 = {(r.layer, r.phase): r for r in c1.rows + c1.input_rows}
    # in memory: the client sends the column block to each of Pr cells, and the labels
    assert rows0[("input", "client")].measured_bytes == 48 * 12 * 8 * 2 + 48 * 8 * 2
    assert rows0[("input", "client")].ratio == 1.0
    assert rows1[("input", "client")].measured_bytes == 0
    assert rows1[("input", "client")].predicted_bytes == 0
    st = rows1[("input", "storage")]
    assert st.predicted_bytes == 48 * 12 * 8 * 2 + 48 * 8 * 2
    assert st.measured_bytes > 0 and len(c1.storage_read_bytes) == 4
    for r in c1.rows:  # the layers' traffic is unchanged by where the data comes from
        if r.layer != "input":
            assert r.measured_bytes == rows0[(r.layer, r.phase)].measured_bytes


def test_cnn_strips_read_only_their_rows(client, tmp_path):
    """2x2 domain-parallel CNN from an uncompressed Zarr chunked by strips: each cell
    reads exactly its image rows of its column's samples (no halo rows: those travel
    between the cells, counted as halo_fwd), and trains bit-equal to NumPy."""
    rng = np.random.default_rng(1)
    n, b = 256, 64
    X = rng.normal(size=(n, 1, 8, 8))
    y = rng.integers(0, 5, n)
    Xz, yz = _store(tmp_path / "c.zarr", X, y, (b // 2, 1, 4, 8), (b // 2,), compress=False)
    weights = []
    for Xi, yi in ((X, y), (Xz, yz)):
        m = Sequential([Conv2d(4, 3, activation="relu"), MaxPool2d(2), Flatten(), Dense(5)],
                       input_shape=(1, 8, 8), dtype="float64").distribute(client, "2x2")
        h = m.fit(Xi, yi, epochs=1, batch_size=b, shuffle=False, optimizer=SGD(0.1))
        weights.append(m.get_weights())
        comm = h.comm
        m.close()
    for (a, _), (c, _) in zip(*weights):
        assert np.array_equal(a, c)
    steps = n // b
    strip = (b // 2) * 1 * 4 * 8 * 8  # a column's samples, half the rows, float64
    labels = (b // 2) * 8
    assert sorted(comm.storage_read_bytes.values()) == [steps * (strip + labels)] * 4
    assert {(r.layer, r.phase): r.ratio for r in comm.input_rows}[("input", "storage")] == 1.0


def test_window_shuffle_plan():
    """The windowed plan is a permutation per epoch; each window's samples come from
    ``window`` chunks; window >= chunks is a full shuffle of chunks and samples."""
    p = BatchPlan(1000, 50, seed=4, window=3, chunk=100)
    for e in range(3):
        o = p.order(e)
        assert sorted(o) == list(range(1000))
        for w in range(0, 1000, 300):
            part = o[w:w + 300]
            assert len(np.unique(part // 100)) <= 3
    assert not np.array_equal(p.order(0), p.order(1))
    assert not np.array_equal(p.order(0)[:300] // 100, np.repeat([0, 1, 2], 100))
    with pytest.raises(IparError, match="shuffle window"):
        BatchPlan(10, 2, window=2, chunk=0)


def test_shuffled_zarr_equals_dask_graph_source(client, data, tmp_path):
    """With the local shuffle, Zarr read by the cells through the chunk cache and the same
    data through a dask graph over it (computed inside the cells' tasks, rows picked from
    the graph) train identically: the plan is a pure function of the step."""
    X, y, Xz, yz = data
    Xd, yd = Xz * 1.0, yz + 0  # a graph of its own: DaskSource
    out = []
    for Xi, yi in ((Xz, yz), (Xd, yd)):
        m = _mlp(client, "1x2")
        h = m.fit(Xi, yi, epochs=1, batch_size=32, optimizer=SGD(0.1), shuffle_window=2)
        out.append(([s.loss for s in h.steps], m.get_weights()))
        m.close()
    assert out[0][0] == out[1][0]
    assert np.array_equal(out[0][1][0][0], out[1][1][0][0])
    # image strips through the chunk cache (2x2 domain-parallel CNN, 4-D Zarr)
    rng = np.random.default_rng(3)
    Xi, yi = rng.normal(size=(128, 1, 8, 8)), rng.integers(0, 5, 128)
    Xz, yz = _store(tmp_path / "s.zarr", Xi, yi, (16, 1, 8, 8), (16,))
    losses = []
    for Xa, ya in ((Xz, yz), (Xz * 1.0, yz + 0)):
        m = Sequential([Conv2d(4, 3, activation="relu"), MaxPool2d(2), Flatten(), Dense(5)],
                       input_shape=(1, 8, 8), dtype="float64").distribute(client, "2x2")
        h = m.fit(Xa, ya, epochs=1, batch_size=32, optimizer=SGD(0.1), shuffle_window=3)
        losses.append([s.loss for s in h.steps])
        m.close()
    assert losses[0] == losses[1]


def test_values_checked_per_block(client, tmp_path):
    """NaN in a stored chunk, a label out of range: one clear error naming the stored row
    and its chunk, raised when the block holding it is read."""
    rng = np.random.default_rng(2)
    X = rng.normal(size=(96, 12))
    y = rng.integers(0, 5, 96)
    X[70, 3] = np.nan
    Xz, yz = _store(tmp_path / "bad.zarr", X, y, (16, 12), (16,))
    m = _mlp(client, "1x2")
    with pytest.raises(IparError, match=r"NaN or inf at stored row 70 .*chunk 4: rows 64-79"):
        m.fit(Xz, yz, epochs=1, batch_size=32, shuffle=False)
    y2 = y.copy()
    y2[5] = 7
    X[70, 3] = 0.0
    Xz, yz = _store(tmp_path / "bad2.zarr", X, y2, (16, 12), (16,))
    m.close()  # a step that failed on its data leaves no state to go on from
    m = _mlp(client, "1x2")
    with pytest.raises(IparError, match=r"label 7 at stored row 5 .*outside \[0, 5\)"):
        m.evaluate(Xz, yz)
    with pytest.raises(IparError, match="12 features"):
        Sequential([Dense(5)], input_dim=11).distribute(client, "1x1").fit(Xz, yz)
    m.close()


def test_hdf5_memmap_and_numpy_labels(client, tmp_path):
    """HDF5 datasets and .npy memmaps are read by the cells too, also beside labels held
    in memory (those the client sends); all equal the NumPy path."""
    h5py = pytest.importorskip("h5py")
    rng = np.random.default_rng(5)
    X = rng.normal(size=(128, 12))
    y = rng.integers(0, 5, 128)
    with h5py.File(tmp_path / "d.h5", "w") as f:
        f["X"], f["y"] = X, y
    np.save(tmp_path / "X.npy", X)
    f = h5py.File(tmp_path / "d.h5", "r")
    mm = np.load(tmp_path / "X.npy", mmap_mode="r")
    results = []
    np.save(tmp_path / "y.npy", y)
    ym = np.load(tmp_path / "y.npy", mmap_mode="r")
    for Xi, yi in ((X, y), (da.from_array(f["X"], chunks=(32, 12)), f["y"]), (mm, y),
                   (X, ym)):  # features in memory, stored labels: read by the client
        m = _mlp(client, "2x1")
        h = m.fit(Xi, yi, epochs=1, batch_size=32, shuffle=False, optimizer=SGD(0.1))
        results.append(m.get_weights()[0][0])
        if Xi is mm:
            rows = {(r.layer, r.phase): r.measured_bytes for r in h.comm.input_rows}
            assert rows[("input", "client")] == 32 * 8 * 2  # per step: the labels only
        m.close()
    f.close()
    for r in results[1:]:
        assert np.array_equal(results[0], r)


def _rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_client_memory_stays_flat(client, tmp_path):
    """An epoch over a Zarr data set of 64 MiB grows the client by less than a quarter of
    it (the cells read their own blocks; the client sends none)."""
    n, d = 8192, 1024
    g = zarr.open_group(str(tmp_path / "big.zarr"), mode="w")
    Xa = g.create_array("X", shape=(n, d), chunks=(1024, d), dtype="float64")
    ya = g.create_array("y", shape=(n,), chunks=(1024,), dtype="int64")
    rng = np.random.default_rng(0)
    for k in range(0, n, 1024):  # written in pieces: the test itself holds 8 MiB at most
        Xa[k:k + 1024] = rng.normal(size=(1024, d))
        ya[k:k + 1024] = rng.integers(0, 10, 1024)
    size = n * d * 8
    m = Sequential([Dense(32, "relu"), Dense(10)], input_dim=d, dtype="float64")
    m.distribute(client, "2x2")
    X, y = da.from_zarr(str(tmp_path / "big.zarr" / "X")), da.from_zarr(str(tmp_path / "big.zarr" / "y"))
    m.fit(X[:1024], y[:1024], epochs=1, batch_size=512)  # warm up: imports, first graphs
    base, peak, done = _rss(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.005)

    t = threading.Thread(target=sample)
    t.start()
    try:
        h = m.fit(X, y, epochs=1, batch_size=1024)
    finally:
        done.set()
        t.join()
    m.close()
    assert h.last["steps"] == 8
    grew = peak[0] - base
    print(f"client grew {grew / 2**20:.1f} MiB")
    assert grew < size / 4, f"client grew {grew / 2**20:.1f} MiB over a {size / 2**20:.0f} MiB set"
    rows = {(r.layer, r.phase): r for r in h.comm.input_rows}
    assert rows[("input", "client")].measured_bytes == 0
    assert sum(h.comm.storage_read_bytes.values()) >= 2 * size  # Pr = 2 copies, compressed ~


def test_persisted_dask_array_read_from_its_holders(client, data):
    """A dask array persisted on the cluster: each cell fetches the chunk pieces it needs
    from the workers that hold them (a worker client inside its read task); equal to NumPy."""
    X, y = data[0][:192], data[1][:192]
    Xp = client.persist(da.from_array(X, chunks=(48, 12)))
    yp = client.persist(da.from_array(y, chunks=(48,)))
    out = []
    for Xi, yi in ((X, y), (Xp, yp)):
        m = _mlp(client, "2x1")
        h = m.fit(Xi, yi, epochs=1, batch_size=64, shuffle=False, optimizer=SGD(0.1))
        out.append([s.loss for s in h.steps])
        m.close()
    assert out[0] == out[1]
    # in-memory data inside a graph is persisted once (spread over the workers), not sent
    # to every cell with the graph: the client's input row counts it once
    m = _mlp(client, "2x1")
    h = m.fit(da.from_array(X, chunks=(48, 12)), y, epochs=1, batch_size=64, shuffle=False,
              optimizer=SGD(0.1))
    m.close()
    rows = {r.phase: r.measured_bytes for r in h.comm.input_rows}
    assert rows["client"] == (X.nbytes + 3 * 64 * 8 * 2) / 3  # per step: data once + labels


def test_checkpoint_resume_with_stored_data(client, data, tmp_path):
    """A checkpointed run on Zarr data (local shuffle), stopped after one epoch and resumed,
    ends bit-equal to the uninterrupted run (same grid); resuming with another shuffle
    window is refused (it would draw other batches)."""
    from dask_ipar.io.checkpoint import Checkpointing

    _, _, Xz, yz = data
    m = _mlp(client, "1x2")
    m.fit(Xz, yz, epochs=2, batch_size=64, optimizer=SGD(0.1), shuffle_window=2)
    want = m.get_weights()[0][0]
    m.close()
    m = _mlp(client, "1x2")
    m.fit(Xz, yz, epochs=1, batch_size=64, optimizer=SGD(0.1), shuffle_window=2,
          checkpoint=Checkpointing(str(tmp_path / "ck"), every=5))
    m.close()
    m = _mlp(client, "2x1")
    with pytest.raises(IparError, match="shuffle window"):
        m.fit(Xz, yz, epochs=2, batch_size=64, optimizer=SGD(0.1), shuffle_window=3,
              checkpoint=Checkpointing(str(tmp_path / "ck"), every=5, resume=True))
    m.close()
    m = _mlp(client, "1x2")
    m.fit(Xz, yz, epochs=2, batch_size=64, optimizer=SGD(0.1), shuffle_window=2,
          checkpoint=Checkpointing(str(tmp_path / "ck"), every=5, resume=True))
    assert np.array_equal(m.get_weights()[0][0], want)
    m.close()


def test_standardize_on_the_workers(client, tmp_path):
    """fit(standardize=True) on stored data: the moments come from dask reductions on the
    workers (HDF5 and .npy subsets read through the sources, nothing unpicklable sent),
    equal to the NumPy Standardizer's to rounding."""
    h5py = pytest.importorskip("h5py")
    from dask_ipar.io.lazy import LazyData, LazyInputs
    from dask_ipar.io.scaling import Standardizer
    from dask_ipar.io.sources import H5Source, NpySource

    X = np.random.default_rng(7).random((100, 3)) * 5 + 2
    with h5py.File(tmp_path / "a.h5", "w") as f:
        f["X"] = X
    np.save(tmp_path / "X.npy", X)
    ref = Standardizer.fit(X[::2])
    for src in (H5Source(str(tmp_path / "a.h5"), "X", X.shape, X.dtype, None),
                NpySource(str(tmp_path / "X.npy"), X.shape, X.dtype, 16)):
        got = Standardizer.fit(LazyInputs(LazyData(src, np.arange(0, 100, 2)), "float64"),
                               client=client)
        np.testing.assert_allclose(got.mean, ref.mean, rtol=1e-13)
        np.testing.assert_allclose(got.scale, ref.scale, rtol=1e-13)


def test_split_reads_each_chunk_once_per_epoch(client, tmp_path):
    """A split (a sorted subset of the stored rows) shuffles by the stored chunks: with the
    local shuffle each cell reads every chunk once per epoch, whole (an uncompressed store:
    the bytes are the data set's, test rows inside the chunks included)."""
    from dask_ipar.io.data import load_dataset, train_test_split

    rng = np.random.default_rng(8)
    X, y = rng.normal(size=(384, 12)), rng.integers(0, 5, 384)
    _store(tmp_path / "s.zarr", X, y, (48, 12), (48,), compress=False)
    Xl, yl = load_dataset(tmp_path / "s.zarr", lazy=True)
    Xtr, ytr, _, _ = train_test_split(Xl, yl, 0.25, 0)
    m = _mlp(client, "1x2")
    h = m.fit(Xtr, ytr, epochs=1, batch_size=24, shuffle_window=2, optimizer=SGD(0.1))
    m.close()
    assert sorted(h.comm.storage_read_bytes.values()) == [384 * 12 * 8 + 384 * 8] * 2


def test_derived_graph_over_hdf5(client, tmp_path):
    """A dask graph derived from an h5py dataset (not the dataset itself: read through the
    graph, which distributed serializes by file name) trains like the NumPy data."""
    h5py = pytest.importorskip("h5py")
    rng = np.random.default_rng(9)
    X, y = rng.normal(size=(64, 12)), rng.integers(0, 5, 64)
    with h5py.File(tmp_path / "d.h5", "w") as f:
        f["X"] = X
    f = h5py.File(tmp_path / "d.h5", "r")
    out = []
    for Xi in (X, da.from_array(f["X"], chunks=(32, 12)) * 1.0):
        m = _mlp(client, "1x2")
        h = m.fit(Xi, y, epochs=1, batch_size=32, shuffle=False, optimizer=SGD(0.1))
        out.append([s.loss for s in h.steps])
        m.close()
    f.close()
    assert out[0] == out[1]


def test_cli_evaluate_and_predict_read_stored_data(client, data, tmp_path, capsys):
    """`dask-ipar evaluate` / `predict` on a Zarr store: the workers read it; the figures
    equal the Python API's on the same data in memory."""
    import json

    from dask_ipar.cli.main import main

    X, y, Xz, yz = data
    m = _mlp(client, "1x2")
    m.fit(X, y, epochs=1, batch_size=48, optimizer=SGD(0.1))
    want = m.evaluate(X, y)
    classes = m.predict(X)
    m.save(tmp_path / "m.npz")
    m.close()
    g = zarr.open_group(str(tmp_path / "d.zarr"), mode="w")
    g["X"], g["y"] = X, y
    at = ("--scheduler-address", client.scheduler.address)
    assert main(["evaluate", str(tmp_path / "m.npz"), "--data", str(tmp_path / "d.zarr"),
                 "--grid", "2x1", "--json", *at]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert abs(got["loss"] - want["loss"]) < 1e-12 and got["accuracy"] == want["accuracy"]
    out = tmp_path / "pred.npy"
    assert main(["predict", str(tmp_path / "m.npz"), "--data", str(tmp_path / "d.zarr"),
                 "--output", str(out), *at]) == 0
    assert np.array_equal(np.load(out), classes)
