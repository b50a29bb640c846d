"""Local conv and pool kernels against naive NumPy loops, adjoint identities, array_api_strict."""

from __future__ import annotations

import numpy as np
import pytest

from dask_ipar.kernels import conv as C

pytestmark = pytest.mark.fast  # no cluster: graphs, kernels and formulas only
rng = np.random.default_rng(0)


def naive_conv(x, w, b, s, pad, groups):
    xp_ = np.pad(x, ((0, 0), (0, 0), (pad[0], pad[1]), (pad[2], pad[3])))
    n, c, h, wd = x.shape
    o, cg, kh, kw = w.shape
    oh = (h + pad[0] + pad[1] - kh) // s + 1
    ow = (wd + pad[2] + pad[3] - kw) // s + 1
    og = o // groups
    y = np.zeros((n, o, oh, ow))
    for oc in range(o):
        g = oc // og
        for oy in range(oh):
            for ox in range(ow):
                patch = xp_[:, g * cg:(g + 1) * cg, oy * s:oy * s + kh, ox * s:ox * s + kw]
                y[:, oc, oy, ox] = (patch * w[oc]).sum(axis=(1, 2, 3)) + (b[oc] if b is not None else 0)
    return y


CASES = [  # (N, C, H, W, O, k, stride, pad, groups)
    (2, 3, 9, 8, 4, 1, 1, (0, 0, 0, 0), 1),
    (2, 3, 9, 8, 4, 3, 1, (1, 1, 1, 1), 1),
    (1, 4, 11, 10, 6, 3, 2, (1, 0, 1, 1), 2),
    (2, 2, 13, 12, 3, 5, 2, (2, 2, 2, 2), 1),
    (1, 3, 15, 14, 2, 7, 4, (3, 3, 3, 3), 1),
    (1, 3, 27, 27, 4, 11, 4, (0, 0, 0, 0), 1),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"k{c[5]}s{c[6]}g{c[8]}")
