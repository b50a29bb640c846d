"""Domain-parallel conv and pooling on a bound grid: height over ``Pr``, samples over ``Pc``.

The first pieces of the integrated CNN (Eqs. 7 and 9 of the paper), as pinned task graphs
with the halo geometry of :mod:`dask_ipar.layout.halo`:

* forward: a halo exchange (:func:`dask_ipar.nn.collectives.halo_exchange`: only the halo
  rows travel, as ``<layer>.xhalo`` pieces; each cell assembles its rows in one local key,
  ``<layer>.xin``, read by forward and backward), then the local kernel, interior first:
  the output rows the cell's own rows give (``<layer>.inner``, :func:`interior_rows`) while
  the halo rows travel, the rims next to the halos when they are in (``<layer>.act``);
* backward: rim first (:func:`rim_first`): the input-gradient contributions of the
  output rows whose windows reach the halo rows (rows a neighbour owns) are computed
  first (``<layer>.dxedge``, :func:`~dask_ipar.kernels.conv.conv_dx_edges`), the halo
  rows' pieces cut from them (``<layer>.dxhalo``) and sent home while the rest of the
  backward runs (``<layer>.bwd``, :func:`~dask_ipar.kernels.conv.conv_block_backward_rest`:
  the weight gradient, the rows between, the edges added); then the ghost-row accumulate
  (:func:`dask_ipar.nn.collectives.ghost_accumulate`: the pieces are added to their
  owner's rows, ``<layer>.dx``; strips too thin for rim first cut them from the whole
  backward's result);
* conv weight gradients: each cell returns its partial ``dW``; :mod:`dask_ipar.nn.front`
  sums them over all P cells with a balanced all-reduce (reduce-scatter onto the owners
  of the weight blocks, update there, all-gather before the next forward).

Keys are ``("<layer>.<task>-<token>", *cell)``, as in :mod:`dask_ipar.nn.graph`, so the
workers' transfer logs attribute bytes to ``halo_fwd``, ``halo_bwd``, ``dw_reduce`` and
``w_gather``. :mod:`dask_ipar.nn.front` strings these layers together for
:class:`~dask_ipar.model.Sequential`.
"""

from __future__ import annotations

from dask._task_spec import TaskRef

from dask_ipar.kernels import conv as CK
from dask_ipar.layout.halo import halo_plan
from dask_ipar.layout.partition import split_bounds
from dask_ipar.nn import collectives as C
from dask_ipar.nn.graph import StepGraph

__all__ = [
    "rim_first",
    "conv_forward_graph",
    "conv_backward_graph",
    "pool_forward_graph",
    "pool_backward_graph",
    "interior_rows",
]


def _name(layer, task, token):
    return f"{layer}.{task}-{token}"


def _plan(h_in, pr, k, stride, pad):
    return halo_plan(h_in, pr, k, stride, (pad[0], pad[1])), split_bounds(h_in, pr)


def _each_cell(g, binding, layer, token, plan, task, func, args_of):
    """One ``task`` per cell of the plan: ``func(*args_of(cell, pad))`` pinned to the cell.

    ``pad`` is the cell's own ``(top, bottom)`` padding (outer image edges only).
    """
    out = {}
    for need in plan:
        for j in range(binding.grid.pc):
            cell = (need.cell, j)
            key = (_name(layer, task, token), *cell)
            g.add(key, binding.worker(*cell), func, *args_of(cell, need.pad))
            out[cell] = key
    return out


