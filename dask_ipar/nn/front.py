"""The convolutional front of a network on a grid: domain-parallel conv and pooling layers,
then the redistribution (Eq. 6) to the model-parallel dense layers.

Layout on a ``Pr x Pc`` grid: cell ``(i, j)`` holds rows ``i`` (balanced over ``Pr``) of
the images of sample block ``j`` (balanced over ``Pc``), for every conv and pool layer's
input and output. The graphs of each layer come from :mod:`dask_ipar.nn.conv` (halo
exchange forward, ghost-row gradients back).

Conv weights are one matrix per layer, ``O x (C/g*kh*kw [+ 1])`` (the last column the
bias), stored as ``Pr x Pc`` blocks like a dense layer's (block ``(i, j)`` on cell
``(i, j)``, beside its momentum). Every cell needs the whole matrix, so a training step
is a balanced all-reduce over all P cells, split across two steps as for the dense
layers:

========== =========================================================== ============
phase      tasks                                                       key fetched
========== =========================================================== ============
w_gather   ``cw``: each cell concatenates all P blocks                 ``w``
dw_reduce  ``dwp``: block ``(i', j')`` of each cell's partial dW goes  ``dwp``
           to cell ``(i', j')``, which sums and updates (``v``, ``w``)
========== =========================================================== ============

Each moves ``(P - 1) |W|`` in total, ``(P - 1)/P |W|`` per cell: the ring all-reduce
volume, with no home worker. Then the flatten layer: each cell's strip of the last
front layer's output is all-gathered over its grid column (``rd``, phase
``redistribute``) into the ``(C*H*W, b)`` features of its samples, in ``(C, H, W)``
order; the first dense layer's input-gradient reduce-scatter sends each strip's owner
the gradient of its rows, as an NCHW strip.
"""

from __future__ import annotations


from dask._task_spec import TaskRef

from dask_ipar.errors import IparError
from dask_ipar.kernels import blocks as B
from dask_ipar.kernels import conv as CK
from dask_ipar.kernels import dense as K
from dask_ipar.layout.partition import split_bounds
from dask_ipar.nn import collectives as C
from dask_ipar.nn import conv as D
from dask_ipar.nn.graph import StepGraph
from dask_ipar.nn.shapes import FrontLayout, front_layouts

__all__ = ["FrontLayout", "Front", "front_layouts"]


