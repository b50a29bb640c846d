"""The local kernels are array-API generic: NumPy and ``array_api_strict`` give the same results.

``array_api_strict`` rejects every NumPy-only idiom (methods, implicit flat indexing, mixed
kinds), so a kernel that passes here uses only the standard and runs on CuPy too.
"""

from __future__ import annotations

import numpy as np
import pytest

from dask_ipar.kernels import blocks as B
from dask_ipar.kernels import dense as K
from dask_ipar.kernels import loss as KL

pytestmark = pytest.mark.fast  # no cluster: graphs, kernels and formulas only
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


def _same_parts(fn, lead, arrays, trail=()):
    """``fn(*lead, *arrays, *trail)`` on NumPy and on array_api_strict arrays, compared."""
    (na, sa) = _both(*arrays)
    out_np = fn(*lead, *na, *trail)
    out_strict = fn(*lead, *sa, *trail)
    assert not isinstance(out_strict, np.ndarray), "the strict input must give a strict result"
    np.testing.assert_allclose(_host(out_strict), out_np, rtol=1e-13, atol=1e-15)
    return out_np


#: Column ranges of a block row's slices (7 inputs + bias), row ranges of input pieces.
WB, XB = ((0, 3), (3, 8)), ((0, 2), (2, 7))


def _cols(w):
    return [w[:, a:b] for a, b in WB]


def _rows(x):
    return [x[a:b] for a, b in XB]


def test_span():
    w = rng.standard_normal((5, 8))
    for lo, hi in [(0, 3), (1, 2), (3, 8), (2, 6), (0, 8), (7, 8)]:
        np.testing.assert_array_equal(_same_parts(K.span, (WB, lo, hi, 1), _cols(w)),
                                      w[:, lo:hi])
    x = rng.standard_normal((7, 4))
    for lo, hi in [(0, 2), (1, 5), (2, 7), (0, 7)]:
        np.testing.assert_array_equal(_same_parts(K.span, (XB, lo, hi, 0), _rows(x)), x[lo:hi])
    # inside one part it is a view (no copy)
    assert np.shares_memory(K.span(WB, 4, 6, 1, *_cols(w)), w)


@pytest.mark.parametrize("activation", ["linear", "relu", "tanh"])
def test_dense_forward(activation):
    w, x = rng.standard_normal((5, 8)), rng.standard_normal((7, 3))
    z = w[:, :7] @ x + w[:, 7:8]
    ref = {"linear": z, "relu": np.maximum(z, 0), "tanh": np.tanh(z)}[activation]
    out = _same_parts(K.dense_forward, (WB, XB, 7, activation), _cols(w) + _rows(x))
    np.testing.assert_allclose(out, ref, rtol=1e-14)
    # one slice and one piece (1x1 grids): nothing to join
    out = _same_parts(K.dense_forward, (((0, 8),), ((0, 7),), 7, activation), [w, x])
    np.testing.assert_allclose(out, ref, rtol=1e-14)


@pytest.mark.parametrize("activation", ["linear", "relu"])
def test_dense_forward_sums_products_instead_of_joining_the_weights(activation):
    """A tall block row (pure batch, Pc > 1) is contracted range by range: the products
    over the slices' and pieces' common ranges summed, the same values as the joined
    matmul; a wide batch joins the pieces instead. Shapes alone decide."""
    w, x = rng.standard_normal((40, 8)), rng.standard_normal((7, 1))
    z = w[:, :7] @ x + w[:, 7:8]
    ref = np.maximum(z, 0) if activation == "relu" else z
    assert K.forward_segments(WB, XB, 7, 40, 1) == [(0, 2), (2, 3), (3, 7)]
    out = _same_parts(K.dense_forward, (WB, XB, 7, activation), _cols(w) + _rows(x))
    np.testing.assert_allclose(out, ref, rtol=1e-13)
    # one slice, several small pieces: joining the pieces copies less than summing writes
    out = _same_parts(K.dense_forward, (((0, 8),), XB, 7, activation), [w] + _rows(x))
    np.testing.assert_allclose(out, ref, rtol=1e-13)
    # a batch as wide as the weights: joining copies less than summing writes
    xw = rng.standard_normal((7, 50))
    assert K.forward_segments(WB, XB, 7, 5, 50) is None
    zw = w[:5, :7] @ xw + w[:5, 7:8]
    out = _same_parts(K.dense_forward, (WB, XB, 7, "linear"), _cols(w[:5]) + _rows(xw))
    np.testing.assert_allclose(out, zw, rtol=1e-13)
    # nothing to join or sum on one slice and one piece
    assert K.forward_segments(((0, 8),), ((0, 7),), 7, 40, 1) is None