# -------------------------------------------------------------------- layers
def conv_forward_graph(g: StepGraph, binding, layer, token, x_keys, w_keys, h_in, wshape,
                       stride, pad, groups=1, activation="linear", row_words=None):
    """Add a conv layer's forward to ``g``; returns ``(plan, output keys per cell)``.

    ``x_keys[(i, j)]``: input rows ``i`` (balanced over Pr) of sample block ``j`` on cell
    (i, j); ``w_keys[(i, j)]``: the whole weight matrix ``(O, C/g*kh*kw [+ bias])`` on
    every cell; ``wshape`` the filters' shape; ``pad`` is ``(top, bottom, left, right)``
    of the whole image; ``row_words(j)`` the words of one input row of column ``j``
    (``C * W * b_j``; the halo exchange's route, not recorded when None).
    """
    plan, owners = _plan(h_in, binding.grid.pr, wshape[2], stride, pad)
    xin = C.halo_exchange(g, binding, layer, token, plan, owners, x_keys, row_words=row_words)
    # interior first: the output rows a cell's own rows give are computed while its halo
    # rows travel (``<layer>.inner``), the rows next to the halos when they are in
    inner = {}
    for need in plan:
        cut = interior_rows(need, owners[need.cell], h_in, wshape[2], stride, pad[0])
        if cut is None:
            continue
        (a0, a1), (r0, r1), (top, bottom) = cut
        for j in range(binding.grid.pc):
            cell = (need.cell, j)
            key = (_name(layer, "inner", token), *cell)
            g.add(key, binding.worker(*cell), CK.conv_rows, TaskRef(x_keys[cell]), r0, r1,
                  TaskRef(w_keys[cell]), wshape, stride, (top, bottom, pad[2], pad[3]),
                  groups, activation)
            inner[cell] = (key, a0 - need.out[0], need.out[1] - a1)

    def args(cell, p):
        lr = (p[0], p[1], pad[2], pad[3])
        if cell not in inner:
            return (TaskRef(xin[cell]), TaskRef(w_keys[cell]), wshape, stride, lr, groups,
                    activation)
        key, n_top, n_bottom = inner[cell]
        return (TaskRef(xin[cell]), TaskRef(key), TaskRef(w_keys[cell]), wshape, stride, lr,
                groups, activation, n_top, n_bottom)

    out = {}
    for need in plan:  # as _each_cell, the kernel per cell
        for j in range(binding.grid.pc):
            cell = (need.cell, j)
            key = (_name(layer, "act", token), *cell)
            g.add(key, binding.worker(*cell), CK.conv_rim if cell in inner else CK.conv_block,
                  *args(cell, need.pad))
            out[cell] = key
    return plan, out


def interior_rows(need, own, h_in, k, stride, pad_top):
    """The output rows of ``need`` (a :class:`~dask_ipar.layout.halo.RowNeed`) whose
    windows read only the cell's ``own`` input rows (and the image's padding):
    ``((a0, a1), (r0, r1), (top, bottom))``, the output rows, the rows of the cell's own
    block they read and the zero rows around those, or None where the cell reads no halo
    row or no output row is interior (nothing to compute before the halos arrive)."""
    if need.halo_rows == 0:
        return None
    q0, q1 = own
    inside = [o for o in range(*need.out)
              if max(o * stride - pad_top, 0) >= q0 and min(o * stride - pad_top + k, h_in) <= q1
              and o * stride - pad_top < h_in and o * stride - pad_top + k > 0]
    if not inside or (inside[0], inside[-1] + 1) == tuple(need.out):
        return None
    a0, a1 = inside[0], inside[-1] + 1
    lo, hi = a0 * stride - pad_top, (a1 - 1) * stride - pad_top + k
    g0, g1 = max(lo, 0), min(hi, h_in)
    return (a0, a1), (g0 - q0, g1 - q0), (g0 - lo, hi - g1)


