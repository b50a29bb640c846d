"""One class per conv scheme: how a conv or pooling layer of the front runs on the grid.

Each scheme reads its input in one :class:`~dask_ipar.layout.placement.Placement` and
leaves its output in one, and brings its input there from the previous layer's output with
a collective of :mod:`dask_ipar.nn.collectives` (its adjoint in the backward):

=========== ======================= ======================= ==================================
scheme      reads                   leaves                  from the layer before
=========== ======================= ======================= ==================================
``batch``   ``SAMPLES_RC``          ``SAMPLES_RC``          nothing (batch layers come first)
``domain``  ``STRIPS``              ``STRIPS``              after batch: ``all_to_all``
``model``   ``WHOLE`` (conv);       ``CHANNELS`` (conv);    ``all_gather`` over Pr (adjoint:
            its input (pool)        its input (pool)        the ``reduce_scatter`` of dX)
=========== ======================= ======================= ==================================

Each layer's placements are on its :class:`~dask_ipar.nn.shapes.FrontLayout` (``reads``,
``leaves``). A conv's weight matrix is all-gathered over all P cells (batch, domain: every cell
convolves with all filters) or over its grid row (model: rows of filters over Pr), and its
partial weight gradients reduce-scattered back onto the owners of the blocks, as a dense
layer's. The scheme of a layer is its ``Conv2d(parallel=...)`` (a pooling layer takes the
scheme of the layer before it); :data:`SCHEMES` maps the names to the classes.
"""

from __future__ import annotations

from dask._task_spec import TaskRef

from dask_ipar.kernels import blocks as B
from dask_ipar.kernels import conv as CK
from dask_ipar.kernels import dense as K
from dask_ipar.layout.partition import split_bounds
from dask_ipar.layout.placement import CHANNELS, SAMPLES_RC
from dask_ipar.nn import collectives as C
from dask_ipar.nn import conv as D

__all__ = ["Scheme", "BatchScheme", "DomainScheme", "ModelScheme", "SCHEMES"]


def _width(bounds) -> int:
    return bounds[1] - bounds[0]


def _local_pool(front, g, lay, x_keys, token):
    """Pooling of whole images (batch or model layout): local to every cell."""
    return front._per_cell(g, D._name(lay.name, "act", token), CK.pool_block, lambda c: (
        TaskRef(x_keys[c]), lay.k[0], lay.stride, lay.pad, lay.mode))


def _local_pool_backward(front, g, lay, cx, dy_keys, need_dx, token):
    if not need_dx:
        return None
    return front._per_cell(g, D._name(lay.name, "dx", token), CK.pool_block_backward,
                           lambda c: (TaskRef(cx["x"][c]), TaskRef(dy_keys[c]), lay.k[0],
                                      lay.stride, lay.pad, lay.mode))


class Scheme:
    """How one conv or pooling layer runs; see the module docstring."""

    name: str = ""

    def forward(self, front, g, lay, prev, x_keys, names, step, batch) -> dict:
        """Add the layer's forward; returns its context (``"out"``: output keys per cell)."""
        raise NotImplementedError

    def backward(self, front, g, lay, cx, dy_keys, need_dx, token, conv_pos, reduce_fn):
        """Add the layer's backward; returns the input-gradient keys per cell (or None)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class BatchScheme(Scheme):
    """Whole images of each cell's own samples: no exchange but the weights' all-reduce."""

    name = "batch"

    def forward(self, front, g, lay, prev, x_keys, names, step, batch):
        """A batch-layout layer: whole images of each cell's own samples, no exchange."""
        token = front.token(step)
        if lay.kind == "pool":
            return {"x": x_keys, "out": _local_pool(front, g, lay, x_keys, token)}
        wk = front._weights(g, lay, next(names), step)
        out = front._per_cell(g, D._name(lay.name, "act", token), CK.conv_block, lambda c: (
            TaskRef(x_keys[c]), TaskRef(wk[c]), lay.wshape, lay.stride, lay.pad, lay.groups,
            lay.activation))
        return {"x": x_keys, "w": wk, "out": out}

    def backward(self, front, g, lay, cx, dy_keys, need_dx, token, conv_pos, reduce_fn):
        """Backward of a batch-layout layer: local, but for the conv's weight all-reduce."""
        if lay.kind == "pool":
            return _local_pool_backward(front, g, lay, cx, dy_keys, need_dx, token)
        grads = front._per_cell(g, D._name(lay.name, "bwd", token), CK.conv_block_backward,
                               lambda c: (TaskRef(cx["x"][c]), TaskRef(cx["w"][c]),
                                          TaskRef(cx["out"][c]), TaskRef(dy_keys[c]), lay.wshape,
                                          lay.stride, lay.pad, lay.groups, lay.activation,
                                          need_dx))
        pieces = front._grad_pieces(g, lay, grads, token)
        reduce_fn(g, lay, conv_pos, grads, cx["w"], pieces, lambda i, wl=lay.weights: wl.rows[i])
        if not need_dx:
            return None
        return front._per_cell(g, D._name(lay.name, "dx", token), B.first_of,
                              lambda c: (TaskRef(grads[c]),))


