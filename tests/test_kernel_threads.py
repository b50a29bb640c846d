"""Element-wise passes shared among a worker's threads (:mod:`dask_ipar.kernels.threads`):
the same bits on any number of threads, and every row slice computed once."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dask_ipar.kernels import dense as K
from dask_ipar.kernels.threads import kernel_threads, over_rows


def test_over_rows_covers_each_slice_once_and_raises():
    seen = []
    over_rows(lambda a, b, t: seen.append((a, b, t)), 3, 105, 10, threads=3)
    assert sorted((a, b) for a, b, _ in seen) == [(s, min(s + 10, 105)) for s in range(3, 105, 10)]
    assert {t for *_, t in seen} == {0, 1, 2}  # 11 slices: runs of 4, 4, 3
    one = []
    over_rows(lambda a, b, t: one.append(t), 0, 30, 10, threads=8)  # 3 slices: one thread
    assert one == [0, 0, 0]

    def boom(a, b, t):
        if a == 90:
            raise ValueError("slice 90")

    with pytest.raises(ValueError, match="slice 90"):
        over_rows(boom, 0, 100, 10, threads=2)


def test_kernel_threads_reads_the_blas_threads(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert kernel_threads() == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "100000")
    assert 1 <= kernel_threads() <= 100000 and kernel_threads() < 100000
    monkeypatch.setenv("OMP_NUM_THREADS", "many")
    assert kernel_threads() == 1


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_momentum_sgd_same_bits_on_any_number_of_threads(monkeypatch, dtype):
    rng = np.random.default_rng(0)
    rows, n_in, batch = 1500, 700, 64  # 33 slices of 46 rows (float64)
    w0, v0 = (rng.standard_normal((rows, n_in + 1)).astype(dtype) for _ in range(2))
    dz = rng.standard_normal((rows, batch)).astype(dtype)
    x = rng.standard_normal((n_in, batch)).astype(dtype)
    remote = rng.standard_normal((rows, n_in + 1)).astype(dtype)
    got = []
    for threads in (1, 2, 3):
        monkeypatch.setattr("dask_ipar.kernels.dense.kernel_threads", lambda n=threads: n)
        w, v = w0.copy(), v0.copy()
        K.sgd_update(w, v, 0.1, 0.9, 1e-3, n_in, True, 0, dz, [(0, n_in)], 0, n_in + 1, n_in,
                     x, remote)
        got.append((w, v))
    for w, v in got[1:]:
        assert np.array_equal(w, got[0][0]) and np.array_equal(v, got[0][1])
    # against whole-matrix NumPy: v = 0.9 v + dW + remote + 1e-3 w (not the bias), w -= 0.1 v
    g = dz.astype(np.float64) @ np.concatenate([x, np.ones((1, batch), dtype)]).T + remote
    v = 0.9 * v0 + g
    v[:, :n_in] += 1e-3 * w0[:, :n_in]
    tol = 1e-4 if dtype == np.float32 else 1e-12
    assert np.abs(got[0][1] - v).max() <= tol * np.abs(v).max()
    assert np.abs(got[0][0] - (w0 - 0.1 * v)).max() <= tol * np.abs(w0).max()


@pytest.mark.parametrize("activation", ["relu", "tanh", "linear"])
def test_activations_by_row_slices_same_bits(monkeypatch, activation):
    """Bias and activation, and the derivative's product, a row slice at a time on any
    number of threads: the bits of the whole-array passes."""
    from dask_ipar.kernels import activations as A

    rng = np.random.default_rng(1)
    z0 = rng.standard_normal((1000, 300)).astype(np.float32)  # 219 rows a slice
    bias = rng.standard_normal((1000, 1)).astype(np.float32)
    whole = z0 + bias
    whole = {"relu": np.maximum(whole, 0), "tanh": np.tanh(whole), "linear": whole}[activation]
    g0 = rng.standard_normal((1000, 300)).astype(np.float32)
    grad = g0 * {"relu": (whole > 0).astype(np.float32), "tanh": 1 - whole * whole,
                 "linear": np.float32(1)}[activation]
    for threads in (1, 2, 3):
        monkeypatch.setattr("dask_ipar.kernels.threads.kernel_threads", lambda n=threads: n)
        z = z0.copy()
        assert A.activate_(z, activation, bias) is z and np.array_equal(z, whole)
        g = g0.copy()
        assert np.array_equal(A.times_activation_grad_(g, whole, activation), grad)


@pytest.mark.parametrize("decoupled", [False, True])
def test_adam_by_row_slices_same_bits_as_whole_arrays(monkeypatch, decoupled):
    """Adam's moments and step a row slice at a time, on 1 to 3 threads: the bits of the
    whole-array formulas (written out here as the module had them)."""
    from dask_ipar.kernels import adam as A

    rng = np.random.default_rng(2)
    rows, cols, n_decay = 900, 257, 256
    w0 = rng.standard_normal((rows, cols)).astype(np.float32)
    g0 = rng.standard_normal((rows, cols)).astype(np.float32)
    st0 = np.abs(rng.standard_normal((2, rows, cols))).astype(np.float32)
    hp, lr, t = (0.9, 0.999, 1e-8, 0.01, decoupled), 1e-3, 3
    b1, b2, eps, wd, _ = hp
    g, st, w = g0.copy(), st0.copy(), w0.copy()
    if not decoupled:
        g[:, :n_decay] += wd * w[:, :n_decay]
    st[0] *= b1
    st[0] += (1 - b1) * g
    st[1] *= b2
    st[1] += (1 - b2) * (g * g)
    if decoupled:
        w[:, :n_decay] *= 1 - lr * wd
    w -= (lr / (1 - b1 ** t)) * st[0] / (np.sqrt(st[1]) / math.sqrt(1 - b2 ** t) + eps)
    for threads in (1, 2, 3):
        monkeypatch.setattr("dask_ipar.kernels.threads.kernel_threads", lambda n=threads: n)
        state, wt = A._moments(w0, hp, n_decay, st0.copy(), g0.copy()), w0.copy()
        A._step(wt, state, hp, n_decay, lr, t)
        assert np.array_equal(state, st) and np.array_equal(wt, w)


@pytest.mark.parametrize("cols", ["bias", "weights", "bias-only"])
@pytest.mark.parametrize("decoupled", [False, True])
def test_fused_adam_update_equals_the_whole_gradients(monkeypatch, cols, decoupled):
    """``adam_update`` in place fuses the dW product (chunks of about 16 MiB of rows), the
    bias column, the remote pieces, the moments and the weight step: on 1 to 3 threads
    the same bits, and the values of the unfused update (the whole gradient, then the
    moments, then a new slice), float64 to 1e-12, over two chunks."""
    from dask_ipar.kernels import adam as A

    rng = np.random.default_rng(3)
    n_in, batch = 1024, 48
    c0, c1 = {"bias": (0, n_in + 1), "weights": (0, n_in), "bias-only": (n_in, n_in + 1)}[cols]
    rows = 2100 if cols != "bias-only" else 300  # float64: 2048 rows a 16 MiB chunk
    dtype = np.float64
    w0 = rng.standard_normal((rows, c1 - c0)).astype(dtype)
    st0 = np.abs(rng.standard_normal((2, rows, c1 - c0))).astype(dtype)
    dz = rng.standard_normal((rows, batch)).astype(dtype)
    xb = [(0, 600), (600, n_in)]  # the input in two row pieces
    x = [rng.standard_normal((b - a, batch)).astype(dtype) for a, b in xb]
    remote = [rng.standard_normal((rows, c1 - c0)).astype(dtype) for _ in range(2)]
    hp, lr, t, n_decay = (0.9, 0.999, 1e-8, 0.01, decoupled), 1e-3, 4, min(c1, n_in) - c0
    args = (hp, n_decay, lr, t)
    want_st = st0.copy()
    want_w = A.adam_update(w0.copy(), want_st, *args, False, 0, dz, xb, c0, c1, n_in, *x,
                           *remote)
    got = []
    for threads in (1, 2, 3):
        monkeypatch.setattr("dask_ipar.kernels.dense.kernel_threads", lambda n=threads: n)
        w, st = w0.copy(), st0.copy()
        assert A.adam_update(w, st, *args, True, 0, dz, xb, c0, c1, n_in, *x, *remote) is w
        got.append((w, st))
    for w, st in got[1:]:
        assert np.array_equal(w, got[0][0]) and np.array_equal(st, got[0][1])
    w, st = got[0]
    assert np.abs(st - want_st).max() <= 1e-12 * np.abs(want_st).max()
    assert np.abs(w - want_w).max() <= 1e-12 * np.abs(w0).max()
    assert np.abs(w - w0).max() > 1e-4  # the step moved the weights
