"""Task graphs of the 1.5D dense layers (Gholami et al., Eq. 8) on a bound grid.

Layout of layer ``l`` with ``n`` inputs and ``m`` outputs on a ``Pr x Pc`` grid:

* The master weight ``W_l`` (``m x (n+1)``, the last column the bias) is a
  ``Pr x Pc`` blocked array: block ``(i, j)`` (rows ``i`` over ``Pr``, columns
  ``j`` over ``Pc``) lives on cell ``(i, j)`` beside its momentum slice.
* Activations ``A_l`` (``m x B``) are blocked the same way: rows over ``Pr``,
  samples over ``Pc``.

One training step, read as "communicate, compute locally, communicate":

=========== ================================================ ==============================
phase       tasks on cell (i, j)                             collective (nn.collectives)
=========== ================================================ ==============================
w_gather    ``W(i, j')`` fetched from the row's owners       ``all_gather`` over Pc
forward     ``A(i, j) = f(W(i, :) X(:, j))``                 local (kernels.dense)
fwd_gather  ``X_next(:, j)`` = the column's ``A(i', j)``     ``all_gather`` over Pr
dx_reduce   pieces ``W(i, k)^T dZ(i, j)`` go to cell (k, j)  ``reduce_scatter`` over Pr
dw_reduce   pieces ``dZ(i, j) X(j', j)^T`` go to (i, j')     ``reduce_scatter`` over Pc
update      the optimizer on the owned slice ``W(i, j')``    local (nn.updates)
=========== ================================================ ==============================

Each phase's cost formula is :func:`dask_ipar.cost.model.dense_layer_phases` (the planner
and the run's comm table both price it there); each collective records the words it routes
on the graph (:meth:`dask_ipar.nn.graph.StepGraph.routed_words`), and the tests hold the
two equal on every grid.

The gathers have no tasks of their own: the forward task of cell (i, j) takes the
weight slices of its grid row and the previous layer's blocks of its grid column as
dependencies and joins them itself, so a layer's forward is one task and one dependent
hop per cell; the backward tasks read the same fetched blocks (only the column ranges
they need, as views). One task per cell at the start of a step (``weights.wpre``)
fetches the row's weight slices of every layer while each is still only on its owner,
and the cell's forward tasks wait for it, so the slices are sent by their owners
(balanced senders; dask may still serve a fetch it retries from another copy). Replicas
are read by several tasks of a step, so a model holds dask's Active Memory Manager
stopped while it is distributed (:func:`dask_ipar.runtime.workers.hold_replicas`): its
ReduceReplicas policy would drop replicas that a waiting task still needs, and they would
travel again.

The dW reduce-scatter followed by the next step's weight all-gather is the ring all-reduce
of Eq. 8 with balanced traffic: every cell sends and receives ``(Pc-1)/Pc * |W|/Pr`` words
in each half; no cell is a home for the whole row. dX uses a reduce-scatter (not the
paper's all-reduce): each cell only needs its own row block of the previous layer's
gradient (half the paper's dX volume). Pure batch (``Pr = 1``) and pure model (``Pc = 1``)
run through the same code; collectives over a group of one are skipped.

Updates in place: a momentum block is read by one task only, its owner's update in the
next step, so after the first step it is a long-lived state block that the update task
(:func:`dask_ipar.kernels.dense.sgd_update`, one task per cell) rewrites in place; successive
updates of a cell are ordered through its weights. The update writes the new weights into
the old weight block too, after the tasks of its cell that read it (the dX pieces and the
dX sum of the layer, or its own dX piece where that is a task of its own, added as
dependencies); the other cells' copies were fetched before (the dW pieces the update sums
are computed from them). A step then allocates no weight-sized block. Not with in-process
workers (``inproc://``), whose fetched copies can be the owner's arrays, nor for the first
dense layer of a CNN (the front's tasks read it). So weight and momentum futures hold a
step's values only until the next step is submitted.

The network's last layer runs row-parallel where that moves fewer words
(:mod:`dask_ipar.nn.rowpar`: contracted over the input rows each cell holds, so the layer
in front of it gathers nothing and it reduces no dX; :mod:`dask_ipar.cost.rowpar`).

Every key is ``("<layer>.<task>-<uid>-s<step>", *cell)``, so the dashboard groups tasks by
layer and phase, and transfer logs attribute bytes to them (:func:`~.graph.phase_of_key`).
"""

from __future__ import annotations

from dask._task_spec import TaskRef