class DomainScheme(Scheme):
    """Image strips: rows over Pr, halo exchange forward, ghost rows back
    (:mod:`dask_ipar.nn.conv`); after batch layers, an all-to-all to strips first."""

    name = "domain"

    def forward(self, front, g, lay, prev, x_keys, names, step, batch):
        token = front.token(step)
        c, h, w = lay.in_shape
        samples = front.samples(batch)
        from_batch = prev is not None and prev.leaves == SAMPLES_RC
        if from_batch:  # whole images of sample blocks -> strips of the column's samples
            x_keys = _to_strips(front, g, lay, x_keys, token, batch)
        rw = front._row_words(lay, batch)
        if lay.kind == "conv":
            wk = front._weights(g, lay, next(names), step)
            plan, out = D.conv_forward_graph(g, front.binding, lay.name, token, x_keys, wk,
                                             h, lay.wshape, lay.stride, lay.pad, lay.groups,
                                             lay.activation, row_words=rw)
        else:
            wk = None
            plan, out = D.pool_forward_graph(g, front.binding, lay.name, token, x_keys, h,
                                             lay.k[0], lay.stride, lay.pad, lay.mode,
                                             row_words=rw)
        return {"x": x_keys, "w": wk, "plan": plan, "out": out, "from_batch": from_batch,
                "samples": samples, "batch": batch}

    def backward(self, front, g, lay, cx, dy_keys, need_dx, token, conv_pos, reduce_fn):
        c, h, w = lay.in_shape
        rw = front._row_words(lay, cx["batch"])
        if lay.kind == "conv":
            dx, grads = D.conv_backward_graph(
                g, front.binding, lay.name, token, cx["plan"], cx["x"], cx["w"], cx["out"],
                dy_keys, h, lay.wshape, lay.stride, lay.pad, lay.groups, lay.activation,
                need_dx, row_words=rw)
            pieces = front._grad_pieces(g, lay, grads, token)
            reduce_fn(g, lay, conv_pos, grads, cx["w"], pieces,
                      lambda i, wl=lay.weights: wl.rows[i])
        else:
            if not need_dx:
                return None
            dx = D.pool_backward_graph(g, front.binding, lay.name, token, cx["plan"], cx["x"],
                                       dy_keys, h, lay.k[0], lay.stride, lay.pad, lay.mode,
                                       row_words=rw)
        if cx["from_batch"] and dx is not None:
            dx = _to_samples(front, g, lay, dx, cx["samples"], token)
        return dx


def _to_strips(front, g, lay, x_keys, token, batch):
    """Batch layout to strips: an all-to-all over Pr (``<layer>.rd``, phase
    ``redistribute``)."""
    rows = split_bounds(lay.in_shape[1], front.binding.grid.pr)
    c, _, w = lay.in_shape
    samples = front.samples(batch)
    return C.all_to_all(g, front.binding, "pr", x_keys, lay.name, "rd", token, 2,
                        lambda src, dst: rows[dst[0]], 0, phase="redistribute",
                        words=lambda src, dst: (_width(samples[src[1]][src[0]]) * c * w
                                                * _width(rows[dst[0]])))


def _to_samples(front, g, lay, dx_keys, samples, token):
    """The strips' input gradients back to the batch layout: the adjoint all-to-all
    (``<layer>.rdx``, phase ``dx_reduce``)."""
    rows = split_bounds(lay.in_shape[1], front.binding.grid.pr)
    c, _, w = lay.in_shape
    return C.all_to_all(g, front.binding, "pr", dx_keys, lay.name, "rdx", token, 0,
                        lambda src, dst: samples[dst[1]][dst[0]], 2, phase="dx_reduce",
                        words=lambda src, dst: (_width(samples[dst[1]][dst[0]]) * c * w
                                                * _width(rows[src[0]])))


