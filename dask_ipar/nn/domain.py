"""Domain-parallel conv and pooling on a bound grid: height over ``Pr``, samples over ``Pc``.

The first pieces of the integrated CNN (Eqs. 7 and 9 of the paper), as pinned task graphs
with the halo geometry of :mod:`dask_ipar.layout.halo`:

* forward: each cell sends the rows its neighbours need (``<layer>.xhalo`` pieces, exactly
  the halo rows, never whole blocks), assembles its rows in one local key
  (``<layer>.xin``, read by forward and backward, so no piece is fetched twice) and applies
  the local kernel (``<layer>.act``);
* backward: each cell computes the gradient of the rows it read; rows owned by a neighbour
  go back to their owner as ghost-row pieces (``<layer>.dxhalo``) and are added there
  (``<layer>.dx``);
* conv weight gradients: each cell returns its partial ``dW``; :mod:`dask_ipar.nn.front`
  sums them over all P cells with a balanced all-reduce (reduce-scatter onto the owners
  of the weight blocks, update there, all-gather before the next forward).

Keys are ``("<layer>.<task>-<token>", *cell)``, as in :mod:`dask_ipar.nn.engine`, so the
workers' transfer logs attribute bytes to ``halo_fwd``, ``halo_bwd``, ``dw_reduce`` and
``w_gather``. :mod:`dask_ipar.nn.front` strings these layers together for
:class:`~dask_ipar.model.Sequential`.
"""

from __future__ import annotations

from dask._task_spec import TaskRef

from dask_ipar.kernels import conv as CK
from dask_ipar.kernels import dense as K
from dask_ipar.nn.engine import StepGraph
from dask_ipar.layout.halo import halo_plan
from dask_ipar.kernels.dense import xp_of
from dask_ipar.layout.partition import split_bounds

__all__ = [
    "conv_forward_graph",
    "conv_backward_graph",
    "pool_forward_graph",
    "pool_backward_graph",
]


# ------------------------------------------------------------------- kernels
def take_rows(x, a, b):
    """Rows ``a:b`` (axis 2) of an NCHW block, as a new array."""
    return xp_of(x).asarray(x[:, :, a:b, :], copy=True)


def assemble(*pieces):
    """The input rows a cell reads: its own rows and the halo pieces, in row order."""
    xp = xp_of(pieces[0])
    return xp.concat(list(pieces), axis=2) if len(pieces) > 1 else pieces[0]


def _split_weights(wmat, wshape):
    """Filters ``(O, C/g, kh, kw)`` and bias (or None) from a weight matrix ``(O, n [+ 1])``."""
    xp = xp_of(wmat)
    n = wshape[1] * wshape[2] * wshape[3]
    w = xp.reshape(wmat[:, :n], wshape)
    return w, (wmat[:, n] if wmat.shape[1] > n else None)


def conv_block(x, wmat, wshape, stride, pad, groups, activation):
    """``f(conv(x, W) + b)`` of a cell's assembled rows; weights as one matrix."""
    w, b = _split_weights(wmat, wshape)
    return K._activate(CK.conv2d_forward(x, w, b, stride, pad, groups), activation)


def conv_block_backward(x, wmat, a, dy, wshape, stride, pad, groups, activation, need_dx):
    """``(dx_rows or None, dW matrix)`` of :func:`conv_block` for the output gradient ``dy``.

    ``a`` is the block's forward output (the activation's derivative is taken from it);
    the dW matrix has the weight matrix's layout (bias gradient as the last column).
    """
    w, b = _split_weights(wmat, wshape)
    d = K.activation_grad(a, activation)
    dz = dy if d is None else dy * d
    dx, dw, db = CK.conv2d_backward(x, w, dz, stride, pad, groups, bias=b is not None,
                                    need_dx=need_dx)
    xp = xp_of(dw)
    dwm = xp.reshape(dw, (wshape[0], -1))
    if db is not None:
        dwm = xp.concat([dwm, xp.reshape(db, (-1, 1))], axis=1)
    return dx, dwm


def pool_block(x, k, stride, pad, mode):
    return CK.pool2d_forward(x, k, stride, pad, mode)


def pool_block_backward(x, dy, k, stride, pad, mode):
    return CK.pool2d_backward(x, dy, k, stride, pad, mode)


def rows_slice(grad, a, b):
    """Rows ``a:b`` of a cell's input-row gradient (the first item of a backward result)."""
    g = grad[0] if isinstance(grad, tuple) else grad
    return xp_of(g).asarray(g[:, :, a:b, :], copy=True)


def add_rows(own, *offsets_and_pieces):
    """The owner's input-gradient rows plus ghost rows sent back by neighbours.

    ``offsets_and_pieces`` alternates ``offset, piece``: a piece's rows start at ``offset``
    of the owner's block.
    """
    for k in range(0, len(offsets_and_pieces), 2):
        off, piece = offsets_and_pieces[k], offsets_and_pieces[k + 1]
        own[:, :, off:off + piece.shape[2], :] += piece
    return own


def zeros_like(x):
    return xp_of(x).zeros_like(x)


# -------------------------------------------------------------- halo routing
def _name(layer, task, token):
    return f"{layer}.{task}-{token}"