from dask_ipar.kernels import blocks as B
from dask_ipar.kernels import dense as K
from dask_ipar.kernels import loss as KL
from dask_ipar.nn import collectives as C
from dask_ipar.nn import rowpar as R
from dask_ipar.nn import updates as U
from dask_ipar.nn.dense_layout import LayerLayout, own_dx_first, own_first
from dask_ipar.nn.graph import StepGraph
from dask_ipar.layout.grid import GridBinding
from dask_ipar.layout.partition import split_bounds

__all__ = ["Engine"]


class Engine:
    """Builds the per-step task graphs of a dense network on a bound grid.

    Parameters
    ----------
    binding : GridBinding
        Grid cells bound to worker addresses.
    layouts : list of LayerLayout
        One per dense layer, in order.
    uid : str
        Hex token unique to the model, part of every key.
    front : dask_ipar.nn.front.Front, optional
        Conv and pooling layers in front of the dense ones (a CNN).
    """

    def __init__(self, binding: GridBinding, layouts: list[LayerLayout], uid: str, front=None):
        self.binding = binding
        self.layouts = layouts
        self.uid = uid
        self.front = front
        #: whether the workers are in this process (``inproc://``): they share its memory
        self.in_process = any(w.startswith("inproc") for w in binding.workers)
        #: update weight blocks in place; not with in-process workers, whose "fetched"
        #: replicas can be the owner's very arrays
        self.weights_in_place = not self.in_process

    @property
    def param_layouts(self) -> list[LayerLayout]:
        """Weight-matrix layouts of every layer with weights, in order (convs first)."""
        convs = [] if self.front is None else [f.weights for f in self.front.convs]
        return convs + list(self.layouts)

    def _split(self, names):
        nf = 0 if self.front is None else len(self.front.convs)
        return list(names[:nf]), list(names[nf:])

    def _inputs(self, g, x_keys, w_names, step, batch):
        """The first dense layer's inputs (after the front, if any); returns ``(ctx, x_in)``."""
        front_w, _ = self._split(w_names)
        if self.front is None:
            return None, x_keys
        return self.front.forward(g, {c: r.key for c, r in x_keys.items()}, front_w, step, batch)

    # ------------------------------------------------------------------ names
    def name(self, owner: str, task: str, step: int) -> str:
        return f"{owner}.{task}-{self.uid}-s{step}"

    @property
    def grid(self):
        return self.binding.grid

    # ---------------------------------------------------------------- phases
    def _weight_rows(self, g: StepGraph, lay: LayerLayout, w_name: str, step: int):
        """The weight slices of each grid row joined on its cells (phase w_gather).

        The slices were fetched by the step's first tasks (:meth:`_forward`), so this
        all-gather routes nothing new.
        """
        out = C.all_gather(g, self.binding, "pc", {c: (w_name, *c) for c in self.grid.cells()},
                           layer=lay.name, phase="w_gather", join=B.concat_cols,
                           name=self.name(lay.name, "wrow", step))
        return {c: TaskRef(k) for c, k in out.items()}

    # ----------------------------------------------------------- block sizes
    def _columns(self, batch):
        """Samples of each grid column (None when the batch is not known)."""
        if batch is None:
            return None
        return [b - a for a, b in split_bounds(batch, self.grid.pc)]

    @staticmethod
    def _slice_words(lay):
        """Words of weight slice ``(i, jj)``."""
        return lambda c: (lay.rows[c[0]][1] - lay.rows[c[0]][0]) * (lay.wcols[c[1]][1]
                                                                     - lay.wcols[c[1]][0])

    @staticmethod
    def _act_words(lay, cols):
        """Words of activation block ``(k, j)`` of ``lay``'s output (None: not recorded)."""
        if cols is None:
            return None
        return lambda c: (lay.rows[c[0]][1] - lay.rows[c[0]][0]) * cols[c[1]]

    def _gather_acts(self, g, lay, act, cols, dests=None):
        """All-gather of a layer's output blocks over each grid column (phase fwd_gather);
        returns per cell the refs of its column's blocks, joined by the task that reads
        them."""
        return C.all_gather(g, self.binding, "pr", {c: (act, *c) for c in self.grid.cells()},
                            layer=lay.name, phase="fwd_gather",
                            words=self._act_words(lay, cols), dests=dests)

    def _forward(self, g: StepGraph, x_in: dict, w_names: list[str], step: int, batch=None):
        """Forward of every layer: one task per cell and layer.

        The task on cell (i, j) reads the weight slices ``W(i, j')`` of its grid row (the
        w_gather over Pc) and the previous layer's blocks ``A(k, j)`` of its grid column
        (the fwd_gather over Pr) straight from their owners; the gathers end inside it, so
        a layer costs one task and one dependent hop per cell. Returns per layer the input
        parts of every cell (``(row ranges, refs)``) and the weight-slice refs of every grid
        row, and the key name of the last layer's output blocks (the logits; the loss
        tasks gather them, :meth:`_gather_acts`).
        """
        pr, pc = self.grid.pr, self.grid.pc
        cells = self.grid.cells()
        n0 = self.layouts[0].n_in
        parts = {c: (((0, n0),), [ref]) for c, ref in x_in.items()}
        if pc > 1:
            # The w_gather of every layer starts with the step: one task per cell fetches
            # its grid row's weight slices while each is still only on its owner (all cells
            # of a row wait for the same slices, so the scheduler starts them together).
            # The forward tasks wait for it (order only): sent while the cell still fetches,
            # one would tell it of the other cells' copies, and dask's workers fetch from
            # the peer that holds the most of what they need (one cell served the row).
            # It runs with them, not held as a root (held, each step's prefetch kept every
            # task record of its past on the workers)
            pre = self.name("weights", "wpre", step)
            for i, j in cells:
                g.add((pre, i, j), self.binding.worker(i, j), B.fetched,
                      *[TaskRef((w, i, jj)) for w in w_names for jj in range(pc)])
        inputs, wparts = [], []
        act = None
        cols = self._columns(batch)
        rowpar = self.row_parallel(batch)
        last = len(self.layouts) - 1
        for l, (lay, w_name) in enumerate(zip(self.layouts, w_names)):
            if rowpar and l == last:  # the output layer on the rows each cell holds
                act = self.name(lay.name, "act", step)
                wf = R.whole_weights(g, self, lay, w_name, step)
                R.forward(g, self, lay, wf, {c: xr[0] for c, (_, xr) in parts.items()}, act,
                          lambda c: [TaskRef((pre, *c))] if pc > 1 else [])
                inputs.append(parts)
                wparts.append(wf)
                break
            wg = C.all_gather(g, self.binding, "pc", {c: (w_name, *c) for c in cells},
                              layer=lay.name, phase="w_gather", words=self._slice_words(lay))
            wp = {i: wg[(i, 0)] for i in range(pr)}
            act = self.name(lay.name, "act", step)
            own = self.name(lay.name, "act_own", step)
            for i, j in cells:
                xb, xr = parts[(i, j)]
                after = [TaskRef((pre, i, j))] if pc > 1 else []
                at = self.binding.worker(i, j)
                if l > 0 and own_first(self.grid, lay, xb, i, cols, j):
                    # the product over the cell's own input rows runs while the column's
                    # other pieces travel; the forward task adds theirs when they arrive
                    rest = [k for k in range(pr) if k != i]
                    g.add((own, i, j), at, K.dense_forward_own, lay.wcols, (xb[i],),
                          lay.n_in, *wp[i], xr[i], *after)
                    g.add((act, i, j), at, K.dense_forward_rest, lay.wcols,
                          tuple(xb[k] for k in rest), lay.n_in, lay.activation,
                          TaskRef((own, i, j)), *wp[i], *[xr[k] for k in rest])
                else:
                    g.add((act, i, j), at, K.dense_forward, lay.wcols, xb, lay.n_in,
                          lay.activation, *wp[i], *xr, *after)
            inputs.append(parts)
            wparts.append(wp)
            if rowpar and l + 1 == last:  # the output layer reads each cell's own rows
                parts = {(i, j): ((lay.rows[i],), [TaskRef((act, i, j))]) for i, j in cells}
            elif l < last:
                xg = self._gather_acts(g, lay, act, cols)
                parts = {c: (lay.rows, xg[c]) for c in cells}
        return inputs, wparts, act

    def row_parallel(self, batch) -> bool:
        """Whether a step of ``batch`` samples runs the last layer row-parallel."""
        return R.is_row_parallel(self.layouts, self.grid, batch)

    def _logits(self, g, act, wparts, batch, step, dests=None):
        """The last layer's output pieces on every cell (``dests``: those only),
        ``{cell: [TaskRef]}``: gathered over the column, or partials summed (row-parallel)."""
        cols, last = self._columns(batch), self.layouts[-1]
        if self.row_parallel(batch):
            return R.logits(g, self, last, act, wparts[-1], cols, step, dests)
        return self._gather_acts(g, last, act, cols, dests)

    def _loss(self, g: StepGraph, logits: dict, y_keys: dict, batch: int, step: int):
        """Loss gradient rows on every cell (all, row-parallel); column statistics on row 0."""
        pr, pc = self.grid.pr, self.grid.pc
        last = self.layouts[-1]
        dz = self.name(last.name, "dz", step)
        for i in range(pr):
            r0, r1 = (0, last.n_out) if self.row_parallel(batch) else last.rows[i]
            for j in range(pc):
                g.add((dz, i, j), self.binding.worker(i, j), KL.softmax_xent_grad,
                      y_keys[(i, j)], r0, r1, batch, *logits[(i, j)])
        return dz, self._stats(g, logits, y_keys, step)

    def _stats(self, g: StepGraph, logits: dict, y_keys: dict, step: int) -> list:
        st = self.name("loss", "stats", step)
        for j in range(self.grid.pc):
            g.add((st, j), self.binding.worker(0, j), KL.softmax_xent_stats,
                  y_keys[(0, j)], *logits[(0, j)])
        return [(st, j) for j in range(self.grid.pc)]

    def _backward(self, g, inputs, wparts, dz, step, reduce_fn, w_names, batch=None,
                  block_fn=None):
        """Backward of every layer.

        ``reduce_fn(g, lay, l, dw_args, readers)`` adds the tasks that reduce the dW pieces;
        ``dw_args(i, jj)`` gives the :func:`~dask_ipar.kernels.dense.dw_reduce` arguments
        of slice ``(i, jj)`` (local inputs, then the remote pieces); ``readers(i, jj)`` the
        tasks of cell (i, jj) that read its weight slice after the forward pass (an update
        in place must follow them), or None when they are not known (no update in place).
        ``block_fn(g, lay, l, grads, wk, pieces)`` does it for a row-parallel output layer,
        whose weights are reduced as replicated blocks (``grads[cell]``: the cell's partial
        of the whole dW; ``wk[cell]``: its copy of the whole W; ``pieces(i, j)``).
        """
        pr, pc = self.grid.pr, self.grid.pc
        cols = self._columns(batch)
        rowpar = self.row_parallel(batch)
        for l in range(len(self.layouts) - 1, -1, -1):
            lay = self.layouts[l]
            if rowpar and l == len(self.layouts) - 1:
                prev = self.layouts[l - 1]
                dz_prev = self.name(prev.name, "dz", step)
                own = {c: xr[0] for c, (_, xr) in inputs[l].items()}
                grads, pieces = R.backward(g, self, lay, prev, own, wparts[l], dz, dz_prev, step)
                block_fn(g, lay, l, grads, wparts[l], pieces)
                dz = dz_prev
                continue
            # dW pieces, reduce-scattered over the row onto the slice owners; the
            # piece a cell keeps for itself is computed by the reducing task
            def dw_piece(src, dst, lay=lay, l=l, dz=dz):
                xb, xr = inputs[l][src]
                return (K.dw_piece, TaskRef((dz, *src)), xb, *lay.wcols[dst[1]], lay.n_in, *xr)

            dwr = C.reduce_scatter(g, self.binding, "pc", self.name(lay.name, "dwp", step),
                                   dw_piece, layer=lay.name, phase="dw_reduce",
                                   words=lambda src, dst, w=self._slice_words(lay): w(dst))

            def dw_args(i, jj, lay=lay, l=l, dz=dz, dwr=dwr):
                c0, c1 = lay.wcols[jj]
                xb, xr = inputs[l][(i, jj)]
                return (TaskRef((dz, i, jj)), xb, c0, c1, lay.n_in, *xr, *dwr[(i, jj)])

            if l == 0:
                # the owner's readers of its weight slice: the forward only (ordered before
                # the update through dZ); with a front, the image-gradient tasks too
                reduce_fn(g, lay, l, dw_args, None if self.front is not None else
                          (lambda i, jj: []))
                if self.front is not None:
                    wrows = self._weight_rows(g, lay, w_names[0], step)
                    return self.front.image_grad(g, wrows, dz, step, lay, batch)
                break
            # dX pieces, reduce-scattered over the column onto the row owners
            prev = self.layouts[l - 1]
            dxp = self.name(lay.name, "dxp", step)
            dxr = C.reduce_scatter(
                g, self.binding, "pr", dxp,
                lambda src, dst, lay=lay, l=l, dz=dz: (
                    K.dx_piece, lay.wcols, *lay.in_rows[dst[0]], TaskRef((dz, *src)),
                    *wparts[l][src[0]]),
                layer=lay.name, phase="dx_reduce",
                words=None if cols is None else (
                    lambda src, dst, lay=lay: (lay.in_rows[dst[0]][1] - lay.in_rows[dst[0]][0])
                    * cols[src[1]]))
            dz_prev = self.name(prev.name, "dz", step)
            dxown = self.name(lay.name, "dxown", step)
            apart = set()  # cells whose local dX piece is a task of its own
            for k in range(pr):
                c0, c1 = lay.in_rows[k]
                for j in range(pc):
                    own = inputs[l][(k, j)][1][k]  # this cell's block of the layer's input
                    at = self.binding.worker(k, j)
                    if own_dx_first(self.grid, lay, k, cols, j):
                        # the local piece runs while the other cells' pieces travel, and
                        # the update in place need not wait for them (it follows this)
                        apart.add((k, j))
                        g.add((dxown, k, j), at, K.dx_piece, lay.wcols, c0, c1,
                              TaskRef((dz, k, j)), *wparts[l][k])
                        g.add((dz_prev, k, j), at, K.dz_from_own, own, prev.activation,
                              TaskRef((dxown, k, j)), *dxr[(k, j)])
                    else:
                        g.add((dz_prev, k, j), at, K.dz_from_pieces, own, prev.activation,
                              lay.wcols, c0, c1, TaskRef((dz, k, j)), *wparts[l][k],
                              *dxr[(k, j)])

            def readers(i, jj, dxp=dxp, dz_prev=dz_prev, dxown=dxown, apart=apart):
                """The tasks of cell (i, jj) that read its weight slice after the forward."""
                return ([TaskRef((dxp, i, k, jj)) for k in range(pr) if k != i]
                        + [TaskRef((dxown if (i, jj) in apart else dz_prev, i, jj))])

            reduce_fn(g, lay, l, dw_args, readers)
            dz = dz_prev

    # ---------------------------------------------------------------- graphs
    def train_step(self, x_keys, y_keys, batch, w_names, v_names, step, lr, momentum,
                   weight_decay, g=None, optimizer=None, t=1):
        """Graph of one training step: ``(StepGraph, new_w_names, new_v_names, stats_keys)``.

        The update is momentum SGD (``lr``, ``momentum``, ``weight_decay``) or the rule of
        ``optimizer`` at this step (:mod:`dask_ipar.optim`; ``t``: the state's 1-based
        update count), its state under the ``v`` names (:mod:`dask_ipar.nn.updates`).
        """
        rule = U.Rule.of(lr, momentum, weight_decay, optimizer, t)
        g = StepGraph() if g is None else g
        ctx, x_in = self._inputs(g, x_keys, w_names, step, batch)
        (_, w_names), (front_v, v_names) = self._split(w_names), self._split(v_names)
        inputs, wparts, act = self._forward(g, x_in, w_names, step, batch)
        logits = self._logits(g, act, wparts, batch, step)
        dz, stats = self._loss(g, logits, y_keys, batch, step)
        pr, pc = self.grid.pr, self.grid.pc
        new_w, new_v = [], []
        front_clipped = []

        clipped = []  # with clipping: (lay, old w, old v, w, v, dw_args), updated at the end

        def update(g, lay, l, dw_args, readers):
            w_name = self.name(lay.name, "w", step)
            if rule.clip is not None:  # every update waits for the global norm
                v_name = self.name(lay.name, "v", step)
                clipped.append((lay, w_names[l], v_names[l], w_name, v_name, dw_args))
                new_w.append(w_name)
                new_v.append(v_name)
                return
            v_name = self.name(lay.name, "v", step) if v_names[l] is None else v_names[l]
            for i in range(pr):
                for jj in range(pc):
                    after = (None if readers is None or not self.weights_in_place
                             else readers(i, jj))
                    U.slice_update(g, self.binding.worker(i, jj), rule, lay.n_decay(jj),
                                   TaskRef((w_names[l], i, jj)), (w_name, i, jj),
                                   (v_name, i, jj), v_names[l] is None, dw_args(i, jj), after)
            new_w.append(w_name)
            new_v.append(v_name)

        def update_blocks(g, lay, l, grads, wk, pieces):  # a row-parallel output layer
            w, v = U.blocks_update(g, self, rule, step, lay, lay.name, grads, wk, pieces,
                                   lambda i: lay.rows[i], v_names[l], front_clipped)
            new_w.append(w)
            new_v.append(v)

        dimg = self._backward(g, inputs, wparts, dz, step, update, w_names, batch,
                              update_blocks)
        if self.front is not None:
            fw, fv = self._front_update(g, ctx, dimg, front_v, step, rule, front_clipped)
            new_w += fw
            new_v += fv
        if rule.clip is not None:
            U.clipped_updates(g, self, rule, step, clipped, front_clipped)
        return g, new_w[::-1], new_v[::-1], stats

    def _front_update(self, g, ctx, dimg, v_names, step, rule, clipped=None):
        """Backward of the front with ``rule``'s update on every conv weight block (with
        clipping, what the update needs goes to ``clipped``)."""
        new_w, new_v = [], []

        def update(g, lay, c, grads, wk, pieces, rows):
            w, v = U.blocks_update(g, self, rule, step, lay.weights, lay.name, grads, wk,
                                   pieces, rows, v_names[c], clipped)
            new_w.append(w)
            new_v.append(v)

        self.front.backward(g, ctx, dimg, step, update)
        return new_w, new_v

    def gradient(self, x_keys, y_keys, batch, w_names, step, g=None):
        """Graph of forward + backward without update. Returns ``(StepGraph, grad_names, stats)``.

        Gradient block ``(i, j)`` of layer ``l`` lies where weight block ``(i, j)`` does.
        """
        g = StepGraph() if g is None else g
        ctx, x_in = self._inputs(g, x_keys, w_names, step, batch)
        _, w_names = self._split(w_names)
        inputs, wparts, act = self._forward(g, x_in, w_names, step, batch)
        logits = self._logits(g, act, wparts, batch, step)
        dz, stats = self._loss(g, logits, y_keys, batch, step)
        pr, pc = self.grid.pr, self.grid.pc
        names = []

        def reduce(g, lay, l, dw_args, readers):
            gname = self.name(lay.name, "grad", step)
            for i in range(pr):
                for jj in range(pc):
                    g.add((gname, i, jj), self.binding.worker(i, jj), K.dw_reduce,
                          *dw_args(i, jj))
            names.append(gname)

        def reduce_blocks(g, wl, name, grads, pieces, rows):  # replicated weight matrices
            gname = self.name(name, "grad", step)
            for i, j in self.grid.cells():
                g.add((gname, i, j), self.binding.worker(i, j), K.block_reduce,
                      TaskRef(grads[(i, j)]), *rows(i), *wl.wcols[j], *pieces(i, j))
            names.append(gname)

        dimg = self._backward(g, inputs, wparts, dz, step, reduce, w_names, batch,
                              lambda g, lay, l, grads, wk, pieces: reduce_blocks(
                                  g, lay, lay.name, grads, pieces, lambda i: lay.rows[i]))
        if self.front is not None:
            self.front.backward(g, ctx, dimg, step, lambda g, lay, c, grads, wk, pieces, rows:
                                reduce_blocks(g, lay.weights, lay.name, grads, pieces, rows))
        return g, names[::-1], stats

    def forward(self, x_keys, w_names, step, y_keys=None, g=None, batch=None):
        """Graph of the forward pass. Returns ``(StepGraph, logits_keys, stats)``.

        ``logits_keys[j]`` is the ``classes x b_j`` logits block of column ``j`` on cell (0, j);
        ``stats`` is empty unless labels are given.
        """
        g = StepGraph() if g is None else g
        _, x_in = self._inputs(g, x_keys, w_names, step, batch)
        _, wparts, act = self._forward(g, x_in, self._split(w_names)[1], step, batch)
        logits = self._logits(g, act, wparts, batch, step,
                              dests={(0, j) for j in range(self.grid.pc)})
        stats = [] if y_keys is None else self._stats(g, logits, y_keys, step)
        pieces = [logits[(0, j)] for j in range(self.grid.pc)]
        if len(pieces[0]) == 1:
            return g, [p[0].key for p in pieces], stats
        # the logits rows gathered on row 0 (fwd_gather of the last layer)
        xg = self.name(self.layouts[-1].name, "xgather", step)
        for j, parts in enumerate(pieces):
            g.add((xg, 0, j), self.binding.worker(0, j), B.concat_rows, *parts)
        return g, [(xg, 0, j) for j in range(self.grid.pc)], stats