class Front:
    """Builds the front's part of each step graph (see the module docstring).

    Parameters
    ----------
    binding : GridBinding
    layouts : list of FrontLayout
    flatten : str
        Name of the flatten layer (its keys carry the redistribution).
    uid : str
        The model's token, part of every key.
    """

    def __init__(self, binding, layouts, flatten: str, uid: str):
        self.binding = binding
        self.layouts = list(layouts)
        self.flatten = flatten
        self.uid = uid
        self.convs = [f for f in self.layouts if f.kind == "conv"]
        grid = binding.grid
        last = self.layouts[-1]
        #: how the last layer's output is split over Pr: samples (axis 0, per column and
        #: step), channels (axis 1) or rows (axis 2)
        self.out_axis = {"batch": 0, "model": 1, "domain": 2}[last.layout]
        self.out_blocks = (None if self.out_axis == 0 else
                           split_bounds(last.out_shape[self.out_axis - 1], grid.pr))
        self.has_batch = any(f.layout == "batch" for f in self.layouts)

    def samples(self, batch: int):
        """``[column j][grid row i] -> (s0, s1)``: samples of each cell within its column."""
        pr = self.binding.grid.pr
        return [split_bounds(b1 - b0, pr) for b0, b1 in split_bounds(batch, self.binding.grid.pc)]

    def check_batch(self, batch: int):
        """Batch-parallel layers split each column's samples over Pr: at least Pr each."""
        grid = self.binding.grid
        if self.has_batch and batch < grid.size:
            raise IparError(
                f"a batch of {batch} samples cannot feed the batch-parallel conv layers on grid "
                f"{grid}: each of the {grid.size} cells needs a sample. Use batches of at least "
                f"{grid.size}, or parallel='domain' for those layers."
            )

    @property
    def input_layout(self) -> str:
        """"strips" (rows i of the images on cell (i, j)), "full" (whole images) or
        "samples" (whole images of sample block i of column j)."""
        return {"model": "full", "batch": "samples", "domain": "strips"}[self.layouts[0].layout]

    @property
    def out_shape(self):
        return self.layouts[-1].out_shape

    def token(self, step):
        return f"{self.uid}-s{step}"

    # ---------------------------------------------------------------- forward
    def _weights(self, g, lay, w_name, step):
        """The whole weight matrix on every cell: an all-gather over all P cells (phase
        w_gather)."""
        grid, wl = self.binding.grid, lay.weights
        return C.all_gather(g, self.binding, "all", {c: (w_name, *c) for c in grid.cells()},
                            layer=lay.name, phase="w_gather", join=B.assemble_blocks,
                            lead=(grid.pr, grid.pc), name=D._name(lay.name, "cw", self.token(step)),
                            words=lambda c: _width(wl.rows[c[0]]) * _width(wl.wcols[c[1]]))

    def _block_words(self, shape, axis, batch):
        """``words(cell)`` of the blocks of an NCHW activation of ``shape`` split over Pr
        along ``axis`` (0 samples, 1 channels, 2 rows) and over Pc by samples."""
        c, h, w = shape
        samples = self.samples(batch)
        if axis == 0:
            return lambda cell: _width(samples[cell[1]][cell[0]]) * c * h * w
        parts = split_bounds(shape[axis - 1], self.binding.grid.pr)
        return lambda cell: (_width(parts[cell[0]]) * (c * h * w // shape[axis - 1])
                             * sum(_width(s) for s in samples[cell[1]]))

    def forward(self, g: StepGraph, x_keys: dict, w_names: list, step: int, batch: int):
        """Forward of every front layer and the flatten all-gather.

        ``x_keys[(i, j)]``: key of the input strip on cell (i, j). Returns ``(ctx, x_in)``:
        ``x_in[(i, j)]`` (a TaskRef) is the ``(C*H*W, b_j)`` input of the first dense
        layer on every cell of column ``j``; ``ctx`` is what :meth:`backward` needs.
        """
        self.check_batch(batch)
        token = self.token(step)
        ctx = []
        names = iter(w_names)
        prev = None
        samples = self.samples(batch)
        for lay in self.layouts:
            c, h, w = lay.in_shape
            if lay.layout == "model":
                cx = self._model_forward(g, lay, prev, x_keys, names, token, batch)
                cx["batch"] = batch
                ctx.append(cx)
                x_keys, prev = cx["out"], lay
                continue
            if lay.layout == "batch":
                cx = self._batch_forward(g, lay, x_keys, names, step)
                ctx.append(cx)
                x_keys, prev = cx["out"], lay
                continue
            from_batch = prev is not None and prev.layout == "batch"
            if from_batch:  # whole images of sample blocks -> strips of the column's samples
                x_keys = self._to_strips(g, lay, x_keys, token, batch)
            rw = self._row_words(lay, batch)
            if lay.kind == "conv":
                wk = self._weights(g, lay, next(names), step)
                plan, out = D.conv_forward_graph(g, self.binding, lay.name, token, x_keys, wk,
                                                 h, lay.wshape, lay.stride, lay.pad, lay.groups,
                                                 lay.activation, row_words=rw)
            else:
                wk = None
                plan, out = D.pool_forward_graph(g, self.binding, lay.name, token, x_keys, h,
                                                 lay.k[0], lay.stride, lay.pad, lay.mode,
                                                 row_words=rw)
            ctx.append({"x": x_keys, "w": wk, "plan": plan, "out": out,
                        "from_batch": from_batch, "samples": samples, "batch": batch})
            x_keys, prev = out, lay
        # the redistribution (Eq. 6): the strips (or channel or sample blocks) of the last
        # layer's output all-gathered over the column, as (C*H*W, b_j) features
        xg = C.all_gather(g, self.binding, "pr", x_keys, layer=self.flatten,
                          phase="redistribute", join=K.flatten_gather, lead=(self.out_axis,),
                          name=D._name(self.flatten, "xg", token),
                          rename=D._name(self.flatten, "rd", token), always_join=True,
                          words=self._block_words(self.out_shape, self.out_axis, batch))
        return ctx, {c: TaskRef(k) for c, k in xg.items()}

    def _row_words(self, lay, batch):
        """``row_words(j)``: words of one input row of a strip of column ``j``."""
        c, _, w = lay.in_shape
        samples = self.samples(batch)
        return lambda j: c * w * sum(_width(s) for s in samples[j])

    def _batch_forward(self, g, lay, x_keys, names, step):
        """A batch-layout layer: whole images of each cell's own samples, no exchange."""
        token = self.token(step)
        if lay.kind == "pool":
            return {"x": x_keys, "out": self._local_pool(g, lay, x_keys, token)}
        wk = self._weights(g, lay, next(names), step)
        out = self._per_cell(g, D._name(lay.name, "act", token), CK.conv_block, lambda c: (
            TaskRef(x_keys[c]), TaskRef(wk[c]), lay.wshape, lay.stride, lay.pad, lay.groups,
            lay.activation))
        return {"x": x_keys, "w": wk, "out": out}

    def _per_cell(self, g, name, func, args_of):
        """One task ``(name, i, j) = func(*args_of((i, j)))`` per cell; returns the keys."""
        out = {}
        for cell in self.binding.grid.cells():
            g.add((name, *cell), self.binding.worker(*cell), func, *args_of(cell))
            out[cell] = (name, *cell)
        return out

    def _local_pool(self, g, lay, x_keys, token):
        """Pooling of whole images (batch or model layout): local to every cell."""
        return self._per_cell(g, D._name(lay.name, "act", token), CK.pool_block, lambda c: (
            TaskRef(x_keys[c]), lay.k[0], lay.stride, lay.pad, lay.mode))

    def _local_pool_backward(self, g, lay, cx, dy_keys, need_dx, token):
        if not need_dx:
            return None
        return self._per_cell(g, D._name(lay.name, "dx", token), CK.pool_block_backward,
                              lambda c: (TaskRef(cx["x"][c]), TaskRef(dy_keys[c]), lay.k[0],
                                         lay.stride, lay.pad, lay.mode))

    def _to_strips(self, g, lay, x_keys, token, batch):
        """Batch layout to strips: an all-to-all over Pr (``<layer>.rd``, phase
        ``redistribute``)."""
        rows = split_bounds(lay.in_shape[1], self.binding.grid.pr)
        c, _, w = lay.in_shape
        samples = self.samples(batch)
        return C.all_to_all(g, self.binding, "pr", x_keys, lay.name, "rd", token, 2,
                            lambda src, dst: rows[dst[0]], 0, phase="redistribute",
                            words=lambda src, dst: (_width(samples[src[1]][src[0]]) * c * w
                                                    * _width(rows[dst[0]])))

    def _to_samples(self, g, lay, dx_keys, samples, token):
        """The strips' input gradients back to the batch layout: the adjoint all-to-all
        (``<layer>.rdx``, phase ``dx_reduce``)."""
        rows = split_bounds(lay.in_shape[1], self.binding.grid.pr)
        c, _, w = lay.in_shape
        return C.all_to_all(g, self.binding, "pr", dx_keys, lay.name, "rdx", token, 0,
                            lambda src, dst: samples[dst[1]][dst[0]], 2, phase="dx_reduce",
                            words=lambda src, dst: (_width(samples[dst[1]][dst[0]]) * c * w
                                                    * _width(rows[src[0]])))

    def _model_forward(self, g, lay, prev, x_keys, names, token, batch):
        """A model-layout layer: conv with filters over Pr on whole images, or local pooling.

        A conv's input is gathered whole on every cell of the column first: strips of a
        domain-parallel layer through ``<layer>.rd`` keys (phase ``redistribute``), channel
        blocks of a model-parallel layer through its own output keys (its ``fwd_gather``).
        """
        grid, bind = self.binding.grid, self.binding
        cells = grid.cells()
        if lay.kind == "pool":
            return {"x": x_keys, "out": self._local_pool(g, lay, x_keys, token)}
        # the whole input images on every cell of the column
        if prev is None:  # the network's input, placed whole by the client
            xs = dict(x_keys)
        else:
            axis = {"batch": 0, "model": 1, "domain": 2}[prev.layout]
            moved = prev.layout in ("domain", "batch")
            xs = C.all_gather(g, bind, "pr", x_keys, layer=lay.name if moved else prev.name,
                              phase="redistribute" if moved else "fwd_gather",
                              join=B.concat_axis, lead=(axis,), always_join=True,
                              name=D._name(lay.name, "xs", token),
                              rename=D._name(lay.name, "rd", token) if moved else None,
                              words=self._block_words(prev.out_shape, axis, batch))
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
        return {"x": xs, "w": wrow, "out": out, "prev": prev}

    # --------------------------------------------------------------- backward
    def image_grad(self, g, wrow, dz, step, lay0, batch):
        """The first dense layer's input gradient, reduce-scattered as NCHW strips.

        ``wrow[(i, j)]``: its gathered weight rows on cell (i, j); ``dz[(i, j)]`` the key of
        its output gradient. Pieces for other grid rows are ``<dense>.dxp`` (phase
        ``dx_reduce``); returns the strip-gradient keys per cell.
        """
        grid = self.binding.grid
        token = self.token(step)
        chw, axis = self.out_shape, self.out_axis
        if axis == 0:
            return self._sample_grad(g, wrow, dz, token, lay0, batch)
        pieces = C.reduce_scatter(
            g, self.binding, "pr", D._name(lay0.name, "dxp", token),
            lambda src, dst: (K.dx_image_piece, wrow[src], TaskRef((dz, *src)), chw, axis,
                              *self.out_blocks[dst[0]]),
            layer=lay0.name, phase="dx_reduce",
            words=lambda src, dst, w=self._block_words(chw, axis, batch): w(dst))
        name = D._name(self.flatten, "dx", token)
        out = {}
        for k in range(grid.pr):
            a, b = self.out_blocks[k]
            for j in range(grid.pc):
                g.add((name, k, j), self.binding.worker(k, j), K.dz_image_from_pieces,
                      wrow[(k, j)], TaskRef((dz, k, j)), chw, axis, a, b, *pieces[(k, j)])
                out[(k, j)] = (name, k, j)
        return out

    def _sample_grad(self, g, wrow, dz, token, lay0, batch):
        """The first dense layer's input gradient, reduce-scattered by samples."""
        grid = self.binding.grid
        samples = self.samples(batch)
        c, h, w = self.out_shape
        pieces = C.reduce_scatter(
            g, self.binding, "pr", D._name(lay0.name, "dxp", token),
            lambda src, dst: (K.dx_sample_piece, wrow[src], TaskRef((dz, *src)), self.out_shape,
                              *samples[src[1]][dst[0]]),
            layer=lay0.name, phase="dx_reduce",
            words=lambda src, dst: _width(samples[dst[1]][dst[0]]) * c * h * w)
        name = D._name(self.flatten, "dx", token)
        out = {}
        for k, j in grid.cells():
            g.add((name, k, j), self.binding.worker(k, j), K.dz_sample_from_pieces,
                  wrow[(k, j)], TaskRef((dz, k, j)), self.out_shape, *samples[j][k],
                  *pieces[(k, j)])
            out[(k, j)] = (name, k, j)
        return out

    def backward(self, g, ctx, dy_keys, step, reduce_fn):
        """Backward of every front layer, last first.

        ``reduce_fn(g, lay, c, grads, wk, pieces, rows)`` adds the tasks that sum the
        conv layer's partial weight gradients on the block owners (``c`` is the conv's
        position among the front's convs; ``pieces(i, j)`` the keys of the remote
        pieces of block (i, j); ``rows(i)`` the block's rows within ``wk`` and the
        partial gradients).
        """
        token = self.token(step)
        conv_pos = len(self.convs)
        for l in range(len(self.layouts) - 1, -1, -1):
            lay, cx = self.layouts[l], ctx[l]
            c, h, w = lay.in_shape
            need_dx = l > 0
            if lay.layout == "model":
                if lay.kind == "conv":
                    conv_pos -= 1
                dy_keys = self._model_backward(g, lay, cx, dy_keys, need_dx, token, conv_pos,
                                               reduce_fn)
                continue
            if lay.layout == "batch":
                if lay.kind == "conv":
                    conv_pos -= 1
                dy_keys = self._batch_backward(g, lay, cx, dy_keys, need_dx, token, conv_pos,
                                               reduce_fn)
                continue
            if lay.kind == "conv":
                conv_pos -= 1
                dx, grads = D.conv_backward_graph(
                    g, self.binding, lay.name, token, cx["plan"], cx["x"], cx["w"], cx["out"],
                    dy_keys, h, lay.wshape, lay.stride, lay.pad, lay.groups, lay.activation,
                    need_dx, row_words=self._row_words(lay, cx["batch"]))
                pieces = self._grad_pieces(g, lay, grads, token)
                reduce_fn(g, lay, conv_pos, grads, cx["w"], pieces,
                          lambda i, wl=lay.weights: wl.rows[i])
            else:
                if not need_dx:
                    break
                dx = D.pool_backward_graph(g, self.binding, lay.name, token, cx["plan"],
                                           cx["x"], dy_keys, h, lay.k[0], lay.stride, lay.pad,
                                           lay.mode, row_words=self._row_words(lay, cx["batch"]))
            if cx["from_batch"] and dx is not None:
                dx = self._to_samples(g, lay, dx, cx["samples"], token)
            dy_keys = dx

    def _batch_backward(self, g, lay, cx, dy_keys, need_dx, token, conv_pos, reduce_fn):
        """Backward of a batch-layout layer: local, but for the conv's weight all-reduce."""
        if lay.kind == "pool":
            return self._local_pool_backward(g, lay, cx, dy_keys, need_dx, token)
        grads = self._per_cell(g, D._name(lay.name, "bwd", token), CK.conv_block_backward,
                               lambda c: (TaskRef(cx["x"][c]), TaskRef(cx["w"][c]),
                                          TaskRef(cx["out"][c]), TaskRef(dy_keys[c]), lay.wshape,
                                          lay.stride, lay.pad, lay.groups, lay.activation,
                                          need_dx))
        pieces = self._grad_pieces(g, lay, grads, token)
        reduce_fn(g, lay, conv_pos, grads, cx["w"], pieces, lambda i, wl=lay.weights: wl.rows[i])
        if not need_dx:
            return None
        return self._per_cell(g, D._name(lay.name, "dx", token), B.first_of,
                              lambda c: (TaskRef(grads[c]),))

    def _model_backward(self, g, lay, cx, dy_keys, need_dx, token, conv_pos, reduce_fn):
        """Backward of a model-layout layer; returns the input-gradient keys per cell.

        Conv: each cell's partial dW (its filters, its samples) is reduce-scattered over
        its grid row onto the column slices' owners (``dwp``, phase ``dw_reduce``), as a
        dense layer's; its partial dX (whole images) is reduce-scattered over the grid
        column onto the owners of the input's strips or channel blocks (``dxp``, phase
        ``dx_reduce``).
        """
        grid, bind = self.binding.grid, self.binding
        cells = grid.cells()
        if lay.kind == "pool":
            return self._local_pool_backward(g, lay, cx, dy_keys, need_dx, token)
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
        axis = {"batch": 0, "model": 1, "domain": 2}[prev.layout]
        if axis == 0:
            blocks = self.samples(cx["batch"])
        else:
            blocks = [split_bounds(lay.in_shape[axis - 1], grid.pr)] * grid.pc
        dx = C.reduce_scatter(
            g, bind, "pr", D._name(lay.name, "dxp", token),
            lambda src, dst: (B.slice_axis, TaskRef(grads[src]), axis, *blocks[src[1]][dst[0]]),
            layer=lay.name, phase="dx_reduce",
            words=lambda src, dst, w=self._block_words(prev.out_shape, axis, cx["batch"]): w(dst))
        own = D._name(lay.name, "dxown", token)
        key = D._name(lay.name, "dx", token)
        for k, j in cells:
            g.add((own, k, j), bind.worker(k, j), B.slice_axis, TaskRef(grads[(k, j)]), axis,
                  *blocks[j][k])
            g.add((key, k, j), bind.worker(k, j), B.sum_pieces, TaskRef((own, k, j)),
                  *dx[(k, j)])
        return {cell: (key, *cell) for cell in cells}

    def _grad_pieces(self, g, lay, grads, token):
        """Blocks of every cell's partial dW sent to the blocks' owners: a reduce-scatter
        over all P cells (phase dw_reduce); the owners' update tasks sum them."""
        wl = lay.weights
        pieces = C.reduce_scatter(
            g, self.binding, "all", D._name(lay.name, "dwp", token),
            lambda src, dst: (K.grad_block, TaskRef(grads[src]), *wl.rows[dst[0]],
                              *wl.wcols[dst[1]]),
            layer=lay.name, phase="dw_reduce",
            words=lambda src, dst: _width(wl.rows[dst[0]]) * _width(wl.wcols[dst[1]]))
        return lambda i, j: pieces[(i, j)]


def _width(bounds) -> int:
    return bounds[1] - bounds[0]