def test_conv_forward_and_adjoints(case):
    n, c, h, wd, o, k, s, pad, groups = case
    x = rng.standard_normal((n, c, h, wd))
    w = rng.standard_normal((o, c // groups, k, k))
    b = rng.standard_normal(o)
    y = C.conv2d_forward(x, w, b, s, pad, groups)
    np.testing.assert_allclose(y, naive_conv(x, w, b, s, pad, groups), rtol=1e-12, atol=1e-12)
    dy = rng.standard_normal(y.shape)
    dx, dw, db = C.conv2d_backward(x, w, dy, s, pad, groups)
    assert dx.shape == x.shape and dw.shape == w.shape
    # conv is linear in x and in w: <conv(x), dy> = <x, dx> and <conv_w(x), dy> = <w, dw>
    y0 = C.conv2d_forward(x, w, None, s, pad, groups)
    assert float((y0 * dy).sum()) == pytest.approx(float((x * dx).sum()), rel=1e-11)
    assert float((y0 * dy).sum()) == pytest.approx(float((w * dw).sum()), rel=1e-11)
    np.testing.assert_allclose(db, dy.sum(axis=(0, 2, 3)), rtol=1e-12)


def naive_pool(x, k, s, pad, mode):
    fill = -np.inf if mode == "max" else 0.0
    xp_ = np.pad(x, ((0, 0), (0, 0), (pad[0], pad[1]), (pad[2], pad[3])), constant_values=fill)
    ones = np.pad(np.ones(x.shape[2:]), ((pad[0], pad[1]), (pad[2], pad[3])))
    oh = (x.shape[2] + pad[0] + pad[1] - k) // s + 1
    ow = (x.shape[3] + pad[2] + pad[3] - k) // s + 1
    y = np.zeros(x.shape[:2] + (oh, ow))
    for oy in range(oh):
        for ox in range(ow):
            win = xp_[:, :, oy * s:oy * s + k, ox * s:ox * s + k]
            if mode == "max":
                y[:, :, oy, ox] = win.max(axis=(2, 3))
            else:
                y[:, :, oy, ox] = win.sum(axis=(2, 3)) / ones[oy * s:oy * s + k,
                                                             ox * s:ox * s + k].sum()
    return y


@pytest.mark.parametrize("mode", ["max", "avg"])
@pytest.mark.parametrize("k,s,pad", [(2, 2, (0, 0, 0, 0)), (3, 2, (0, 0, 0, 0)),
                                     (3, 2, (1, 1, 1, 1)), (3, 1, (1, 0, 0, 1))])
def test_pool_forward_and_backward(mode, k, s, pad):
    x = rng.standard_normal((2, 3, 11, 9))
    y = C.pool2d_forward(x, k, s, pad, mode)
    np.testing.assert_allclose(y, naive_pool(x, k, s, pad, mode), rtol=1e-12)
    dy = rng.standard_normal(y.shape)
    dx = C.pool2d_backward(x, dy, k, s, pad, mode)
    v = rng.standard_normal(x.shape)
    eps = 1e-7  # max pooling is linear near x (random data has no ties)
    jv = (C.pool2d_forward(x + eps * v, k, s, pad, mode) - y) / eps
    assert float((jv * dy).sum()) == pytest.approx(float((v * dx).sum()), rel=1e-5)


def test_max_pool_sends_a_tie_to_the_first_maximum_only():
    x = np.zeros((1, 1, 2, 2))
    dx = C.pool2d_backward(x, np.ones((1, 1, 1, 1)), 2, 2)
    np.testing.assert_array_equal(dx[0, 0], [[1, 0], [0, 0]])


def naive_max_pool_backward(x, dy, k, s, pad):
    """Each window's gradient to its first maximum (row-major), window by window."""
    xp_ = np.pad(x, ((0, 0), (0, 0), (pad[0], pad[1]), (pad[2], pad[3])),
                 constant_values=-np.inf)
    dxp = np.zeros(xp_.shape)
    for n in range(x.shape[0]):
        for c in range(x.shape[1]):
            for oy in range(dy.shape[2]):
                for ox in range(dy.shape[3]):
                    win = xp_[n, c, oy * s:oy * s + k, ox * s:ox * s + k]
                    i, j = np.unravel_index(int(np.argmax(win)), win.shape)  # the first
                    dxp[n, c, oy * s + i, ox * s + j] += dy[n, c, oy, ox]
    return dxp[:, :, pad[0]:pad[0] + x.shape[2], pad[2]:pad[2] + x.shape[3]]


@pytest.mark.parametrize("shape,k,pad", [((2, 3, 8, 6), 2, (0, 0, 0, 0)),
                                         ((2, 3, 7, 7), 2, (0, 1, 1, 0)),
                                         ((1, 2, 9, 6), 3, (0, 0, 0, 0)),
                                         ((2, 2, 4, 4), 2, (1, 1, 1, 1))])
@pytest.mark.parametrize("data", ["random", "relu", "ties"])
def test_max_pool_backward_where_windows_tile_the_input(shape, k, pad, data):
    # stride k, windows covering the padded input: the tiled path, ties included (a ReLU's
    # zeros; rounded values), against the window-by-window routing to the first maximum
    x = rng.standard_normal(shape)
    x = {"random": x, "relu": np.maximum(x, 0), "ties": np.round(x)}[data]
    y = C.pool2d_forward(x, k, k, pad, "max")
    dy = rng.standard_normal(y.shape)
    np.testing.assert_array_equal(C.pool2d_backward(x, dy, k, k, pad, "max"),
                                  naive_max_pool_backward(x, dy, k, k, pad))
    np.testing.assert_array_equal(C.pool2d_backward(x, dy, k, k, pad, "max", tiled=False),
                                  naive_max_pool_backward(x, dy, k, k, pad))
    dy[0, 0, 0, 0], dy[-1, -1, -1, -1] = np.inf, np.nan  # only the maxima get them
    want = naive_max_pool_backward(x, np.nan_to_num(dy, nan=7.0, posinf=9.0), k, k, pad)
    got = C.pool2d_backward(x, dy, k, k, pad, "max")
    np.testing.assert_array_equal(np.isinf(got), want == 9.0)
    np.testing.assert_array_equal(np.isnan(got), want == 7.0)
    finite = np.isfinite(got)
    np.testing.assert_array_equal(got[finite], want[finite])


def test_pool_block_backward_cost_follows_the_path():
    from dask_ipar.kernels.conv_costs import CONV_COSTS
    cost = CONV_COSTS["pool_block_backward"]
    # the tiled path (2 x 2 at stride 2 over 64 x 64): its passes, about 38 of the output
    _, fl, tiled = cost((2, 4, 64, 64), (2, 4, 32, 32), 2, None, (0, 0, 0, 0), "max")
    assert tiled == pytest.approx(37.75 * 2 * 4 * 32 * 32)
    # overlapping windows: the general path's strided passes, more per output element
    _, _, general = cost((2, 4, 65, 65), (2, 4, 32, 32), 3, 2, (0, 0, 0, 0), "max")
    assert general / (2 * 4 * 32 * 32) > 60


def test_kernels_run_on_array_api_strict():
    xps = pytest.importorskip("array_api_strict")
    x = rng.standard_normal((2, 4, 9, 7))
    w = rng.standard_normal((6, 2, 3, 3))
    b = rng.standard_normal(6)
    ref = C.conv2d_forward(x, w, b, 2, (1, 1, 0, 1), 2)
    got = C.conv2d_forward(xps.asarray(x), xps.asarray(w), xps.asarray(b), 2, (1, 1, 0, 1), 2)
    np.testing.assert_allclose(np.from_dlpack(got), ref, rtol=1e-13)
    dy = rng.standard_normal(ref.shape)
    for a, r in zip(C.conv2d_backward(xps.asarray(x), xps.asarray(w), xps.asarray(dy), 2,
                                      (1, 1, 0, 1), 2),
                    C.conv2d_backward(x, w, dy, 2, (1, 1, 0, 1), 2)):
        np.testing.assert_allclose(np.from_dlpack(a), r, rtol=1e-12, atol=1e-12)
    xt = rng.standard_normal((2, 3, 8, 6))  # max pooling's tiled path
    dyt = rng.standard_normal((2, 3, 4, 3))
    np.testing.assert_array_equal(
        np.from_dlpack(C.pool2d_backward(xps.asarray(xt), xps.asarray(dyt), 2, 2)),
        C.pool2d_backward(xt, dyt, 2, 2))
    for mode in ("max", "avg"):
        yp = C.pool2d_forward(xps.asarray(x), 3, 2, (1, 1, 1, 1), mode)
        np.testing.assert_allclose(np.from_dlpack(yp), C.pool2d_forward(x, 3, 2, (1, 1, 1, 1),
                                                                        mode), rtol=1e-13)
        dyp = rng.standard_normal(yp.shape)
        dxp = C.pool2d_backward(xps.asarray(x), xps.asarray(dyp), 3, 2, (1, 1, 1, 1), mode)
        np.testing.assert_allclose(np.from_dlpack(dxp),
                                   C.pool2d_backward(x, dyp, 3, 2, (1, 1, 1, 1), mode),
                                   rtol=1e-12)
    # rim first: the edge rows' input gradient first, a halo piece from it, the rest
    wmat = np.concatenate([w.reshape(6, -1), b[:, None]], axis=1)
    a = np.maximum(ref, 0)
    args = (w.shape, 2, (1, 1, 0, 1), 2, "relu")
    want, dwm = C.conv_block_backward(x, wmat, a, dy, *args, True)
    oh = ref.shape[2]
    for n_top, n_bottom in ((1, 1), (2, 0), (0, 1)):
        e = C.conv_dx_edges(xps.asarray(x), xps.asarray(wmat), xps.asarray(a), xps.asarray(dy),
                            *args, n_top, n_bottom)
        dx, dw = C.conv_block_backward_rest(xps.asarray(x), xps.asarray(wmat), xps.asarray(a),
                                            xps.asarray(dy), e, *args, n_top, n_bottom)
        np.testing.assert_allclose(np.from_dlpack(dx), want, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(np.from_dlpack(dw), dwm, rtol=1e-12, atol=1e-12)
        if n_top:  # padded rows 0..2 are read by output row 0 only
            top = C.edge_rows(e, 0, 0, 1, 0, (1, 1, 0, 1))
            np.testing.assert_allclose(np.from_dlpack(top), want[:, :, 0:1], rtol=1e-12)
        if n_bottom:  # the last input row is read by the last output row only
            bottom = C.edge_rows(e, 1, 8, 9, (oh - n_bottom) * 2, (1, 1, 0, 1))
            np.testing.assert_allclose(np.from_dlpack(bottom), want[:, :, 8:9], rtol=1e-12)
