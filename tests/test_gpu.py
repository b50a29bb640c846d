"""CuPy blocks end to end (skipped without CuPy and a CUDA device).

On a GPU machine: ``pytest -m gpu``. Several workers share one GPU, so grids can be
tested on a single device.
"""

from __future__ import annotations

import pytest


def _cupy_with_device():
    cupy = pytest.importorskip("cupy")
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception:  # no driver
        n = 0
    if n < 1:
        pytest.skip("no CUDA device")
    return cupy


@pytest.mark.gpu
@pytest.mark.parametrize("grid", ["1x1", "2x1", "1x2", "2x2"])
def test_cuda_matches_cpu(client, grid):
    _cupy_with_device()
    from dask_ipar import SGD, Dense, Sequential
    from dask_ipar.testing import awkward_problem, rel_err

    X, y = awkward_problem()
    out = {}
    for device in ("cpu", "cuda"):
        for dtype in ("float64", "float32"):
            m = Sequential([Dense(29, "relu"), Dense(13, "tanh"), Dense(10)], input_dim=37,
                           dtype=dtype, seed=0, device=device).distribute(client, grid)
            loss, acc, grads = m.gradients(X, y)
            m.fit(X, y, epochs=5, batch_size=23, optimizer=SGD(lr=0.1))
            out[device, dtype] = (loss, grads, m.get_weights(), m.forward(X))
            m.close()
    for dtype, tol in (("float64", 1e-12), ("float32", 1e-5)):
        c, g = out["cpu", dtype], out["cuda", dtype]
        assert abs(c[0] - g[0]) <= tol * abs(c[0])
        for (cw, cb), (gw, gb) in zip(c[1], g[1]):
            assert rel_err(gw, cw) <= tol and rel_err(gb, cb) <= tol
        for (cw, cb), (gw, gb) in zip(c[2], g[2]):
            assert rel_err(gw, cw) <= 10 * tol
        assert rel_err(g[3], c[3]) <= 10 * tol


@pytest.mark.gpu
@pytest.mark.parametrize("executor", ["programs", "graph"])
@pytest.mark.parametrize("grid", ["1x1", "2x2"])
def test_cuda_exact_against_the_reference(client, grid, executor):
    """float64 CuPy blocks: MLP and CNN (domain strips, halos, pooling, flatten, dense)
    outputs, gradients, SGD steps and bytes moved as on the CPU (the NumPy reference), with
    either executor (programs push CuPy blocks between workers themselves)."""
    _cupy_with_device()
    from dask_ipar.testing import check_cnn, check_mlp

    check_mlp(client, grid, steps=4, device="cuda", executor=executor)
    check_cnn(client, grid, fd_eps=None, device="cuda", executor=executor)


@pytest.mark.gpu
def test_cuda_cnn_layouts_float32(client):
    """A CNN with batch, domain and model conv layers in float32: CuPy vs NumPy within
    1e-5 (relative), after 3 SGD steps too."""
    _cupy_with_device()
    import numpy as np

    from dask_ipar import SGD, Sequential
    from dask_ipar.nn.layers import Conv2d, Dense, Flatten, MaxPool2d
    from dask_ipar.testing import rel_err

    rng = np.random.default_rng(0)
    X, y = rng.standard_normal((8, 2, 16, 12)).astype(np.float32), rng.integers(0, 5, 8)
    out = {}
    for device in ("cpu", "cuda"):
        layers = [Conv2d(4, 3, activation="relu", parallel="batch"),
                  Conv2d(6, 3, activation="relu", parallel="domain"), MaxPool2d(2),
                  Conv2d(8, 3, activation="tanh", parallel="model"), Flatten(),
                  Dense(16, "relu"), Dense(5)]
        m = Sequential(layers, input_shape=(2, 16, 12), dtype="float32", seed=0,
                       device=device).distribute(client, "2x2")
        loss, _, grads = m.gradients(X, y)
        m.fit(X, y, epochs=3, batch_size=8, optimizer=SGD(lr=0.05, momentum=0.9))
        out[device] = (loss, grads, m.get_weights())
        m.close()
    c, g = out["cpu"], out["cuda"]
    assert abs(c[0] - g[0]) <= 1e-5 * abs(c[0])
    for (cw, cb), (gw, gb) in zip(c[1], g[1]):
        assert rel_err(gw, cw) <= 1e-5 and rel_err(gb, cb) <= 1e-5
    for (cw, _), (gw, _) in zip(c[2], g[2]):
        assert rel_err(gw, cw) <= 1e-4


@pytest.mark.gpu
def test_blocks_live_on_the_gpu(client):
    cupy = _cupy_with_device()
    from dask_ipar import Dense, Sequential

    m = Sequential([Dense(9, "relu"), Dense(4)], input_dim=6, device="cuda").distribute(client,
                                                                                       "2x1")
    W = m.weight_arrays()[0]
    assert isinstance(W._meta, cupy.ndarray)
    kinds = client.run(lambda dask_worker=None: sorted({type(v).__module__.split(".")[0]
                                                        for v in dask_worker.data.values()}))
    assert any("cupy" in k for k in kinds.values())
    m.close()


@pytest.mark.gpu
def test_cuda_lineage_cut_keeps_training_identical(client):
    """Re-keying CuPy weight and momentum blocks (a cut every 2 steps) changes nothing."""
    _cupy_with_device()
    import numpy as np

    from dask_ipar import SGD, Dense, Sequential
    from dask_ipar.testing import awkward_problem

    X, y = awkward_problem()
    weights = []
    for every in (2, None):
        m = Sequential([Dense(29, "relu"), Dense(13, "tanh"), Dense(10)], input_dim=37,
                       dtype="float64", seed=0, device="cuda").distribute(client, "2x2")
        m.lineage_steps = every
        m.fit(X, y, epochs=4, batch_size=23, optimizer=SGD(lr=0.1, momentum=0.9),
              shuffle=False)
        names = set(m._w) | {v for v in m._v if v is not None}  # re-keyed at the last cut
        kinds = client.run(lambda dask_worker=None: sorted(
            {type(v).__module__.split(".")[0] for k, v in dask_worker.data.items()
             if isinstance(k, tuple) and k[0] in names}))
        assert sorted(set(sum(kinds.values(), []))) == ["cupy"]
        weights.append(m.get_weights())
        m.close()
    for (wa, ba), (wb, bb) in zip(*weights):
        assert np.array_equal(wa, wb) and np.array_equal(ba, bb)


def test_cuda_without_cupy_is_a_clear_error(monkeypatch):
    import builtins

    from dask_ipar import Dense, IparError, Sequential

    real_import = builtins.__import__

    def fake_import(name, *a, **k):
        if name == "cupy":
            raise ImportError("no cupy")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    with pytest.raises(IparError, match=r"pip install 'dask-ipar\[gpu\]'"):
        Sequential([Dense(4)], input_dim=3, device="cuda")
