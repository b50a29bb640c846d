"""Domain-parallel convolution on a bound grid: height over ``Pr``, samples over ``Pc``.

The first piece of the integrated CNN (Eq. 7 and 9 of the paper): one conv layer's forward
and backward as pinned task graphs, with the halo exchange of :mod:`dask_ipar.halo`:

* forward: each cell sends the rows its neighbours need (``conv.xhalo`` pieces, exactly the
  halo rows, never whole blocks), then computes its output rows from its own rows plus the
  pieces (``conv.act``);
* backward: each cell computes the gradient of the input rows it read; rows owned by a
  neighbour go back to their owner as ghost-row pieces (``conv.dxhalo``) and are added there
  (``conv.dx``); the weight gradient partials are summed (``conv.dw``).

Not yet integrated into :class:`~dask_ipar.model.Sequential`; the weight-gradient sum is a
plain reduction onto cell (0, 0), not yet the balanced all-reduce of the dense layers.
"""

from __future__ import annotations

from dask._task_spec import TaskRef

from dask_ipar import conv_kernels as CK
from dask_ipar.engine import StepGraph
from dask_ipar.halo import halo_plan
from dask_ipar.kernels import xp_of

__all__ = ["conv_forward_graph", "conv_backward_graph"]


def take_rows(x, a, b):
    """Rows ``a:b`` (axis 2) of an NCHW block, as a new array."""
    xp = xp_of(x)
    return xp.asarray(x[:, :, a:b, :], copy=True)


def assemble(*pieces):
    """The input rows a cell reads: its own rows and the halo pieces, in row order."""
    xp = xp_of(pieces[0])
    return xp.concat(list(pieces), axis=2) if len(pieces) > 1 else pieces[0]


def conv_block(x, w, b, stride, pad, groups):
    return CK.conv2d_forward(x, w, b, stride, pad, groups)


def conv_block_backward(x, w, dy, stride, pad, groups):
    """``(dx_rows, dw, db)`` of the conv of a cell's assembled rows."""
    return CK.conv2d_backward(x, w, dy, stride, pad, groups)


def item(t, k):
    return t[k]


def add_rows(own, *ghosts_with_offsets):
    """The owner's input-gradient rows plus ghost rows sent back by neighbours.

    ``ghosts_with_offsets`` alternates ``offset, piece``: piece rows start at ``offset``
    of the owner's block.
    """
    out = own
    for k in range(0, len(ghosts_with_offsets), 2):
        off, piece = ghosts_with_offsets[k], ghosts_with_offsets[k + 1]
        out[:, :, off:off + piece.shape[2], :] += piece
    return out


def sum_all(*parts):
    out = parts[0]
    for p in parts[1:]:
        out = out + p
    return out


def _owner_bounds(plan_rows, pr):
    from dask_ipar.partition import split_bounds

    return split_bounds(plan_rows, pr)


def conv_forward_graph(g: StepGraph, binding, name, token, x_keys, w_keys, b_keys, h_in, k, stride,
                       pad, groups=1):
    """Add a conv layer's forward to ``g``; returns the plan and the output keys per cell.

    Keys are ``("<name>.<task>-<token>", *cell)`` like the dense engine's, so transfers
    are attributed to the layer (``halo_fwd``, ``halo_bwd``).
    ``x_keys[(i, j)]``: input rows ``owners[i]`` of sample block ``j`` on cell (i, j);
    ``w_keys``/``b_keys[(i, j)]``: the weights and bias on every cell. ``pad`` is
    ``(top, bottom, left, right)`` of the whole image.
    """
    pr, pc = binding.grid.pr, binding.grid.pc
    plan = halo_plan(h_in, pr, k, stride, (pad[0], pad[1]))
    owners = _owner_bounds(h_in, pr)
    out = {}
    for need in plan:
        i = need.cell
        for j in range(pc):
            parts = []
            for q, a, b in need.pieces:
                q0 = owners[q][0]
                if q == i and (a, b) == owners[q]:
                    parts.append(TaskRef(x_keys[(q, j)]))
                    continue
                key = (f"{name}.xhalo-{token}", i, q, j)
                g.add(key, binding.worker(q, j), take_rows, TaskRef(x_keys[(q, j)]),
                      a - q0, b - q0)
                parts.append(TaskRef(key))
            # the assembled rows are a local key that forward and backward both read, so a
            # halo piece is fetched once even if dask drops its replica afterwards
            xin = (f"{name}.xin-{token}", i, j)
            g.add(xin, binding.worker(i, j), assemble, *parts)
            key = (f"{name}.act-{token}", i, j)
            g.add(key, binding.worker(i, j), conv_block, TaskRef(xin), TaskRef(w_keys[(i, j)]),
                  TaskRef(b_keys[(i, j)]), stride, (need.pad[0], need.pad[1], pad[2], pad[3]),
                  groups)
            out[(i, j)] = key
    return plan, out