@pytest.mark.parametrize("activation", ["linear", "relu"])
@pytest.mark.parametrize("mine", [0, 1])
def test_dense_forward_own_rows_first_equals_the_whole(activation, mine):
    """The product over the cell's own input piece (``dense_forward_own``), then the other
    pieces, the bias and the activation (``dense_forward_rest``): the forward's values.
    The order-only block after the pieces is not read."""
    w, x = rng.standard_normal((5, 8)), rng.standard_normal((7, 3))
    z = w[:, :7] @ x + w[:, 7:8]
    ref = np.maximum(z, 0) if activation == "relu" else z
    xs = _rows(x)
    own = _same_parts(K.dense_forward_own, (WB, (XB[mine],), 7), _cols(w) + [xs[mine]])
    np.testing.assert_allclose(own, w[:, XB[mine][0]:XB[mine][1]] @ xs[mine], rtol=1e-13)
    rest = 1 - mine
    out = _same_parts(lambda o, *blocks: K.dense_forward_rest(WB, (XB[rest],), 7, activation,
                                                              o, *blocks, None),
                      (), [own] + _cols(w) + [xs[rest]])
    np.testing.assert_allclose(out, ref, rtol=1e-13)


@pytest.mark.parametrize("activation", ["linear", "relu", "tanh"])
def test_dz_from_own_piece_is_bit_equal_to_the_fused_sum(activation):
    """The local dX piece as a task of its own, then the sum: the same bits as
    ``dz_from_pieces`` (same products, same order), and the own piece is not written."""
    a = np.tanh(rng.standard_normal((3, 4)))
    w, dz = rng.standard_normal((5, 8)), rng.standard_normal((5, 4))
    r1, r2 = rng.standard_normal((3, 4)), rng.standard_normal((3, 4))
    fused = K.dz_from_pieces(a, activation, WB, 2, 5, dz, *_cols(w), r1, r2)
    own = K.dx_piece(WB, 2, 5, dz, *_cols(w))
    kept = own.copy()
    apart = _same_parts(lambda aa, o, *rest: K.dz_from_own(aa, activation, o, *rest), (),
                        [a, own, r1, r2])
    assert np.array_equal(apart, fused)
    assert np.array_equal(own, kept)


def test_dense_kernels_take_misaligned_blocks():
    """Blocks at odd addresses (as in a received message's buffer) give the same values."""
    w = rng.standard_normal((40, 8)).astype(np.float32)
    x = rng.standard_normal((7, 1)).astype(np.float32)
    assert K.forward_segments(WB, XB, 7, 40, 1) is not None

    def odd(a):  # a copy of ``a`` one byte into a buffer: not aligned for float32
        buf = np.empty(a.nbytes + 1, np.uint8)
        out = np.frombuffer(buf.data[1:], dtype=a.dtype).reshape(a.shape)
        out[...] = a
        assert not out.flags.aligned
        return out

    z = K.dense_forward(WB, XB, 7, "linear", *[odd(c) for c in _cols(w)],
                        *[odd(r) for r in _rows(x)])
    np.testing.assert_allclose(z, w[:, :7] @ x + w[:, 7:8], rtol=1e-5)
    dz = rng.standard_normal((40, 3)).astype(np.float32)
    np.testing.assert_allclose(K.dx_piece(WB, 1, 6, dz, *[odd(c) for c in _cols(w)]),
                               w[:, 1:6].T @ dz, rtol=1e-5)


