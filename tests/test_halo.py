"""Halo geometry: every output row block reads exactly the rows a whole-image conv reads."""

from __future__ import annotations

import numpy as np
import pytest

from dask_ipar.kernels import conv as C
from dask_ipar.layout.halo import halo_plan, halo_rows

pytestmark = pytest.mark.fast  # no cluster: graphs, kernels and formulas only


@pytest.mark.parametrize("h,pr,k,s,pad", [
    (13, 1, 3, 1, (1, 1)), (13, 2, 3, 1, (1, 1)), (13, 3, 5, 1, (2, 2)), (27, 4, 11, 4, (0, 0)),
    (10, 4, 5, 2, (2, 1)), (9, 3, 7, 1, (3, 3)),  # blocks of 3 rows, halo of 3: thinner than k
    (8, 8, 3, 1, (1, 1)), (11, 2, 3, 2, (1, 1)), (12, 3, 1, 1, (0, 0)),
])
def test_blocks_computed_from_their_rows_equal_the_whole_conv(h, pr, k, s, pad):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, h, 13))
    w = rng.standard_normal((4, 3, k, k))
    full = C.conv2d_forward(x, w, None, s, (pad[0], pad[1], 1, 1))
    plan = halo_plan(h, pr, k, s, pad)
    blocks = []
    for need in plan:
        # assemble the rows from the owners' pieces, then pad the outer edges only
        rows = np.concatenate([x[:, :, a:b] for _, a, b in need.pieces], axis=2)
        assert rows.shape[2] == need.rows[1] - need.rows[0]
        y = C.conv2d_forward(rows, w, None, s, (need.pad[0], need.pad[1], 1, 1))
        assert y.shape[2] == need.out[1] - need.out[0]
        blocks.append(y)
    np.testing.assert_allclose(np.concatenate(blocks, axis=2), full, rtol=1e-13, atol=1e-13)


def test_stride_one_same_conv_moves_floor_k_over_2_rows_per_neighbour():
    for k in (1, 3, 5, 7):
        for pr in (2, 3, 4):
            # interior boundaries: pr - 1 of them, floor(k/2) rows each way
            assert halo_rows(24, pr, k, 1, (k // 2, k // 2)) == 2 * (pr - 1) * (k // 2)


def test_too_many_grid_rows_is_a_clear_error():
    with pytest.raises(ValueError, match="fewer than Pr = 8"):
        halo_plan(13, 8, 11, 4)


@pytest.mark.parametrize("h,pr,k,s,pad", [
    (13, 2, 3, 1, (1, 1)), (13, 3, 5, 1, (2, 2)), (27, 2, 11, 4, (0, 0)), (10, 4, 5, 2, (2, 1)),
    (9, 3, 7, 1, (3, 3)), (11, 2, 3, 2, (1, 1)), (32, 4, 3, 1, (1, 1)), (20, 2, 4, 3, (3, 0)),
    (16, 2, 5, 1, (6, 6)),  # padding wider than the window: rows over padding only
    (10, 2, 3, 2, (4, 4)),  # ... with stride 2, the rim's first window inside the padding
])
def test_interior_rows_first_then_the_rims_equal_the_whole_conv(h, pr, k, s, pad):
    """Interior first (dask_ipar.nn.conv): the output rows a cell's own rows give, computed
    from its own block alone (reading no halo row), then the rims from the assembled rows,
    equal the whole-image conv's rows of that cell."""
    from dask_ipar.layout.partition import split_bounds
    from dask_ipar.nn.conv import interior_rows

    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 3, h, 9))
    w = rng.standard_normal((4, 3, k, k))
    b = rng.standard_normal(4)
    wmat = np.concatenate([w.reshape(4, -1), b[:, None]], axis=1)
    full = np.tanh(C.conv2d_forward(x, w, b, s, (pad[0], pad[1], 1, 2)))
    owners = split_bounds(h, pr)
    cut_somewhere = False
    for need in halo_plan(h, pr, k, s, pad):
        q0, q1 = owners[need.cell]
        rows = np.concatenate([x[:, :, a:c] for _, a, c in need.pieces], axis=2)
        cut = interior_rows(need, (q0, q1), h, k, s, pad[0])
        want = full[:, :, need.out[0]:need.out[1]]
        if cut is None:
            continue
        cut_somewhere = True
        (a0, a1), (r0, r1), (top, bottom) = cut
        assert need.out[0] <= a0 < a1 <= need.out[1] and (a0, a1) != need.out
        assert 0 <= r0 <= r1 <= q1 - q0  # its own rows only
        own = x[:, :, q0:q1]
        inner = C.conv_rows(own, r0, r1, wmat, w.shape, s, (top, bottom, 1, 2), 1, "tanh")
        np.testing.assert_allclose(inner, full[:, :, a0:a1], rtol=0, atol=1e-12)
        y = C.conv_rim(rows, inner, wmat, w.shape, s, (need.pad[0], need.pad[1], 1, 2), 1,
                       "tanh", a0 - need.out[0], need.out[1] - a1)
        np.testing.assert_allclose(y, want, rtol=0, atol=1e-12)
        with pytest.raises(ValueError, match="output rows"):
            C.conv_rim(rows, inner, wmat, w.shape, s, (need.pad[0], need.pad[1], 1, 2), 1,
                       "tanh", a0 - need.out[0] + 1, need.out[1] - a1)
    assert cut_somewhere or h // pr <= k  # blocks thicker than a window have an interior


