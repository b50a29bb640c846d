"""Every collective of :mod:`dask_ipar.nn.collectives` against its adjoint, and its routes.

For a linear map ``A`` and its adjoint ``A^T``, ``<A x, y> = <x, A^T y>`` for all ``x, y``.
Each pair is built as a step graph on a grid bound to fake addresses and run by dask's
synchronous scheduler (no cluster), on every grid up to ``P = 8``, with sizes that do
not divide evenly. The words each collective records (:class:`~dask_ipar.nn.graph.Route`)
are checked against the graph itself: the sizes of the blocks that a task on one cell
reads from another cell, each counted once per receiving cell.
"""

from __future__ import annotations

import dask
import numpy as np
import pytest
from dask._task_spec import DataNode, TaskRef

from dask_ipar.kernels import blocks as B
from dask_ipar.layout.grid import Grid, GridBinding
from dask_ipar.layout.halo import halo_plan
from dask_ipar.layout.partition import grid_shapes, split_bounds
from dask_ipar.nn import collectives as C
from dask_ipar.nn.graph import StepGraph

pytestmark = pytest.mark.fast  # no cluster: graphs, kernels and formulas only

GRIDS = [(pr, pc) for p in range(1, 9) for pr, pc in grid_shapes(p)]


def _binding(pr, pc):
    grid = Grid(pr, pc)
    return GridBinding(grid, tuple(f"tcp://10.0.0.{k}:1" for k in range(grid.size)))


def _run(g):
    """Every key of the graph, computed by dask's synchronous scheduler."""
    keys = list(g.dsk)
    return dict(zip(keys, dask.get(g.dsk, keys, scheduler="sync")))


def _moved_words(g, values):
    """Words the graph moves between cells: every dependency a task reads from a block
    made on another worker, once per (block, receiving worker)."""
    seen, words = set(), 0
    for key, node in g.dsk.items():
        if isinstance(node, DataNode):
            continue
        for dep in node.dependencies:
            if g.place[dep] != g.place[key] and (dep, g.place[key]) not in seen:
                seen.add((dep, g.place[key]))
                words += int(np.asarray(values[dep]).size)
    return words


def _inner(a, b):
    return float(np.vdot(np.asarray(a).ravel(), np.asarray(b).ravel()))


def _close(a, b):
    assert abs(a - b) <= 1e-11 * max(1.0, abs(a), abs(b)), (a, b)


@pytest.mark.parametrize("over", C.OVER)
@pytest.mark.parametrize("pr,pc", GRIDS)
def test_all_gather_and_reduce_scatter_are_adjoint(pr, pc, over):
    rng = np.random.default_rng(pr * 10 + pc)
    binding = _binding(pr, pc)
    groups = C.groups(binding.grid, over)
    n, m = 2 * len(groups[0]) + 3, 2  # uneven: n rows over the group's members
    bounds = split_bounds(n, len(groups[0]))
    pos = {c: k for grp in groups for k, c in enumerate(grp)}

    g = StepGraph(record_routes=True)
    x = {c: rng.standard_normal((bounds[pos[c]][1] - bounds[pos[c]][0], m)) for c in pos}
    y = {c: rng.standard_normal((n, m)) for c in pos}
    xk = {c: g.add_data(("x", *c), binding.worker(*c), x[c]).key for c in pos}
    yk = {c: g.add_data(("y", *c), binding.worker(*c), y[c]).key for c in pos}
    words = lambda c: x[c].size  # noqa: E731
    ax = C.all_gather(g, binding, over, xk, layer="t", phase="gather", words=words,
                      join=B.concat_rows, name="ag", always_join=True)
    pieces = C.reduce_scatter(
        g, binding, over, "rs",
        lambda src, dst: (B.slice_axis, TaskRef(yk[src]), 0, *bounds[pos[dst]]),
        layer="t", phase="scatter", words=lambda src, dst: x[dst].size)
    aty = {}
    for c in pos:
        g.add(("own", *c), binding.worker(*c), B.slice_axis, TaskRef(yk[c]), 0, *bounds[pos[c]])
        g.add(("rsum", *c), binding.worker(*c), B.sum_pieces, TaskRef(("own", *c)), *pieces[c])
        aty[c] = ("rsum", *c)
    out = _run(g)
    for c in pos:
        np.testing.assert_array_equal(out[ax[c]], np.concatenate(
            [x[d] for d in next(grp for grp in groups if c in grp)]))
    _close(sum(_inner(out[ax[c]], y[c]) for c in pos), sum(_inner(x[c], out[aty[c]]) for c in pos))
    routed = g.routed_words()
    # every member's block goes to the other members of its group
    expected = sum(sum(x[s].size for s in grp) * (len(grp) - 1) for grp in groups)
    assert routed.get(("t", "gather"), 0) == expected
    assert routed.get(("t", "scatter"), 0) == expected
    assert routed.get(("t", "gather"), 0) + routed.get(("t", "scatter"), 0) == _moved_words(g, out)