def test_concat():
    a, b = rng.standard_normal((2, 3)), rng.standard_normal((4, 3))
    np.testing.assert_array_equal(_same(B.concat_rows, a, b), np.vstack([a, b]))
    c, d = rng.standard_normal((3, 2)), rng.standard_normal((3, 5))
    np.testing.assert_array_equal(_same(B.concat_cols, c, d), np.hstack([c, d]))


def test_softmax_cross_entropy():
    logits = rng.standard_normal((6, 9))
    labels = rng.integers(0, 6, 9)
    (nl, ny), (sl, sy) = _both(logits)[0] + (labels,), _both(logits)[1] + (xps.asarray(labels),)
    p = np.exp(logits - logits.max(0)) / np.exp(logits - logits.max(0)).sum(0)
    onehot = np.eye(6)[:, labels]
    for r0, r1 in [(0, 6), (2, 5)]:
        ref = (p - onehot)[r0:r1] / 20
        for lg, lb in ((nl, ny), (sl, sy)):
            out = KL.softmax_xent_grad(lb, r0, r1, 20, lg)
            np.testing.assert_allclose(_host(out), ref, rtol=1e-13)
            # the logits as row pieces of the grid column (the gather ends in the task)
            out = KL.softmax_xent_grad(lb, r0, r1, 20, lg[:2, :], lg[2:, :])
            np.testing.assert_allclose(_host(out), ref, rtol=1e-13)
    ref_loss = -np.log(p[labels, np.arange(9)]).sum()
    ref_correct = (logits.argmax(0) == labels).sum()
    for lg, lb in ((nl, ny), (sl, sy)):
        for parts in ((lg,), (lg[:4, :], lg[4:, :])):
            loss, correct = KL.softmax_xent_stats(lb, *parts)
            assert loss == pytest.approx(ref_loss, rel=1e-13) and correct == ref_correct


def test_backward_pieces_and_reductions():
    w = rng.standard_normal((5, 8))  # block row: 7 inputs + bias
    dz = rng.standard_normal((5, 4))
    x = rng.standard_normal((7, 4))
    xa = np.vstack([x, np.ones((1, 4))])
    for c0, c1 in [(2, 6), (0, 2), (3, 7), (0, 8), (1, 4)]:  # within a slice or across
        np.testing.assert_allclose(_same_parts(K.dx_piece, (WB, c0, c1), [dz] + _cols(w)),
                                   w[:, c0:c1].T @ dz, rtol=1e-13)
    for c0, c1 in [(0, 3), (3, 8), (7, 8), (1, 8)]:
        np.testing.assert_allclose(
            _same_parts(lambda d, *xs, c0=c0, c1=c1: K.dw_piece(d, XB, c0, c1, 7, *xs), (),
                        [dz] + _rows(x)),
            (dz @ xa.T)[:, c0:c1], rtol=1e-13)
    r1 = rng.standard_normal((5, 3))
    out = _same_parts(lambda d, *rest: K.dw_reduce(d, XB, 0, 3, 7, *rest), (),
                      [dz] + _rows(x) + [r1])
    np.testing.assert_allclose(out, (dz @ xa.T)[:, 0:3] + r1, rtol=1e-13)


@pytest.mark.parametrize("activation", ["linear", "relu", "tanh"])
def test_dz_from_pieces(activation):
    a = np.tanh(rng.standard_normal((3, 4)))  # this cell's block of the layer's input
    w = rng.standard_normal((5, 8))
    dz = rng.standard_normal((5, 4))
    remote = rng.standard_normal((3, 4))
    g = w[:, 2:5].T @ dz + remote  # rows 2:5 of the input span both weight slices
    d = {"linear": 1.0, "relu": (a > 0).astype(float), "tanh": 1 - a * a}[activation]
    out = _same_parts(lambda aa, dd, *rest: K.dz_from_pieces(aa, activation, WB, 2, 5, dd,
                                                             *rest),
                      (), [a, dz] + _cols(w) + [remote])
    np.testing.assert_allclose(out, g * d, rtol=1e-13)


