"""Task graphs of a row-parallel output layer: a network's last dense layer contracted
over the input rows each cell holds (:mod:`dask_ipar.cost.rowpar` says when the engine
runs it so, and what it sends; :mod:`dask_ipar.kernels.rowpar` has the kernels).

On cell ``(i, j)``, with ``c0:c1`` the layer's input rows of grid row ``i`` (the rows of
the previous layer's output the cell computed, never gathered):

=========== ==================================================== ===========================
phase       tasks on cell (i, j)                                 collective
=========== ==================================================== ===========================
w_gather    ``cw``: the whole ``W`` from its P blocks            ``all_gather`` over all P
forward     ``act``: the partial ``W(:, c0:c1) X(c0:c1, j)``      local
fwd_gather  ``logits``: the column's partials summed, + bias      ``all_gather`` over Pr
backward    ``dz`` of the previous layer: ``W(:, c0:c1)^T dZ``    local (no dx_reduce)
dw_reduce   ``dwl``: the cell's partial of the whole dW; block    ``reduce_scatter`` over
            ``(i', j')`` of it goes to its owner (``dwp``)        all P
update      the optimizer on the owned block                      local (replicated path)
=========== ==================================================== ===========================

The weights stay in the 1.5D layout (block ``(i, j)``: output rows ``i`` over Pr, weight
columns ``j`` over Pc), updated as replicated blocks are (:func:`dask_ipar.nn.updates.
block_update`: new blocks each step, from the cell's gathered copy), so a step's graph
may take either form of the layer. Every cell of a column sums the partials in grid-row
order, so they hold equal logits and equal ``dZ``.
"""

from __future__ import annotations

from dask._task_spec import TaskRef

from dask_ipar.cost.rowpar import row_parallel_output
from dask_ipar.kernels import blocks as B
from dask_ipar.kernels import dense as K
from dask_ipar.kernels import rowpar as KR
from dask_ipar.nn import collectives as C

__all__ = ["is_row_parallel", "whole_weights", "forward", "logits", "backward"]


def _width(bounds) -> int:
    return bounds[1] - bounds[0]


def is_row_parallel(layouts, grid, batch) -> bool:
    """Whether the last of the dense ``layouts`` runs row-parallel in a step of ``batch``
    samples (None: not known, then not) on ``grid``: after another dense layer, where
    :func:`dask_ipar.cost.rowpar.row_parallel_output` says so."""
    last = layouts[-1]
    return row_parallel_output(last.n_in, last.n_out, last.bias, grid.pr, grid.pc, batch,
                               after_dense=len(layouts) > 1)


def whole_weights(g, engine, lay, w_name, step) -> dict:
    """The whole weight matrix on every cell (``cw``, phase w_gather over all P);
    ``{cell: key}``."""
    grid = engine.grid
    return C.all_gather(g, engine.binding, "all", {c: (w_name, *c) for c in grid.cells()},
                        layer=lay.name, phase="w_gather", join=B.assemble_blocks,
                        lead=(grid.pr, grid.pc), name=engine.name(lay.name, "cw", step),
                        words=lambda c: _width(lay.rows[c[0]]) * _width(lay.wcols[c[1]]))


def forward(g, engine, lay, wf, x_parts, act, after):
    """The partial products ``(act, i, j)``; ``x_parts[cell]``: the cell's own input block
    (a TaskRef); ``after(cell)``: order-only dependencies."""
    for i, j in engine.grid.cells():
        g.add((act, i, j), engine.binding.worker(i, j), KR.partial_forward, *lay.in_rows[i],
              TaskRef(wf[(i, j)]), x_parts[(i, j)], *after((i, j)))


def logits(g, engine, lay, act, wf, cols, step, dests=None) -> dict:
    """The output blocks: each column's partials all-gathered over Pr (phase fwd_gather)
    and summed on its cells (``dests``: only those). Returns ``{cell: [TaskRef]}``, the
    form of a gathered output's pieces."""
    m = lay.n_out
    parts = C.all_gather(g, engine.binding, "pr", {c: (act, *c) for c in engine.grid.cells()},
                         layer=lay.name, phase="fwd_gather", words=lambda c: m * cols[c[1]],
                         dests=dests)
    name = engine.name(lay.name, "logits", step)
    out = {}
    for cell, refs in parts.items():
        g.add((name, *cell), engine.binding.worker(*cell), KR.partial_sum, lay.n_in, lay.bias,
              lay.activation, TaskRef(wf[cell]), *refs)
        out[cell] = [TaskRef((name, *cell))]
    return out


def backward(g, engine, lay, prev, inputs, wf, dz, dz_prev, step):
    """The layer's backward: the previous layer's output gradient ``(dz_prev, i, j)`` on
    every cell (local), and the weight-gradient partials. ``inputs[cell]``: the cell's
    input block (the previous layer's output, a TaskRef). Returns ``(grads, pieces)``:
    ``grads[cell]`` the key of the cell's partial, ``pieces(i, j)`` the remote pieces of
    block ``(i, j)`` (what :func:`dask_ipar.nn.updates.block_update` sums)."""
    grid, bind = engine.grid, engine.binding
    dwl = engine.name(lay.name, "dwl", step)
    grads = {}
    for i, j in grid.cells():
        at = bind.worker(i, j)
        c0, c1 = lay.in_rows[i]
        g.add((dz_prev, i, j), at, KR.dz_rows, inputs[(i, j)], prev.activation, c0, c1,
              TaskRef(wf[(i, j)]), TaskRef((dz, i, j)))
        g.add((dwl, i, j), at, KR.grad_partial, c0, c1, lay.n_cols,
              lay.bias and i == grid.pr - 1, TaskRef((dz, i, j)), inputs[(i, j)])
        grads[(i, j)] = (dwl, i, j)
    pieces = C.reduce_scatter(
        g, bind, "all", engine.name(lay.name, "dwp", step),
        lambda src, dst: (K.grad_block, TaskRef(grads[src]), *lay.rows[dst[0]],
                          *lay.wcols[dst[1]]),
        layer=lay.name, phase="dw_reduce",
        words=lambda src, dst: _width(lay.rows[dst[0]]) * _width(lay.wcols[dst[1]]))
    return grads, (lambda i, j: pieces[(i, j)])