def conv_backward_graph(g: StepGraph, binding, layer, token, plan, x_keys, w_keys, a_keys,
                        dy_keys, h_in, wshape, stride, pad, groups=1, activation="linear",
                        need_dx=True, row_words=None):
    """Add a conv layer's backward; returns ``(dx keys per cell or None, grad keys per cell)``.

    ``a_keys`` are the forward outputs (:func:`conv_forward_graph`), ``dy_keys`` the
    gradients of the cell's output rows. ``grad[(i, j)]`` holds ``(dx_rows, dW)``: the
    cell's partial weight gradient, to be summed over all cells by the caller. Reads
    the assembled rows that the forward added to the same graph.
    """
    owners = split_bounds(h_in, binding.grid.pr)
    grads, made = {}, set()
    for need in plan:
        edges = rim_first(need, owners[need.cell], wshape[2], stride) if need_dx else None
        lr = (need.pad[0], need.pad[1], pad[2], pad[3])
        r0, oh = need.rows[0], need.out[1] - need.out[0]
        for j in range(binding.grid.pc):
            cell = (need.cell, j)
            at = binding.worker(*cell)
            common = (TaskRef((_name(layer, "xin", token), *cell)), TaskRef(w_keys[cell]),
                      TaskRef(a_keys[cell]), TaskRef(dy_keys[cell]))
            key = (_name(layer, "bwd", token), *cell)
            grads[cell] = key
            if edges is None:
                g.add(key, at, CK.conv_block_backward, *common, wshape, stride, lr, groups,
                      activation, need_dx)
                continue
            # rim first: the edge output rows' input gradient, and from it the halo rows'
            # pieces, which go home while the rest of the backward runs
            n_top, n_bottom = edges
            edge = (_name(layer, "dxedge", token), *cell)
            g.add(edge, at, CK.conv_dx_edges, *common, wshape, stride, lr, groups,
                  activation, n_top, n_bottom)
            for owner, a, b in need.pieces:
                if owner != need.cell:
                    side = 0 if owner < need.cell else 1
                    piece = (_name(layer, "dxhalo", token), need.cell, owner, j)
                    g.add(piece, at, CK.edge_rows, TaskRef(edge), side, a - r0, b - r0,
                          0 if side == 0 else (oh - n_bottom) * stride, lr)
                    made.add(piece)
            g.add(key, at, CK.conv_block_backward_rest, *common, TaskRef(edge), wshape, stride,
                  lr, groups, activation, n_top, n_bottom)
    if not need_dx:
        return None, grads
    return C.ghost_accumulate(g, binding, layer, token, plan, owners, grads, x_keys,
                              row_words=row_words, made=made), grads


def rim_first(need, own, k, stride):
    """Whether a cell goes rim first in the backward, and how: ``(n_top, n_bottom)``, its
    first and last output rows whose windows reach the halo rows it read (rows its
    neighbours own, above and below its ``own`` rows), or None. Rim first where it reads
    halo rows that windows reach and output rows lie between those edges (strips too thin
    for that cut their pieces from the whole backward, as without)."""
    if need.halo_rows == 0:
        return None
    r0, r1 = need.rows
    oh, top = need.out[1] - need.out[0], need.pad[0]
    q0, q1 = max(own[0], r0), min(own[1], r1)
    n_top = n_bottom = 0
    if q0 > r0:
        n_top = max(0, CK.dx_rows_outputs(0, q0 - r0, top, k, stride, oh)[1])
    if r1 > q1:
        o0, o1 = CK.dx_rows_outputs(max(q1, r0) - r0, r1 - r0, top, k, stride, oh)
        n_bottom = oh - o0 if o1 > o0 else 0
    if n_top + n_bottom == 0 or n_top + n_bottom >= oh:
        return None
    return n_top, n_bottom


def pool_forward_graph(g: StepGraph, binding, layer, token, x_keys, h_in, k, stride=None,
                       pad=(0, 0, 0, 0), mode="max", row_words=None):
    """Add a pooling layer's forward (windows straddling blocks use halo rows)."""
    stride = stride or k
    plan, owners = _plan(h_in, binding.grid.pr, k, stride, pad)
    xin = C.halo_exchange(g, binding, layer, token, plan, owners, x_keys, row_words=row_words)
    out = _each_cell(g, binding, layer, token, plan, "act", CK.pool_block, lambda cell, p: (
        TaskRef(xin[cell]), k, stride, (p[0], p[1], pad[2], pad[3]), mode))
    return plan, out


def pool_backward_graph(g: StepGraph, binding, layer, token, plan, x_keys, dy_keys, h_in, k,
                        stride=None, pad=(0, 0, 0, 0), mode="max", row_words=None):
    """Add a pooling layer's backward; returns the input-gradient keys per cell."""
    stride = stride or k
    owners = split_bounds(h_in, binding.grid.pr)
    grads = _each_cell(g, binding, layer, token, plan, "bwd", CK.pool_block_backward,
                       lambda cell, p: (TaskRef((_name(layer, "xin", token), *cell)),
                                        TaskRef(dy_keys[cell]), k, stride,
                                        (p[0], p[1], pad[2], pad[3]), mode))
    return C.ghost_accumulate(g, binding, layer, token, plan, owners, grads, x_keys,
                              row_words=row_words)