def test_sgd_update():
    w = rng.standard_normal((5, 3))  # the owned slice: columns 5:8 (5, 6 weights, 7 bias)
    v = rng.standard_normal((5, 3))
    dz, x = rng.standard_normal((5, 4)), rng.standard_normal((7, 4))
    remote = rng.standard_normal((5, 3))
    xa = np.vstack([x, np.ones((1, 4))])
    g = (dz @ xa.T)[:, 5:8] + remote
    g[:, :2] += 0.01 * w[:, :2]
    for arrs in _both(w, v, dz, remote, *_rows(x)):
        ww, vv, dd, rr, *xs = arrs
        vv = vv.copy() if isinstance(vv, np.ndarray) else xps.asarray(v.copy())
        first = K.sgd_velocity(ww, 0.9, 0.01, 2, None, dd, XB, 5, 8, 7, *xs, rr)
        np.testing.assert_allclose(_host(first), g, rtol=1e-13)
        vel = K.sgd_velocity(ww, 0.9, 0.01, 2, vv, dd, XB, 5, 8, 7, *xs, rr)
        new = K.sgd_weight(ww, vel, 0.1)
        np.testing.assert_allclose(_host(vel), 0.9 * v + g, rtol=1e-13)
        np.testing.assert_allclose(_host(new), w - 0.1 * (0.9 * v + g), rtol=1e-13)
        if isinstance(vv, np.ndarray):  # NumPy: the previous velocity's buffer is reused
            assert vel is vv


