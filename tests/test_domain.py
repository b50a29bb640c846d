"""Domain-parallel conv (height over Pr, samples over Pc) equals the whole-image kernels,
and its halo exchanges move exactly the halo rows."""

from __future__ import annotations

import uuid

import numpy as np
import pytest

from dask_ipar.kernels import conv as C
from dask_ipar.nn.conv import conv_backward_graph, conv_forward_graph
from dask_ipar.nn.graph import StepGraph, phase_of_key
from dask_ipar.layout.halo import halo_rows
from dask_ipar.layout.grid import parse_grid
from dask_ipar.runtime.workers import bind_grid
from dask_ipar.layout.partition import split_bounds
from dask_ipar.testing import rel_err


def _drain(dask_worker=None):
    out = [kv for e in dask_worker.transfer_incoming_log for kv in e["keys"].items()]
    dask_worker.transfer_incoming_log.clear()
    return out


@pytest.mark.parametrize("grid,h,k,s,pad", [
    ("1x1", 13, 3, 1, (1, 1, 1, 1)),
    ("2x1", 13, 3, 1, (1, 1, 1, 1)),
    ("3x2", 13, 5, 1, (2, 2, 2, 2)),
    ("4x1", 9, 5, 1, (2, 2, 2, 2)),    # blocks of 2-3 rows, halo of 2
    ("2x2", 15, 5, 2, (2, 1, 2, 2)),   # stride 2, odd height, asymmetric padding
    ("2x1", 27, 11, 4, (0, 0, 0, 0)),  # AlexNet-like conv1
])
@pytest.mark.parametrize("rim", [False, True])
def test_domain_conv_matches_whole_image(client, grid, h, k, s, pad, rim, monkeypatch):
    """Forward and backward of a domain-parallel conv against the whole image's, and the
    halo rows moved; with and without rim first (the halo rows' input gradient first where
    the cell's strip allows, or on no cell)."""
    import dask_ipar.nn.conv as NC

    if not rim:
        monkeypatch.setattr(NC, "rim_first", lambda *a, **kw: None)
    grid = parse_grid(grid)
    binding = bind_grid(grid, client)
    t = f"t{uuid.uuid4().hex[:8]}"  # fresh key names: a key is never reused with new data
    rng = np.random.default_rng(0)
    n, c, o, wd = 5, 3, 4, 13
    x = rng.standard_normal((n, c, h, wd))
    w = rng.standard_normal((o, c, k, k))
    b = rng.standard_normal(o)
    rows, samples = split_bounds(h, grid.pr), split_bounds(n, grid.pc)
    wmat = np.concatenate([w.reshape(o, -1), b[:, None]], axis=1)  # the engine's layout
    data = {}
    x_keys, w_keys = {}, {}
    for i, j in grid.cells():
        (r0, r1), (n0, n1) = rows[i], samples[j]
        x_keys[(i, j)] = (f"{t}.x", i, j)
        w_keys[(i, j)] = (f"{t}.w", i, j)
        data[binding.worker(i, j)] = {x_keys[(i, j)]: x[n0:n1, :, r0:r1], w_keys[(i, j)]: wmat}
    futs = {}
    for worker, blocks in data.items():
        futs.update(client.scatter(blocks, workers=[worker], hash=False))
    g = StepGraph()
    plan, y_keys = conv_forward_graph(g, binding, "conv0", f"{t}-s1", x_keys, w_keys, h, w.shape,
                                      s, pad, activation="tanh")
    z_full = C.conv2d_forward(x, w, b, s, pad)
    y_full = np.tanh(z_full)
    dy = rng.standard_normal(y_full.shape)
    dy_keys = {}
    for need in plan:
        for j in range(grid.pc):
            (n0, n1), (o0, o1) = samples[j], need.out
            dy_keys[(need.cell, j)] = g.add_data((f"{t}.dy", need.cell, j),
                                                 binding.worker(need.cell, j),
                                                 dy[n0:n1, :, o0:o1]).key
    dx_keys, grad_keys = conv_backward_graph(g, binding, "conv0", f"{t}-s1", plan, x_keys,
                                             w_keys, y_keys, dy_keys, h, w.shape, s, pad,
                                             activation="tanh")
    rims = [key for key, task in g.dsk.items() if getattr(task, "func", None) is C.conv_dx_edges]
    assert bool(rims) == (rim and any(NC.rim_first(need, own, k, s) for need, own in
                                      zip(plan, split_bounds(h, grid.pr))))
    keys = list(y_keys.values()) + list(dx_keys.values()) + list(grad_keys.values())
    client.run(_drain)
    out = dict(zip(keys, client.gather(client.get(g.to_hlg(f"{t}-domain"), keys, sync=False))))
    # bytes moved by the halo exchanges: exactly the halo rows, forward and back
    moved = {"halo_fwd": 0, "halo_bwd": 0}
    for entries in client.run(_drain).values():
        for key, nbytes in entries:
            lp = phase_of_key(key)
            if lp is not None and lp[1] in moved:
                moved[lp[1]] += nbytes
    rows = halo_rows(h, grid.pr, k, s, (pad[0], pad[1]))
    assert moved["halo_fwd"] == moved["halo_bwd"] == rows * n * c * wd * 8
    y = np.concatenate([np.concatenate([out[y_keys[(i, j)]] for i in range(grid.pr)], axis=2)
                        for j in range(grid.pc)], axis=0)
    assert rel_err(y, y_full) <= 1e-12
    dz = dy * (1 - y_full ** 2)
    dx_full, dw_full, db_full = C.conv2d_backward(x, w, dz, s, pad)
    dx = np.concatenate([np.concatenate([out[dx_keys[(i, j)]] for i in range(grid.pr)], axis=2)
                         for j in range(grid.pc)], axis=0)
    assert rel_err(dx, dx_full) <= 1e-12  # max error over the largest value
    dwm = sum(out[key][1] for key in grad_keys.values())  # the partials sum to the gradient
    assert rel_err(dwm[:, :-1].reshape(w.shape), dw_full) <= 1e-12
    assert rel_err(dwm[:, -1], db_full) <= 1e-12
    del futs