@pytest.mark.parametrize("pr,pc", GRIDS)
def test_all_to_all_is_adjoint_to_its_swap(pr, pc):
    """Samples split over Pr, features whole -> features split over Pr, samples whole; and
    back with the cuts swapped."""
    rng = np.random.default_rng(7 * pr + pc)
    binding = _binding(pr, pc)
    samples = [split_bounds(2 * pr + 1 + j, pr) for j in range(pc)]  # per column
    feats = split_bounds(3 * pr + 2, pr)
    n_feat = feats[-1][1]
    width = lambda b: b[1] - b[0]  # noqa: E731
    g = StepGraph(record_routes=True)
    cells = binding.grid.cells()
    x = {c: rng.standard_normal((width(samples[c[1]][c[0]]), n_feat)) for c in cells}
    y = {c: rng.standard_normal((samples[c[1]][-1][1], width(feats[c[0]]))) for c in cells}
    xk = {c: g.add_data(("x", *c), binding.worker(*c), x[c]).key for c in cells}
    yk = {c: g.add_data(("y", *c), binding.worker(*c), y[c]).key for c in cells}
    ax = C.all_to_all(g, binding, "pr", xk, "t", "fwd", "tok", 1,
                      lambda src, dst: feats[dst[0]], 0, phase="fwd",
                      words=lambda src, dst: x[src].shape[0] * width(feats[dst[0]]))
    aty = C.all_to_all(g, binding, "pr", yk, "t", "bwd", "tok", 0,
                       lambda src, dst: samples[dst[1]][dst[0]], 1, phase="bwd",
                       words=lambda src, dst: width(samples[dst[1]][dst[0]]) * y[src].shape[1])
    out = _run(g)
    for c in cells:
        assert out[ax[c]].shape == y[c].shape and out[aty[c]].shape == x[c].shape
    _close(sum(_inner(out[ax[c]], y[c]) for c in cells),
           sum(_inner(x[c], out[aty[c]]) for c in cells))
    routed = g.routed_words()
    assert routed.get(("t", "fwd"), 0) + routed.get(("t", "bwd"), 0) == _moved_words(g, out)
    if pr > 1:
        assert routed[("t", "fwd")] == routed[("t", "bwd")] > 0


HALO_CASES = [(h, k, s, pad) for h in (7, 13) for k, s in ((1, 1), (3, 1), (5, 1), (3, 2), (2, 2))
              for pad in ((0, 0), (1, 1), (1, 2), (2, 2))]


@pytest.mark.parametrize("pr,pc", GRIDS)
def test_halo_exchange_and_ghost_accumulate_are_adjoint(pr, pc):
    rng = np.random.default_rng(pr + 100 * pc)
    binding = _binding(pr, pc)
    checked = 0
    for h, k, s, pad in HALO_CASES:
        try:
            plan = halo_plan(h, pr, k, s, pad)
        except ValueError:
            continue  # fewer output rows than grid rows: the layer refuses this grid
        owners = split_bounds(h, pr)
        chans, width = 2, 3
        nsamp = [1 + j for j in range(pc)]
        g = StepGraph(record_routes=True)
        x, y, xk, yk = {}, {}, {}, {}
        for need in plan:
            for j in range(pc):
                c = (need.cell, j)
                o0, o1 = owners[need.cell]
                x[c] = rng.standard_normal((nsamp[j], chans, o1 - o0, width))
                r0, r1 = need.rows
                y[c] = rng.standard_normal((nsamp[j], chans, r1 - r0, width))
                xk[c] = g.add_data(("x", *c), binding.worker(*c), x[c]).key
                yk[c] = g.add_data(("y", *c), binding.worker(*c), y[c]).key
        row_words = lambda j: chans * width * nsamp[j]  # noqa: E731
        ax = C.halo_exchange(g, binding, "t", "tok", plan, owners, xk, row_words=row_words)
        aty = C.ghost_accumulate(g, binding, "t", "tok", plan, owners, yk, xk,
                                 row_words=row_words)
        out = _run(g)
        cells = list(x)
        _close(sum(_inner(out[ax[c]], y[c]) for c in cells),
               sum(_inner(x[c], out[aty[c]]) for c in cells))
        routed = g.routed_words()
        assert routed.get(("t", "halo_fwd"), 0) == routed.get(("t", "halo_bwd"), 0)
        # the forward moves the halo rows only; the gradients go back the same way
        assert routed.get(("t", "halo_fwd"), 0) == sum(
            need.halo_rows * row_words(j) for need in plan for j in range(pc))
        assert sum(routed.values()) == _moved_words(g, out)
        checked += 1
    assert checked >= (4 if pr <= 3 else 1)


def test_groups_name_the_grid_axes():
    grid = Grid(2, 3)
    assert C.groups(grid, "pc") == [[(0, 0), (0, 1), (0, 2)], [(1, 0), (1, 1), (1, 2)]]
    assert C.groups(grid, "pr") == [[(0, 0), (1, 0)], [(0, 1), (1, 1)], [(0, 2), (1, 2)]]
    assert C.groups(grid, "all") == [grid.cells()]
    with pytest.raises(ValueError, match="over must be one of"):
        C.groups(grid, "rows")


def test_graphs_record_routes_only_when_asked():
    """A training step's graph skips the bookkeeping; the tests' graphs keep it."""
    binding = _binding(2, 2)
    for record in (False, True):
        g = StepGraph(record_routes=record)
        keys = {c: g.add_data(("x", *c), binding.worker(*c), np.ones(2)).key
                for c in binding.grid.cells()}
        C.all_gather(g, binding, "pc", keys, layer="t", phase="p", words=lambda c: 2,
                     join=B.concat_rows, name="ag")
        assert g.routed_words() == ({("t", "p"): 8} if record else {})