@pytest.mark.parametrize("cols", [(0, 3), (5, 8), (7, 8)])
def test_sgd_velocity_in_place_in_slices(monkeypatch, cols):
    """Written into v a few rows at a time: the same as the out-of-place form."""
    c0, c1 = cols
    monkeypatch.setattr(K, "_CHUNK_BYTES", 2 * (c1 - c0) * 8 // 8)  # 2 rows per slice
    w, v = rng.standard_normal((7, c1 - c0)), rng.standard_normal((7, c1 - c0))
    dz, x = rng.standard_normal((7, 4)), rng.standard_normal((7, 4))
    remote = rng.standard_normal((7, c1 - c0))
    xa = np.vstack([x, np.ones((1, 4))])
    ref = 0.9 * v + (dz @ xa.T)[:, c0:c1] + remote
    nd = max(0, min(c1, 7) - c0)
    ref[:, :nd] += 0.01 * w[:, :nd]
    out = K.sgd_velocity(w, 0.9, 0.01, nd, v.copy(), dz, XB, c0, c1, 7, *_rows(x), remote)
    np.testing.assert_allclose(out, ref, rtol=1e-13)


def test_axpy_in_place_in_slices(monkeypatch):
    """The chunked scale-and-add equals the one-shot form for any chunk size."""
    y, x = rng.standard_normal((37, 5)), rng.standard_normal((37, 5))
    monkeypatch.setattr(K, "_CHUNK_BYTES", 3 * 5 * 8)  # three rows per slice
    for yy, xx in ((y.copy(), x), (xps.asarray(y.copy()), xps.asarray(x))):
        out = K.axpy_(yy, 0.3, xx)
        assert out is yy
        np.testing.assert_allclose(_host(out), y + 0.3 * x, rtol=1e-15)


@pytest.mark.parametrize("in_place", [False, True])
def test_sgd_update_rewrites_the_momentum_block(in_place):
    """One task: the velocity block is updated in place, the new weights returned (written
    into the old ones with ``in_place``); trailing ordering arguments are ignored."""
    w, v = rng.standard_normal((5, 3)), rng.standard_normal((5, 3))
    dz, x = rng.standard_normal((5, 4)), rng.standard_normal((7, 4))
    remote = rng.standard_normal((5, 3))
    g = (np.vstack([x, np.ones((1, 4))]) @ dz.T).T[:, 5:8] + remote
    g[:, :2] += 0.01 * w[:, :2]
    for vv, ww, dd, rr, xs in (
        (v.copy(), w.copy(), dz, remote, _rows(x)),
        (xps.asarray(v.copy()), xps.asarray(w.copy()), xps.asarray(dz), xps.asarray(remote),
         [xps.asarray(p) for p in _rows(x)]),
    ):
        new_w = K.sgd_update(ww, vv, 0.1, 0.9, 0.01, 2, in_place, 2, dd, XB, 5, 8, 7, *xs, rr,
                             "after-1", "after-2")
        np.testing.assert_allclose(_host(vv), 0.9 * v + g, rtol=1e-13)
        np.testing.assert_allclose(_host(new_w), w - 0.1 * (0.9 * v + g), rtol=1e-13)
        if isinstance(ww, np.ndarray):
            assert (new_w is ww) == in_place
    ro = w.copy()
    ro.flags.writeable = False  # e.g. a block deserialized from a read-only buffer
    out = K.sgd_update(ro, v.copy(), 0.1, 0.9, 0.01, 2, True, 0, dz, XB, 5, 8, 7, *_rows(x),
                       remote)
    assert out is not ro
    np.testing.assert_allclose(out, w - 0.1 * (0.9 * v + g), rtol=1e-13)


def test_dense_forward_cost_prices_the_path_taken():
    """The cost model charges what the kernel does: the added products where it sums them
    (a tall block row in two slices), the joined copies where it joins (a wide batch)."""
    from dask_ipar.kernels.costs import kernel_cost

    def shape(a):
        return a.shape if isinstance(a, np.ndarray) else None

    wb, xb = ((0, 2048), (2048, 4097)), ((0, 4096),)
    w = [np.zeros((4096, 2048), np.float32), np.zeros((4096, 2049), np.float32)]
    passes = 1 + 3 + 2  # written, the bias added, the ReLU
    for b, extra in [(8, 4 * 4096 * 8), (8192, 2 * 4096 * 4097)]:
        x = np.zeros((4096, b), np.float32)
        out, flops, mem, _ = kernel_cost(K.dense_forward, (wb, xb, 4096, "relu", *w, x), shape, 4)
        assert out == (4096, b) and flops == 2.0 * 4096 * 4096 * b
        assert mem == 4 * (passes * 4096 * b + extra)
        assert (K.forward_segments(wb, xb, 4096, 4096, b) is None) == (b == 8192)


def test_backward_costs_price_the_joins_of_several_slices():
    """Where a dX piece spans several gathered column slices of W, or a dW slice several
    row pieces of X, the kernel joins them first (:func:`K.span`: a copy, read and
    written); the cost model charges that copy, and nothing where one slice holds the
    range (a view)."""
    from dask_ipar.kernels.costs import kernel_cost

    def shape(a):
        return a.shape if isinstance(a, np.ndarray) else None

    rows, b = 64, 8
    dz = np.zeros((rows, b), np.float32)
    a = np.zeros((48, b), np.float32)
    w = [np.zeros((rows, 32), np.float32), np.zeros((rows, 32), np.float32)]
    wb = ((0, 32), (32, 64))
    for c0, c1, join in [(0, 32, 0), (8, 56, 2 * rows * 48)]:
        _, flops, mem, _ = kernel_cost(K.dx_piece, (wb, c0, c1, dz, *w), shape, 4)
        assert flops == 2.0 * rows * (c1 - c0) * b
        assert mem == 4 * ((c1 - c0) * b + join)
    _, _, mem, _ = kernel_cost(K.dz_from_pieces, (a, "relu", wb, 8, 56, dz, *w), shape, 4)
    assert mem == 4 * ((1 + 4) * 48 * b + 2 * rows * 48)  # written, ReLU', the join
    x = [np.zeros((32, b), np.float32), np.zeros((32, b), np.float32)]
    xb = ((0, 32), (32, 64))
    for c0, c1, join in [(0, 16, 0), (16, 48, 2 * 32 * b)]:
        _, flops, mem, _ = kernel_cost(K.dw_piece, (dz, xb, c0, c1, 64, *x), shape, 4)
        assert flops == 2.0 * rows * (c1 - c0) * b
        assert mem == 4 * (rows * (c1 - c0) + join)
    # the kernels do join: the joined operand equals the concatenation's range
    got = K.dx_piece(wb, 8, 56, np.ones((rows, b), np.float32),
                     *(np.arange(rows * 32, dtype=np.float32).reshape(rows, 32) + k
                       for k in range(2)))
    assert got.shape == (48, b)
