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
from dask_ipar.kernels import dense as K
from dask_ipar.kernels import front as F
from dask_ipar.layout.partition import split_bounds
from dask_ipar.nn import collectives as C
from dask_ipar.nn import conv as D
from dask_ipar.nn.graph import StepGraph
from dask_ipar.layout.placement import SAMPLES_RC
from dask_ipar.nn.schemes import SCHEMES
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
        self.out_axis = last.leaves.pr_axis
        self.out_blocks = (None if self.out_axis == 0 else
                           split_bounds(last.out_shape[self.out_axis - 1], grid.pr))
        self.has_batch = any(f.leaves == SAMPLES_RC for f in self.layouts)

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
    def input_placement(self):
        """Where the network's input goes: a :class:`~dask_ipar.layout.placement.Placement`
        (``STRIPS``, ``WHOLE`` or ``SAMPLES_RC``), what the first layer reads."""
        return self.layouts[0].reads

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
        for lay in self.layouts:
            cx = SCHEMES[lay.layout].forward(self, g, lay, prev, x_keys, names, step, batch)
            ctx.append(cx)
            x_keys, prev = cx["out"], lay
        # the redistribution (Eq. 6): the strips (or channel or sample blocks) of the last
        # layer's output all-gathered over the column, as (C*H*W, b_j) features
        xg = C.all_gather(g, self.binding, "pr", x_keys, layer=self.flatten,
                          phase="redistribute", join=F.flatten_gather, lead=(self.out_axis,),
                          name=D._name(self.flatten, "xg", token),
                          rename=D._name(self.flatten, "rd", token), always_join=True,
                          words=self._block_words(self.out_shape, self.out_axis, batch))
        return ctx, {c: TaskRef(k) for c, k in xg.items()}

    def _row_words(self, lay, batch):
        """``row_words(j)``: words of one input row of a strip of column ``j``."""
        c, _, w = lay.in_shape
        samples = self.samples(batch)
        return lambda j: c * w * sum(_width(s) for s in samples[j])

    def _per_cell(self, g, name, func, args_of):
        """One task ``(name, i, j) = func(*args_of((i, j)))`` per cell; returns the keys."""
        out = {}
        for cell in self.binding.grid.cells():
            g.add((name, *cell), self.binding.worker(*cell), func, *args_of(cell))
            out[cell] = (name, *cell)
        return out

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
            lambda src, dst: (F.dx_image_piece, wrow[src], TaskRef((dz, *src)), chw, axis,
                              *self.out_blocks[dst[0]]),
            layer=lay0.name, phase="dx_reduce",
            words=lambda src, dst, w=self._block_words(chw, axis, batch): w(dst))
        name = D._name(self.flatten, "dx", token)
        out = {}
        for k in range(grid.pr):
            a, b = self.out_blocks[k]
            for j in range(grid.pc):
                g.add((name, k, j), self.binding.worker(k, j), F.dz_image_from_pieces,
                      wrow[(k, j)], TaskRef((dz, k, j)), chw, axis, a, b, *pieces[(k, j)])
                out[(k, j)] = (name, k, j)
        return out

    def _sample_grad(self, g, wrow, dz, token, lay0, batch):
        """The first dense layer's input gradient, reduce-scattered by samples."""
        grid = self.binding.grid
        samples = self.samples(batch)
        c, h, w = self.out_shape
        # every cell's product for all its column's samples at once, then cut per owner
        whole = D._name(lay0.name, "dxs", token)
        for cell in grid.cells():
            g.add((whole, *cell), self.binding.worker(*cell), F.dx_samples, wrow[cell],
                  TaskRef((dz, *cell)), self.out_shape)
        pieces = C.reduce_scatter(
            g, self.binding, "pr", D._name(lay0.name, "dxp", token),
            lambda src, dst: (F.sample_rows, TaskRef((whole, *src)), *samples[src[1]][dst[0]]),
            layer=lay0.name, phase="dx_reduce",
            words=lambda src, dst: _width(samples[dst[1]][dst[0]]) * c * h * w)
        name = D._name(self.flatten, "dx", token)
        out = {}
        for k, j in grid.cells():
            g.add((name, k, j), self.binding.worker(k, j), F.dz_samples_from_pieces,
                  TaskRef((whole, k, j)), *samples[j][k], *pieces[(k, j)])
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
            lay = self.layouts[l]
            if lay.kind == "conv":
                conv_pos -= 1
            dy_keys = SCHEMES[lay.layout].backward(self, g, lay, ctx[l], dy_keys, l > 0, token,
                                                   conv_pos, reduce_fn)

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
