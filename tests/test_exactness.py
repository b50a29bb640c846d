"""Every grid of P in {1, 2, 3, 4, 6, 8} equals the single-process NumPy reference."""

from __future__ import annotations

import pytest

from dask_ipar.layout.grid import factorizations
from dask_ipar.testing import check_mlp

GRIDS = [g for p in (1, 2, 3, 4, 6, 8) for g in factorizations(p)]
# the programs (the default executor) on every grid; the graph executor (a dask task per
# kernel, slow with many processes on 2 cores) on each P's 2-D grids and the 1-D ones of
# P <= 3
GRAPH = {(1, 1), (1, 2), (2, 1), (1, 3), (3, 1), (2, 2), (2, 3), (3, 2), (2, 4)}
CASES = [(g, "programs") for g in GRIDS] + [
    (g, "graph") for g in GRIDS if (g.pr, g.pc) in GRAPH]


@pytest.mark.parametrize("grid,executor", CASES, ids=lambda v: str(v))
def test_mlp_matches_reference(client, grid, executor):
    # 37-29-13-10, B = 23, float64, 6 SGD steps
    errors = check_mlp(client, grid, steps=6, executor=executor)
    assert errors["finite_difference"] < 1e-6
    assert max(v for k, v in errors.items() if k.startswith(("dW", "db"))) <= 1e-12
    # bytes measured from the transfer logs (dask's, or the programs') equal the cost model,
    # per layer and phase
    rows = errors["comm"].rows
    assert len(rows) == 3 * 4 - 1  # fwd_gather, dw_reduce, w_gather (+ dx_reduce after layer 0)
    assert all(abs(r.ratio - 1) <= 0.02 for r in rows)
    moved = sum(r.measured_bytes for r in rows)
    assert (moved > 0) == (grid.size > 1)


def test_check_detects_a_wrong_gradient(client, monkeypatch):
    """The checker is not vacuous: a kernel off by a tiny factor makes it fail."""
    from dask_ipar.kernels import dense as kernels
    real = kernels.dw_piece

    def skewed(dz, xb, c0, c1, n_in, *x):
        return real(dz, xb, c0, c1, n_in, *x) * (1 + 1e-9)

    # dw_piece runs on the workers by reference: patch it there too.
    monkeypatch.setattr(kernels, "dw_piece", skewed)
    client.run(lambda: setattr(__import__("dask_ipar.kernels.dense").kernels.dense, "dw_piece", skewed))
    try:
        with pytest.raises(AssertionError, match="differs from the reference"):
            check_mlp(client, "1x2", steps=1)
    finally:
        client.run(lambda: setattr(__import__("dask_ipar.kernels.dense").kernels.dense, "dw_piece", real))


@pytest.mark.parametrize("grid,executor", [("2x1", "programs"), ("3x2", "programs"),
                                           ("4x1", "programs"), ("2x2", "graph"),
                                           ("3x1", "graph")], ids=str)
def test_own_rows_first_matches_reference(client, monkeypatch, grid, executor):
    """Forward and dX with the cell's own input rows computed first, apart (what large
    layers on Pr > 1 run, forced here on the small MLP): the reference's values, the
    model's bytes. The graph has the split tasks (a spy counts the decisions)."""
    from dask_ipar.nn import dense, dense_layout

    monkeypatch.setattr(dense_layout, "OWN_FIRST_MACS", 0)
    made = {"fwd": 0, "dx": 0}
    real_fwd, real_dx = dense.own_first, dense.own_dx_first

    def fwd(*a):
        out = real_fwd(*a)
        made["fwd"] += out
        return out

    def dx(*a):
        out = real_dx(*a)
        made["dx"] += out
        return out

    monkeypatch.setattr(dense, "own_first", fwd)
    monkeypatch.setattr(dense, "own_dx_first", dx)
    errors = check_mlp(client, grid, steps=3, executor=executor)
    assert made["fwd"] > 0 and made["dx"] > 0, made
    assert errors["finite_difference"] < 1e-6
    assert max(v for k, v in errors.items() if k.startswith(("dW", "db"))) <= 1e-12
    assert all(abs(r.ratio - 1) <= 0.02 for r in errors["comm"].rows)