@pytest.mark.parametrize("h,pr,k,s,pad", [
    (13, 2, 3, 1, (1, 1)), (13, 3, 5, 1, (2, 2)), (27, 2, 11, 4, (0, 0)), (10, 4, 5, 2, (2, 1)),
    (9, 3, 7, 1, (3, 3)), (11, 2, 3, 2, (1, 1)), (32, 4, 3, 1, (1, 1)), (20, 2, 4, 3, (3, 0)),
    (16, 2, 5, 1, (6, 6)), (10, 2, 3, 2, (4, 4)), (12, 3, 1, 3, (0, 0)), (40, 3, 3, 1, (1, 1)),
])
def test_rim_first_backward_equals_the_whole_backward(h, pr, k, s, pad):
    """Rim first (dask_ipar.nn.conv): a cell's edge output rows' input gradient first
    (conv_dx_edges), the halo pieces cut from it (edge_rows) equal to those rows of the
    cell's whole backward (within rounding: see below), the rest of the backward
    (conv_block_backward_rest) equal to the whole one (the weight gradient bit for bit),
    and the owners' sums of their rows and the pieces sent home equal to the whole-image
    backward's."""
    from dask_ipar.kernels import dense as K
    from dask_ipar.layout.partition import split_bounds
    from dask_ipar.nn.conv import rim_first

    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 3, h, 9))
    w = rng.standard_normal((4, 3, k, k))
    b = rng.standard_normal(4)
    wmat = np.concatenate([w.reshape(4, -1), b[:, None]], axis=1)
    lr = (pad[0], pad[1], 1, 2)
    y = np.tanh(C.conv2d_forward(x, w, b, s, lr))
    dy = rng.standard_normal(y.shape)
    want, _, _ = C.conv2d_backward(x, w, dy * K.activation_grad(y, "tanh"), s, lr)
    owners = split_bounds(h, pr)
    total = np.zeros_like(x)
    split = []
    for need in halo_plan(h, pr, k, s, pad):
        r0 = need.rows[0]
        rows = np.concatenate([x[:, :, a:c] for _, a, c in need.pieces], axis=2) \
            if need.pieces else x[:, :, r0:r0]
        cell_pad = (need.pad[0], need.pad[1], 1, 2)
        a_ = y[:, :, need.out[0]:need.out[1]]
        dy_ = dy[:, :, need.out[0]:need.out[1]]
        args = (wmat, a_, dy_, w.shape, s, cell_pad, 1, "tanh")
        dx, dwm = C.conv_block_backward(rows, *args, True)
        edges = rim_first(need, owners[need.cell], k, s)
        split.append(edges is not None)
        if edges is not None:
            oh = need.out[1] - need.out[0]
            e = C.conv_dx_edges(rows, *args, *edges)
            dx2, dwm2 = C.conv_block_backward_rest(rows, wmat, a_, dy_, e, w.shape, s, cell_pad,
                                                   1, "tanh", *edges)
            np.testing.assert_array_equal(dwm2, dwm)
            np.testing.assert_allclose(dx2, dx, rtol=1e-12, atol=1e-12)
        for owner, a, c in need.pieces:
            piece = dx[:, :, a - r0:c - r0]
            if owner != need.cell and edges is not None:
                side = 0 if owner < need.cell else 1
                base = 0 if side == 0 else (oh - edges[1]) * s
                got = C.edge_rows(e, side, a - r0, c - r0, base, cell_pad)
                # the same contributions in the same order, but NumPy computes a
                # one-column strip's product as a matrix-vector one, which OpenBLAS rounds
                # differently from the whole's matrix product on some CPUs (AMD Zen 5)
                np.testing.assert_allclose(got, piece, rtol=1e-13, atol=1e-13)
            total[:, :, a:c] += piece
    np.testing.assert_allclose(total, want, rtol=1e-12, atol=1e-12)
    halo = any(n.halo_rows for n in halo_plan(h, pr, k, s, pad))
    q = min(c - a for a, c in owners)
    assert any(split) or not halo or q < 2 * k  # strips thicker than two windows split