def conv_backward_graph(g: StepGraph, binding, name, token, plan, x_keys, w_keys, dy_keys, h_in,
                        stride, pad, groups=1):
    """Add a conv layer's backward; returns ``(dx_keys per cell, dw_key, db_key)``.

    Reads the assembled input rows that :func:`conv_forward_graph` added to the same graph.
    """
    pr, pc = binding.grid.pr, binding.grid.pc
    owners = _owner_bounds(h_in, pr)
    grads = {}
    for need in plan:
        i = need.cell
        for j in range(pc):
            key = (f"{name}.bwd-{token}", i, j)
            g.add(key, binding.worker(i, j), conv_block_backward,
                  TaskRef((f"{name}.xin-{token}", i, j)), TaskRef(w_keys[(i, j)]),
                  TaskRef(dy_keys[(i, j)]), stride, (need.pad[0], need.pad[1], pad[2], pad[3]),
                  groups)
            grads[(i, j)] = key
    # split each cell's input-row gradient by owner: own rows stay, ghost rows go home
    dx = {}
    for q in range(pr):
        q0, q1 = owners[q]
        for j in range(pc):
            own = None
            ghosts = []
            for need in plan:
                r0 = need.rows[0]
                for owner, a, b in need.pieces:
                    if owner != q:
                        continue
                    key = (f"{name}.dxhalo-{token}", need.cell, q, j)
                    g.add(key, binding.worker(need.cell, j), _dx_slice,
                          TaskRef(grads[(need.cell, j)]), a - r0, b - r0)
                    if need.cell == q and (a, b) == (q0, q1):
                        own = key
                    else:
                        ghosts += [a - q0, TaskRef(key)]
            if own is None:  # a cell that reads none of its own rows (strides)
                own_key = (f"{name}.dxzero-{token}", q, j)
                g.add(own_key, binding.worker(q, j), _zeros_like_rows,
                      TaskRef(x_keys[(q, j)]))
                own = own_key
            key = (f"{name}.dx-{token}", q, j)
            g.add(key, binding.worker(q, j), add_rows, TaskRef(own), *ghosts)
            dx[(q, j)] = key
    parts_w, parts_b = [], []
    for (i, j), gk in grads.items():
        for idx, lst in ((1, parts_w), (2, parts_b)):
            key = (f"{name}.dw{idx}", i, j)
            g.add(key, binding.worker(i, j), item, TaskRef(gk), idx)
            lst.append(TaskRef(key))
    dw_key, db_key = (f"{name}.dw-{token}", 0, 0), (f"{name}.db-{token}", 0, 0)
    g.add(dw_key, binding.worker(0, 0), sum_all, *parts_w)
    g.add(db_key, binding.worker(0, 0), sum_all, *parts_b)
    return dx, dw_key, db_key


def _dx_slice(grad, a, b):
    xp = xp_of(grad[0])
    return xp.asarray(grad[0][:, :, a:b, :], copy=True)


def _zeros_like_rows(x):
    return xp_of(x).zeros_like(x)
