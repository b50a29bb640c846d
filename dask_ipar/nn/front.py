"""The convolutional front of a network on a grid: domain-parallel conv and pooling layers,
then the redistribution (Eq. 6) to the model-parallel dense layers.

Layout on a ``Pr x Pc`` grid: cell ``(i, j)`` holds rows ``i`` (balanced over ``Pr``) of
the images of sample block ``j`` (balanced over ``Pc``), for every conv and pool layer's
input and output. The graphs of each layer come from :mod:`dask_ipar.nn.domain` (halo
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

from dataclasses import dataclass

from dask._task_spec import TaskRef

from dask_ipar.nn import domain as D
from dask_ipar.kernels import dense as K
from dask_ipar.kernels.conv import conv_out_size
from dask_ipar.nn.engine import LayerLayout, StepGraph
from dask_ipar.errors import IparError
from dask_ipar.nn.layers import Conv2d, resolve_padding
from dask_ipar.layout.partition import split_bounds

__all__ = ["FrontLayout", "Front", "front_layouts"]


@dataclass(frozen=True)
class FrontLayout:
    """Shapes and grid geometry of one conv or pooling layer."""

    index: int
    name: str
    kind: str  # "conv" or "pool"
    in_shape: tuple[int, int, int]  # (C, H, W)
    out_shape: tuple[int, int, int]
    k: tuple[int, int]
    stride: int
    pad: tuple[int, int, int, int]
    groups: int = 1
    activation: str = "linear"
    mode: str = "max"
    wshape: tuple | None = None  # conv filters (O, C/g, kh, kw)
    weights: LayerLayout | None = None  # the weight matrix's blocks (conv only)
    layout: str = "domain"  # row strips over Pr; "model": channel blocks; "batch": samples


def front_layouts(layers, input_shape, pr: int, pc: int, first_index: int = 0):
    """Layouts of the conv/pool layers ``layers`` on a ``pr x pc`` grid; checks the shapes.

    Raises :class:`IparError` naming the layer when a layer leaves no output rows or has
    fewer output rows than ``pr`` (every grid row must own some).
    """
    shape = tuple(input_shape)
    out = []
    layout = "domain"
    for off, layer in enumerate(layers):
        index = first_index + off
        c, h, w = shape
        if isinstance(layer, Conv2d):
            order = ("batch", "domain", "model")
            if order.index(layer.parallel) < order.index(layout if off else "batch"):
                raise IparError(
                    f"layer {index} (Conv2d) is {layer.parallel}-parallel but follows a "
                    f"{layout}-parallel layer; the conv layers run batch-parallel first, then "
                    "domain-parallel, then model-parallel (samples -> strips -> channel "
                    "blocks -> dense)."
                )
            layout = layer.parallel
            if layout == "model" and layer.filters < pr:
                raise IparError(
                    f"layer {index} (Conv2d, parallel='model') has {layer.filters} filters, "
                    f"fewer than the grid's Pr = {pr} rows that split them. Use a grid with "
                    f"Pr <= {layer.filters} or parallel='domain'."
                )
        elif off == 0:
            layout = "domain"  # a network that starts with pooling: strips
        if isinstance(layer, Conv2d):
            kh, kw = layer.kernel_size
            stride = layer.stride
            if c % layer.groups:
                raise IparError(f"layer {index} (Conv2d): groups={layer.groups} must divide the "
                                f"{c} input channels.")
            kind, name = "conv", f"conv{index}"
        else:
            kh = kw = layer.kernel_size
            stride = layer.stride
            kind, name = "pool", f"pool{index}"
        pad = resolve_padding(layer.padding, (h, w), (kh, kw), (stride, stride))
        oh = conv_out_size(h, kh, stride, pad[0], pad[1])
        ow = conv_out_size(w, kw, stride, pad[2], pad[3])
        if oh < 1 or ow < 1:
            raise IparError(
                f"layer {index} ({type(layer).__name__}) gets {h}x{w} images, too small for a "
                f"{kh}x{kw} window with padding {pad}: no output left. Use smaller windows or "
                "strides, more padding, or larger images."
            )
        if oh < pr and layout == "domain":
            raise IparError(
                f"layer {index} ({type(layer).__name__}) has {oh} output rows, fewer than the "
                f"grid's Pr = {pr} rows that split the images; every grid row needs at least "
                f"one. Use a grid with Pr <= {oh}, or larger images."
            )
        if kind == "conv":
            o = layer.filters
            wshape = (o, c // layer.groups, kh, kw)
            n_in = wshape[1] * kh * kw
            # blocks may be empty (fewer filters than Pr): the matrix is only stored there
            weights = LayerLayout(index=index, name=name, n_in=n_in, n_out=o, bias=layer.bias,
                                  activation=layer.activation, rows=split_bounds(o, pr),
                                  in_rows=split_bounds(n_in, pr),
                                  wcols=split_bounds(n_in + int(layer.bias), pc))
            out.append(FrontLayout(index, name, kind, shape, (o, oh, ow), (kh, kw), stride, pad,
                                   layer.groups, layer.activation, wshape=wshape,
                                   weights=weights, layout=layout))
            shape = (o, oh, ow)
        else:
            out.append(FrontLayout(index, name, kind, shape, (c, oh, ow), (kh, kw), stride, pad,
                                   mode=layer.mode, layout=layout))
            shape = (c, oh, ow)
    return out


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
        """The whole weight matrix on every cell (phase w_gather)."""
        grid = self.binding.grid
        if grid.size == 1:
            return {(0, 0): (w_name, 0, 0)}
        key = D._name(lay.name, "cw", self.token(step))
        blocks = [TaskRef((w_name, i, j)) for i, j in grid.cells()]
        out = {}
        for cell in grid.cells():
            g.add((key, *cell), self.binding.worker(*cell), K.assemble_blocks, grid.pr,
                  grid.pc, *blocks)
            out[cell] = (key, *cell)
        return out

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
                cx = self._model_forward(g, lay, prev, x_keys, names, token)
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
                x_keys = self._to_strips(g, lay, x_keys, token)
            if lay.kind == "conv":
                wk = self._weights(g, lay, next(names), step)
                plan, out = D.conv_forward_graph(g, self.binding, lay.name, token, x_keys, wk,
                                                 h, lay.wshape, lay.stride, lay.pad, lay.groups,
                                                 lay.activation)
            else:
                wk = None
                plan, out = D.pool_forward_graph(g, self.binding, lay.name, token, x_keys, h,
                                                 lay.k[0], lay.stride, lay.pad, lay.mode)
            ctx.append({"x": x_keys, "w": wk, "plan": plan, "out": out,
                        "from_batch": from_batch, "samples": samples})
            x_keys, prev = out, lay
        grid = self.binding.grid
        rd = D._name(self.flatten, "rd", token)
        xg = D._name(self.flatten, "xg", token)
        x_in = {}
        for i, j in grid.cells():
            g.add((rd, i, j), self.binding.worker(i, j), K.identity, TaskRef(x_keys[(i, j)]))
        for i, j in grid.cells():
            g.add((xg, i, j), self.binding.worker(i, j), K.flatten_gather, self.out_axis,
                  *[TaskRef((rd, k, j)) for k in range(grid.pr)])
            x_in[(i, j)] = TaskRef((xg, i, j))
        return ctx, x_in

    def _batch_forward(self, g, lay, x_keys, names, step):
        """A batch-layout layer: whole images of each cell's own samples, no exchange."""
        token = self.token(step)
        if lay.kind == "pool":
            return {"x": x_keys, "out": self._local_pool(g, lay, x_keys, token)}
        wk = self._weights(g, lay, next(names), step)
        out = self._per_cell(g, D._name(lay.name, "act", token), D.conv_block, lambda c: (
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
        return self._per_cell(g, D._name(lay.name, "act", token), D.pool_block, lambda c: (
            TaskRef(x_keys[c]), lay.k[0], lay.stride, lay.pad, lay.mode))

    def _local_pool_backward(self, g, lay, cx, dy_keys, need_dx, token):
        if not need_dx:
            return None
        return self._per_cell(g, D._name(lay.name, "dx", token), D.pool_block_backward,
                              lambda c: (TaskRef(cx["x"][c]), TaskRef(dy_keys[c]), lay.k[0],
                                         lay.stride, lay.pad, lay.mode))

    def _column_all_to_all(self, g, keys, name, token, cut_axis, cut, join_axis):
        """Re-split blocks within each grid column: cell (k, j) sends part ``cut(j, i)``
        (along ``cut_axis``) of its block to cell (i, j), which joins the parts in ``k``
        order along ``join_axis``. Parts that move are ``<name>`` keys, kept ones
        ``<name>own``; returns the joined keys."""
        grid = self.binding.grid
        piece = D._name(name[0], name[1], token)
        own = D._name(name[0], name[1] + "own", token)
        for k, j in grid.cells():
            for i in range(grid.pr):
                g.add((own if i == k else piece, k, i, j), self.binding.worker(k, j),
                      K.slice_axis, TaskRef(keys[(k, j)]), cut_axis, *cut(j, i))
        return self._per_cell(g, D._name(name[0], name[1] + "j", token), K.concat_axis,
                              lambda c: (join_axis, *[TaskRef((own if k == c[0] else piece, k,
                                                               *c)) for k in range(grid.pr)]))

    def _to_strips(self, g, lay, x_keys, token):
        """Batch layout to strips (``<layer>.rd`` pieces, phase ``redistribute``)."""
        rows = split_bounds(lay.in_shape[1], self.binding.grid.pr)
        return self._column_all_to_all(g, x_keys, (lay.name, "rd"), token, 2,
                                       lambda j, i: rows[i], 0)

    def _to_samples(self, g, lay, dx_keys, samples, token):
        """The strips' input gradients back to the batch layout (``<layer>.rdx``)."""
        return self._column_all_to_all(g, dx_keys, (lay.name, "rdx"), token, 0,
                                       lambda j, k: samples[j][k], 2)

    def _model_forward(self, g, lay, prev, x_keys, names, token):
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
            src = x_keys
            if prev.layout in ("domain", "batch"):
                rd = D._name(lay.name, "rd", token)
                for cell in cells:
                    g.add((rd, *cell), bind.worker(*cell), K.identity, TaskRef(x_keys[cell]))
                src = {cell: (rd, *cell) for cell in cells}
            xs = {}
            key = D._name(lay.name, "xs", token)
            for i, j in cells:
                g.add((key, i, j), bind.worker(i, j), K.concat_axis, axis,
                      *[TaskRef(src[(k, j)]) for k in range(grid.pr)])
                xs[(i, j)] = (key, i, j)
        # the filters' weight rows, gathered over the grid row (phase w_gather)
        w_name = next(names)
        wl = lay.weights
        if grid.pc == 1:
            wrow = {(i, 0): (w_name, i, 0) for i in range(grid.pr)}
        else:
            key = D._name(lay.name, "wrow", token)
            wrow = {}
            for i, j in cells:
                g.add((key, i, j), bind.worker(i, j), K.concat_cols,
                      *[TaskRef((w_name, i, jj)) for jj in range(grid.pc)])
                wrow[(i, j)] = (key, i, j)
        out = {}
        key = D._name(lay.name, "act", token)
        for i, j in cells:
            r0, r1 = wl.rows[i]
            g.add((key, i, j), bind.worker(i, j), D.conv_block, TaskRef(xs[(i, j)]),
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
        dxp = D._name(lay0.name, "dxp", token)
        for i in range(grid.pr):
            for k in range(grid.pr):
                if k == i:
                    continue
                a, b = self.out_blocks[k]
                for j in range(grid.pc):
                    g.add((dxp, i, k, j), self.binding.worker(i, j), K.dx_image_piece,
                          wrow[(i, j)], TaskRef((dz, i, j)), chw, axis, a, b)
        name = D._name(self.flatten, "dx", token)
        out = {}
        for k in range(grid.pr):
            a, b = self.out_blocks[k]
            for j in range(grid.pc):
                g.add((name, k, j), self.binding.worker(k, j), K.dz_image_from_pieces,
                      wrow[(k, j)], TaskRef((dz, k, j)), chw, axis, a, b,
                      *[TaskRef((dxp, i, k, j)) for i in range(grid.pr) if i != k])
                out[(k, j)] = (name, k, j)
        return out

    def _sample_grad(self, g, wrow, dz, token, lay0, batch):
        """The first dense layer's input gradient, reduce-scattered by samples."""
        grid = self.binding.grid
        samples = self.samples(batch)
        dxp = D._name(lay0.name, "dxp", token)
        for i, j in grid.cells():
            for k in range(grid.pr):
                if k != i:
                    g.add((dxp, i, k, j), self.binding.worker(i, j), K.dx_sample_piece,
                          wrow[(i, j)], TaskRef((dz, i, j)), self.out_shape, *samples[j][k])
        name = D._name(self.flatten, "dx", token)
        out = {}
        for k, j in grid.cells():
            g.add((name, k, j), self.binding.worker(k, j), K.dz_sample_from_pieces,
                  wrow[(k, j)], TaskRef((dz, k, j)), self.out_shape, *samples[j][k],
                  *[TaskRef((dxp, i, k, j)) for i in range(grid.pr) if i != k])
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
                    need_dx)
                pieces = self._grad_pieces(g, lay, grads, token)
                reduce_fn(g, lay, conv_pos, grads, cx["w"], pieces,
                          lambda i, wl=lay.weights: wl.rows[i])
            else:
                if not need_dx:
                    break
                dx = D.pool_backward_graph(g, self.binding, lay.name, token, cx["plan"],
                                           cx["x"], dy_keys, h, lay.k[0], lay.stride, lay.pad,
                                           lay.mode)
            if cx["from_batch"] and dx is not None:
                dx = self._to_samples(g, lay, dx, cx["samples"], token)
            dy_keys = dx

    def _batch_backward(self, g, lay, cx, dy_keys, need_dx, token, conv_pos, reduce_fn):
        """Backward of a batch-layout layer: local, but for the conv's weight all-reduce."""
        if lay.kind == "pool":
            return self._local_pool_backward(g, lay, cx, dy_keys, need_dx, token)
        grads = self._per_cell(g, D._name(lay.name, "bwd", token), D.conv_block_backward,
                               lambda c: (TaskRef(cx["x"][c]), TaskRef(cx["w"][c]),
                                          TaskRef(cx["out"][c]), TaskRef(dy_keys[c]), lay.wshape,
                                          lay.stride, lay.pad, lay.groups, lay.activation,
                                          need_dx))
        pieces = self._grad_pieces(g, lay, grads, token)
        reduce_fn(g, lay, conv_pos, grads, cx["w"], pieces, lambda i, wl=lay.weights: wl.rows[i])
        if not need_dx:
            return None
        return self._per_cell(g, D._name(lay.name, "dx", token), K.first_of,
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
            g.add((bwd, i, j), bind.worker(i, j), D.conv_block_backward, TaskRef(cx["x"][(i, j)]),
                  TaskRef(cx["w"][(i, j)]), TaskRef(cx["out"][(i, j)]),
                  TaskRef(dy_keys[(i, j)]), (r1 - r0, *lay.wshape[1:]), lay.stride, lay.pad, 1,
                  lay.activation, need_dx)
        grads = {cell: (bwd, *cell) for cell in cells}
        dwp = D._name(lay.name, "dwp", token)
        for i, j in cells:
            r0, r1 = wl.rows[i]
            for jj in range(grid.pc):
                if jj != j:
                    c0, c1 = wl.wcols[jj]
                    g.add((dwp, i, j, jj), bind.worker(i, j), K.grad_block,
                          TaskRef(grads[(i, j)]), 0, r1 - r0, c0, c1)

        def pieces(i, jj):
            return [TaskRef((dwp, i, j, jj)) for j in range(grid.pc) if j != jj]

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
        dxp = D._name(lay.name, "dxp", token)
        for i, j in cells:
            for k in range(grid.pr):
                if k != i:
                    g.add((dxp, i, k, j), bind.worker(i, j), K.slice_axis,
                          TaskRef(grads[(i, j)]), axis, *blocks[j][k])
        own = D._name(lay.name, "dxown", token)
        key = D._name(lay.name, "dx", token)
        for k, j in cells:
            g.add((own, k, j), bind.worker(k, j), K.slice_axis, TaskRef(grads[(k, j)]), axis,
                  *blocks[j][k])
            g.add((key, k, j), bind.worker(k, j), K.sum_pieces, TaskRef((own, k, j)),
                  *[TaskRef((dxp, i, k, j)) for i in range(grid.pr) if i != k])
        return {cell: (key, *cell) for cell in cells}

    def _grad_pieces(self, g, lay, grads, token):
        """Blocks of every cell's partial dW sent to the blocks' owners (phase dw_reduce)."""
        grid = self.binding.grid
        wl = lay.weights
        name = D._name(lay.name, "dwp", token)
        for src in grid.cells():
            for dst in grid.cells():
                if dst == src:
                    continue
                (r0, r1), (c0, c1) = wl.rows[dst[0]], wl.wcols[dst[1]]
                g.add((name, *src, *dst), self.binding.worker(*src), K.grad_block,
                      TaskRef(grads[src]), r0, r1, c0, c1)

        def pieces(i, j):
            return [TaskRef((name, *src, i, j)) for src in grid.cells() if src != (i, j)]

        return pieces