def _gather_rows(g, binding, layer, token, plan, owners, x_keys):
    """Halo pieces and the local assembled-rows key of every cell; returns the xin keys."""
    xin_keys = {}
    for need in plan:
        i = need.cell
        for j in range(binding.grid.pc):
            parts = []
            for q, a, b in need.pieces:
                if q == i and (a, b) == owners[q]:
                    parts.append(TaskRef(x_keys[(q, j)]))
                    continue
                key = (_name(layer, "xhalo", token), i, q, j)
                g.add(key, binding.worker(q, j), take_rows, TaskRef(x_keys[(q, j)]),
                      a - owners[q][0], b - owners[q][0])
                parts.append(TaskRef(key))
            xin = (_name(layer, "xin", token), i, j)
            g.add(xin, binding.worker(i, j), assemble, *parts)
            xin_keys[(i, j)] = xin
    return xin_keys


def _return_ghosts(g, binding, layer, token, plan, owners, grad_keys, x_keys):
    """Send the gradient of every read row home and add it there; returns the dx keys."""
    dx = {}
    for q, (q0, q1) in enumerate(owners):
        for j in range(binding.grid.pc):
            own, ghosts = None, []
            for need in plan:
                for owner, a, b in need.pieces:
                    if owner != q:
                        continue
                    key = (_name(layer, "dxhalo", token), need.cell, q, j)
                    r0 = need.rows[0]
                    g.add(key, binding.worker(need.cell, j), rows_slice,
                          TaskRef(grad_keys[(need.cell, j)]), a - r0, b - r0)
                    if need.cell == q and (a, b) == (q0, q1):
                        own = key
                    else:
                        ghosts += [a - q0, TaskRef(key)]
            if own is None:  # a cell that reads none or part of its own rows (strides)
                own = (_name(layer, "dxzero", token), q, j)
                g.add(own, binding.worker(q, j), zeros_like, TaskRef(x_keys[(q, j)]))
            key = (_name(layer, "dx", token), q, j)
            g.add(key, binding.worker(q, j), add_rows, TaskRef(own), *ghosts)
            dx[(q, j)] = key
    return dx


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
                       stride, pad, groups=1, activation="linear"):
    """Add a conv layer's forward to ``g``; returns ``(plan, output keys per cell)``.

    ``x_keys[(i, j)]``: input rows ``i`` (balanced over Pr) of sample block ``j`` on cell
    (i, j); ``w_keys[(i, j)]``: the whole weight matrix ``(O, C/g*kh*kw [+ bias])`` on
    every cell; ``wshape`` the filters' shape; ``pad`` is ``(top, bottom, left, right)``
    of the whole image.
    """
    plan, owners = _plan(h_in, binding.grid.pr, wshape[2], stride, pad)
    xin = _gather_rows(g, binding, layer, token, plan, owners, x_keys)
    out = _each_cell(g, binding, layer, token, plan, "act", conv_block, lambda cell, p: (
        TaskRef(xin[cell]), TaskRef(w_keys[cell]), wshape, stride,
        (p[0], p[1], pad[2], pad[3]), groups, activation))
    return plan, out


def conv_backward_graph(g: StepGraph, binding, layer, token, plan, x_keys, w_keys, a_keys,
                        dy_keys, h_in, wshape, stride, pad, groups=1, activation="linear",
                        need_dx=True):
    """Add a conv layer's backward; returns ``(dx keys per cell or None, grad keys per cell)``.

    ``a_keys`` are the forward outputs (:func:`conv_forward_graph`), ``dy_keys`` the
    gradients of the cell's output rows. ``grad[(i, j)]`` holds ``(dx_rows, dW)``: the
    cell's partial weight gradient, to be summed over all cells by the caller. Reads
    the assembled rows that the forward added to the same graph.
    """
    owners = split_bounds(h_in, binding.grid.pr)
    grads = _each_cell(g, binding, layer, token, plan, "bwd", conv_block_backward,
                       lambda cell, p: (TaskRef((_name(layer, "xin", token), *cell)),
                                        TaskRef(w_keys[cell]), TaskRef(a_keys[cell]),
                                        TaskRef(dy_keys[cell]), wshape, stride,
                                        (p[0], p[1], pad[2], pad[3]), groups, activation,
                                        need_dx))
    if not need_dx:
        return None, grads
    return _return_ghosts(g, binding, layer, token, plan, owners, grads, x_keys), grads


def pool_forward_graph(g: StepGraph, binding, layer, token, x_keys, h_in, k, stride=None,
                       pad=(0, 0, 0, 0), mode="max"):
    """Add a pooling layer's forward (windows straddling blocks use halo rows)."""
    stride = stride or k
    plan, owners = _plan(h_in, binding.grid.pr, k, stride, pad)
    xin = _gather_rows(g, binding, layer, token, plan, owners, x_keys)
    out = _each_cell(g, binding, layer, token, plan, "act", pool_block, lambda cell, p: (
        TaskRef(xin[cell]), k, stride, (p[0], p[1], pad[2], pad[3]), mode))
    return plan, out


def pool_backward_graph(g: StepGraph, binding, layer, token, plan, x_keys, dy_keys, h_in, k,
                        stride=None, pad=(0, 0, 0, 0), mode="max"):
    """Add a pooling layer's backward; returns the input-gradient keys per cell."""
    stride = stride or k
    owners = split_bounds(h_in, binding.grid.pr)
    grads = _each_cell(g, binding, layer, token, plan, "bwd", pool_block_backward,
                       lambda cell, p: (TaskRef((_name(layer, "xin", token), *cell)),
                                        TaskRef(dy_keys[cell]), k, stride,
                                        (p[0], p[1], pad[2], pad[3]), mode))
    return _return_ghosts(g, binding, layer, token, plan, owners, grads, x_keys)