@pytest.mark.parametrize("mode", ["max", "avg"])
@pytest.mark.parametrize("grid,h,k,s,pad", [
    ("2x1", 13, 3, 2, (0, 0, 0, 0)),   # windows straddle the block boundary
    ("3x2", 27, 3, 2, (1, 1, 1, 1)),
    ("4x1", 11, 2, 2, (0, 0, 0, 0)),
])
def test_domain_pooling_matches_whole_image(client, mode, grid, h, k, s, pad):
    from dask_ipar.nn.conv import pool_backward_graph, pool_forward_graph

    grid = parse_grid(grid)
    binding = bind_grid(grid, client)
    t = f"t{uuid.uuid4().hex[:8]}"
    rng = np.random.default_rng(1)
    n, c, wd = 4, 3, 9
    x = rng.standard_normal((n, c, h, wd))
    rows, samples = split_bounds(h, grid.pr), split_bounds(n, grid.pc)
    g = StepGraph()
    x_keys = {(i, j): g.add_data((f"{t}.x", i, j), binding.worker(i, j),
                                 x[samples[j][0]:samples[j][1], :, rows[i][0]:rows[i][1]]).key
              for i, j in grid.cells()}
    plan, y_keys = pool_forward_graph(g, binding, "pool0", f"{t}-s1", x_keys, h, k, s, pad,
                                      mode)
    y_full = C.pool2d_forward(x, k, s, pad, mode)
    dy = rng.standard_normal(y_full.shape)
    dy_keys = {(nd.cell, j): g.add_data((f"{t}.dy", nd.cell, j), binding.worker(nd.cell, j),
                                        dy[samples[j][0]:samples[j][1], :,
                                           nd.out[0]:nd.out[1]]).key
               for nd in plan for j in range(grid.pc)}
    dx_keys = pool_backward_graph(g, binding, "pool0", f"{t}-s1", plan, x_keys, dy_keys, h, k,
                                  s, pad, mode)
    keys = list(y_keys.values()) + list(dx_keys.values())
    out = dict(zip(keys, client.gather(client.get(g.to_hlg(f"{t}-pool"), keys, sync=False))))

    def assemble(ks):
        return np.concatenate([np.concatenate([out[ks[(i, j)]] for i in range(grid.pr)], axis=2)
                               for j in range(grid.pc)], axis=0)

    assert rel_err(assemble(y_keys), y_full) <= 1e-13
    assert rel_err(assemble(dx_keys), C.pool2d_backward(x, dy, k, s, pad, mode)) <= 1e-13
