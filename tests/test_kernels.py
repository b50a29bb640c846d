"""The local kernels are array-API generic: NumPy and ``array_api_strict`` give the same results.

``array_api_strict`` rejects every NumPy-only idiom (methods, implicit flat indexing, mixed
kinds), so a kernel that passes here uses only the standard and runs on CuPy too.
"""

from __future__ import annotations

import numpy as np
import pytest

from dask_ipar import kernels as K

xps = pytest.importorskip("array_api_strict")


def _both(*arrays):
    return arrays, tuple(xps.asarray(a) for a in arrays)


def _host(a):
    """A NumPy view of a NumPy or array_api_strict result."""
    return a if isinstance(a, np.ndarray) else np.from_dlpack(a)


def _same(fn, *arrays, args=()):
    (na, sa) = _both(*arrays)
    out_np = fn(*na, *args)
    out_strict = fn(*sa, *args)
    assert not isinstance(out_strict, np.ndarray), "the strict input must give a strict result"
    np.testing.assert_allclose(_host(out_strict), out_np, rtol=1e-13, atol=1e-15)
    return out_np


rng = np.random.default_rng(0)


@pytest.mark.parametrize("activation", ["linear", "relu", "tanh"])
def test_dense_forward(activation):
    w, x = rng.standard_normal((5, 8)), rng.standard_normal((7, 3))
    out = _same(K.dense_forward, w, x, args=(7, activation))
    z = w[:, :7] @ x + w[:, 7:8]
    ref = {"linear": z, "relu": np.maximum(z, 0), "tanh": np.tanh(z)}[activation]
    np.testing.assert_allclose(out, ref, rtol=1e-14)


def test_concat():
    a, b = rng.standard_normal((2, 3)), rng.standard_normal((4, 3))
    np.testing.assert_array_equal(_same(K.concat_rows, a, b), np.vstack([a, b]))
    c, d = rng.standard_normal((3, 2)), rng.standard_normal((3, 5))
    np.testing.assert_array_equal(_same(K.concat_cols, c, d), np.hstack([c, d]))


def test_softmax_cross_entropy():
    logits = rng.standard_normal((6, 9))
    labels = rng.integers(0, 6, 9)
    (nl, ny), (sl, sy) = _both(logits)[0] + (labels,), _both(logits)[1] + (xps.asarray(labels),)
    p = np.exp(logits - logits.max(0)) / np.exp(logits - logits.max(0)).sum(0)
    onehot = np.eye(6)[:, labels]
    for r0, r1 in [(0, 6), (2, 5)]:
        ref = (p - onehot)[r0:r1] / 20
        for lg, lb in ((nl, ny), (sl, sy)):
            out = K.softmax_xent_grad(lg, lb, r0, r1, 20)
            np.testing.assert_allclose(_host(out), ref, rtol=1e-13)
    ref_loss = -np.log(p[labels, np.arange(9)]).sum()
    ref_correct = (logits.argmax(0) == labels).sum()
    for lg, lb in ((nl, ny), (sl, sy)):
        loss, correct = K.softmax_xent_stats(lg, lb)
        assert loss == pytest.approx(ref_loss, rel=1e-13) and correct == ref_correct


def test_backward_pieces_and_reductions():
    w = rng.standard_normal((5, 8))  # block row: 7 inputs + bias
    dz = rng.standard_normal((5, 4))
    x = rng.standard_normal((7, 4))
    xa = np.vstack([x, np.ones((1, 4))])
    np.testing.assert_allclose(_same(K.dx_piece, w, dz, args=(2, 6)), w[:, 2:6].T @ dz)
    for c0, c1 in [(0, 3), (3, 8), (7, 8)]:
        np.testing.assert_allclose(_same(K.dw_piece, dz, x, args=(c0, c1, 7)),
                                   (dz @ xa.T)[:, c0:c1], rtol=1e-13)
    r1 = rng.standard_normal((5, 3))
    (nd, nx, nr), (sd, sx, sr) = _both(dz, x, r1)
    for args in ((nd, nx, 0, 3, 7, nr), (sd, sx, 0, 3, 7, sr)):
        out = K.dw_reduce(*args)
        got = _host(out)
        np.testing.assert_allclose(got, (dz @ xa.T)[:, 0:3] + r1, rtol=1e-13)


@pytest.mark.parametrize("activation", ["linear", "relu", "tanh"])
def test_dz_from_pieces(activation):
    x_full = np.tanh(rng.standard_normal((9, 4)))  # gathered activations of the column
    w = rng.standard_normal((5, 10))
    dz = rng.standard_normal((5, 4))
    remote = rng.standard_normal((3, 4))
    g = w[:, 4:7].T @ dz + remote
    a = x_full[4:7]
    d = {"linear": 1.0, "relu": (a > 0).astype(float), "tanh": 1 - a * a}[activation]
    for arrs in _both(x_full, w, dz, remote):
        xf, ww, dd, rr = arrs
        out = K.dz_from_pieces(xf, 4, 7, activation, ww, dd, 4, 7, rr)
        got = _host(out)
        np.testing.assert_allclose(got, g * d, rtol=1e-13)


def test_sgd_update():
    wrow = rng.standard_normal((5, 8))
    v = rng.standard_normal((5, 3))
    dz, x = rng.standard_normal((5, 4)), rng.standard_normal((7, 4))
    remote = rng.standard_normal((5, 3))
    xa = np.vstack([x, np.ones((1, 4))])
    g = (dz @ xa.T)[:, 5:8] + remote
    g[:, :2] += 0.01 * wrow[:, 5:7]  # columns 5, 6 are weights; 7 is the bias
    for arrs in _both(wrow, v, dz, x, remote):
        ww, vv, dd, xx, rr = arrs
        vel = K.sgd_velocity(ww, 0.9, 0.01, 2, vv, dd, xx, 5, 8, 7, rr)
        new = K.sgd_weight(ww, 5, 8, vel, 0.1)
        got_v = _host(vel)
        got_w = _host(new)
        np.testing.assert_allclose(got_v, 0.9 * v + g, rtol=1e-13)
        np.testing.assert_allclose(got_w, wrow[:, 5:8] - 0.1 * (0.9 * v + g), rtol=1e-13)
        first = K.sgd_velocity(ww, 0.9, 0.01, 2, None, dd, xx, 5, 8, 7, rr)
        got_f = _host(first)
        np.testing.assert_allclose(got_f, g, rtol=1e-13)