class ModelScheme(Scheme):
    """Filters over Pr on whole images (a conv), or local pooling of channel blocks."""

    name = "model"

    def forward(self, front, g, lay, prev, x_keys, names, step, batch):
        """A model-layout layer: conv with filters over Pr on whole images, or local pooling.

        A conv's input is gathered whole on every cell of the column first: strips of a
        domain-parallel layer through ``<layer>.rd`` keys (phase ``redistribute``), channel
        blocks of a model-parallel layer through its own output keys (its ``fwd_gather``).
        """
        token = front.token(step)
        grid, bind = front.binding.grid, front.binding
        cells = grid.cells()
        if lay.kind == "pool":
            return {"x": x_keys, "out": _local_pool(front, g, lay, x_keys, token),
                    "batch": batch}
        # the whole input images on every cell of the column
        if prev is None:  # the network's input, placed whole by the client
            xs = dict(x_keys)
        else:
            axis = prev.leaves.pr_axis
            moved = prev.leaves != CHANNELS  # strips or sample blocks, not channel blocks
            xs = C.all_gather(g, bind, "pr", x_keys, layer=lay.name if moved else prev.name,
                              phase="redistribute" if moved else "fwd_gather",
                              join=B.concat_axis, lead=(axis,), always_join=True,
                              name=D._name(lay.name, "xs", token),
                              rename=D._name(lay.name, "rd", token) if moved else None,
                              words=front._block_words(prev.out_shape, axis, batch))
        # the filters' weight rows, gathered over the grid row (phase w_gather)
        wl, w_name = lay.weights, next(names)
        wrow = C.all_gather(g, bind, "pc", {c: (w_name, *c) for c in cells},
                            layer=lay.name, phase="w_gather", join=B.concat_cols,
                            name=D._name(lay.name, "wrow", token),
                            words=lambda c: _width(wl.rows[c[0]]) * _width(wl.wcols[c[1]]))
        out = {}
        key = D._name(lay.name, "act", token)
        for i, j in cells:
            r0, r1 = wl.rows[i]
            g.add((key, i, j), bind.worker(i, j), CK.conv_block, TaskRef(xs[(i, j)]),
                  TaskRef(wrow[(i, j)]), (r1 - r0, *lay.wshape[1:]), lay.stride, lay.pad, 1,
                  lay.activation)
            out[(i, j)] = (key, i, j)
        return {"x": xs, "w": wrow, "out": out, "prev": prev, "batch": batch}

    def backward(self, front, g, lay, cx, dy_keys, need_dx, token, conv_pos, reduce_fn):
        """Backward of a model-layout layer; returns the input-gradient keys per cell.

        Conv: each cell's partial dW (its filters, its samples) is reduce-scattered over
        its grid row onto the column slices' owners (``dwp``, phase ``dw_reduce``), as a
        dense layer's; its partial dX (whole images) is reduce-scattered over the grid
        column onto the owners of the input's strips or channel blocks (``dxp``, phase
        ``dx_reduce``).
        """
        grid, bind = front.binding.grid, front.binding
        cells = grid.cells()
        if lay.kind == "pool":
            return _local_pool_backward(front, g, lay, cx, dy_keys, need_dx, token)
        wl = lay.weights
        bwd = D._name(lay.name, "bwd", token)
        for i, j in cells:
            r0, r1 = wl.rows[i]
            g.add((bwd, i, j), bind.worker(i, j), CK.conv_block_backward,
                  TaskRef(cx["x"][(i, j)]),
                  TaskRef(cx["w"][(i, j)]), TaskRef(cx["out"][(i, j)]),
                  TaskRef(dy_keys[(i, j)]), (r1 - r0, *lay.wshape[1:]), lay.stride, lay.pad, 1,
                  lay.activation, need_dx)
        grads = {cell: (bwd, *cell) for cell in cells}
        dw = C.reduce_scatter(
            g, bind, "pc", D._name(lay.name, "dwp", token),
            lambda src, dst: (K.grad_block, TaskRef(grads[src]), 0, _width(wl.rows[src[0]]),
                              *wl.wcols[dst[1]]),
            layer=lay.name, phase="dw_reduce",
            words=lambda src, dst: _width(wl.rows[dst[0]]) * _width(wl.wcols[dst[1]]))

        def pieces(i, jj):
            return dw[(i, jj)]

        reduce_fn(g, lay, conv_pos, grads, cx["w"], pieces,
                  lambda i: (0, wl.rows[i][1] - wl.rows[i][0]))
        if not need_dx:
            return None
        prev = cx["prev"]
        axis = prev.leaves.pr_axis
        if axis == 0:
            blocks = front.samples(cx["batch"])
        else:
            blocks = [split_bounds(lay.in_shape[axis - 1], grid.pr)] * grid.pc
        dx = C.reduce_scatter(
            g, bind, "pr", D._name(lay.name, "dxp", token),
            lambda src, dst: (B.slice_axis, TaskRef(grads[src]), axis, *blocks[src[1]][dst[0]]),
            layer=lay.name, phase="dx_reduce",
            words=lambda src, dst, w=front._block_words(prev.out_shape, axis, cx["batch"]): w(dst))
        own = D._name(lay.name, "dxown", token)
        key = D._name(lay.name, "dx", token)
        for k, j in cells:
            g.add((own, k, j), bind.worker(k, j), B.slice_axis, TaskRef(grads[(k, j)]), axis,
                  *blocks[j][k])
            g.add((key, k, j), bind.worker(k, j), B.sum_pieces, TaskRef((own, k, j)),
                  *dx[(k, j)])
        return {cell: (key, *cell) for cell in cells}


#: The conv schemes by the name of ``Conv2d(parallel=...)``.
SCHEMES = {s.name: s for s in (BatchScheme(), DomainScheme(), ModelScheme())}
