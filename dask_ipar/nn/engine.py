"""Task graphs of the 1.5D dense layers (Gholami et al., Eq. 8) on a bound grid.

Layout of layer ``l`` with ``n`` inputs and ``m`` outputs on a ``Pr x Pc`` grid:

* The master weight ``W_l`` (``m x (n+1)``, the last column the bias) is a
  ``Pr x Pc`` blocked array: block ``(i, j)`` (rows ``i`` over ``Pr``, columns
  ``j`` over ``Pc``) lives on cell ``(i, j)`` beside its momentum slice.
* Activations ``A_l`` (``m x B``) are blocked the same way: rows over ``Pr``,
  samples over ``Pc``.

One training step, read as "communicate, compute locally, communicate":

=========== ================================================ =====================
phase       tasks on cell (i, j)                             collective
=========== ================================================ =====================
w_gather    ``W(i, j')`` fetched from the row's owners       all-gather over Pc
forward     ``A(i, j) = f(W(i, :) X(:, j))``                 local
fwd_gather  ``X_next(:, j)`` = the column's ``A(i', j)``     all-gather over Pr
dx_reduce   pieces ``W(i, k)^T dZ(i, j)`` go to cell (k, j)  reduce-scatter over Pr
dw_reduce   pieces ``dZ(i, j) X(j', j)^T`` go to (i, j')     reduce-scatter over Pc
update      momentum SGD on the owned slice ``W(i, j')``     local
=========== ================================================ =====================

The gathers have no tasks of their own: the forward task of cell (i, j) takes the
weight slices of its grid row and the previous layer's blocks of its grid column as
dependencies and joins them itself, so a layer's forward is one task and one dependent
hop per cell; the backward tasks read the same fetched blocks (only the column ranges
they need, as views). One task per cell at the start of a step (``weights.wpre``)
fetches the row's weight slices of every layer while each is still only on its owner,
so every slice is sent by its owner (balanced senders); later fetches could be served
by a replica. Replicas are read by several tasks of a step, so a model holds dask's
Active Memory Manager stopped while it is distributed
(:func:`dask_ipar.runtime.workers.hold_replicas`): its ReduceReplicas policy would drop replicas
that a waiting task still needs, and they would travel again.

The dW reduce-scatter followed by the next step's weight all-gather is the
ring all-reduce of Eq. 8 with balanced traffic: every cell sends and receives
``(Pc-1)/Pc * |W|/Pr`` words in each half; no cell is a home for the whole
row. dX uses a reduce-scatter (not the paper's all-reduce) because each cell
only needs its own row block of the previous layer's gradient; it moves half
the paper's dX volume. Pure batch (``Pr = 1``) and pure model (``Pc = 1``)
run through the same code; collectives over a group of one are skipped.

Updates in place: a momentum block is read by one task only, its owner's update in the
next step, so after the first step it is a long-lived state block that the update task
(:func:`dask_ipar.kernels.dense.sgd_update`, one task per cell) rewrites in place; successive
updates of a cell are ordered through its weights. The update writes the new weights into
the old weight block too, after the tasks of its cell that read it (the dX pieces and the
dX sum of the layer, added as dependencies); the other cells' copies were fetched before
(the dW pieces the update sums are computed from them). A step then allocates no
weight-sized block. Not with in-process workers (``inproc://``), whose fetched copies can be
the owner's arrays, nor for the first dense layer of a CNN (the front's tasks read it). So
weight and momentum futures hold a step's values only until the next step is submitted.

Every key is ``("<layer>.<task>-<uid>-s<step>", *cell)``, so the dashboard
groups tasks by layer and phase, and transfer logs attribute bytes to them
(:func:`phase_of_key`).
"""

from __future__ import annotations

import functools
import uuid
from dataclasses import dataclass, field

from dask._task_spec import DataNode, Task, TaskRef
from dask.highlevelgraph import HighLevelGraph, MaterializedLayer

from dask_ipar.kernels import dense as K
from dask_ipar.layout.grid import GridBinding
from dask_ipar.layout.partition import split_bounds

__all__ = ["LayerLayout", "StepGraph", "Engine", "phase_of_key", "span_of_name", "sim_tasks",
           "TASK_PHASE", "TASK_SPAN"]

#: Which collective moves the blocks of each task name between workers.
TASK_PHASE = {
    "act": "fwd_gather",
    "dxp": "dx_reduce",
    "dwp": "dw_reduce",
    "w": "w_gather",
    "dws": "w_gather",  # owned slices of an all-reduce, gathered by every cell
    "xhalo": "halo_fwd",
    "dxhalo": "halo_bwd",
    "rd": "redistribute",
    "rdx": "dx_reduce",
}


def phase_of_key(key) -> tuple[str, str] | None:
    """``(layer, phase)`` of a transferred key, or None for keys not of a layer phase.

    >>> phase_of_key(("dense1.dwp-0a1b2c3d-s7", 0, 1, 0))
    ('dense1', 'dw_reduce')
    """
    name = key[0] if isinstance(key, tuple) else key
    if not isinstance(name, str) or "." not in name:
        return None
    layer, _, rest = name.partition(".")
    task = rest.split("-", 1)[0]
    phase = TASK_PHASE.get(task)
    return None if phase is None else (layer, phase)


#: Dashboard span (per layer) of each task name: what the task does in the step.
TASK_SPAN = {
    "wrow": "w_gather",
    "wpre": "w_gather",
    "act": "forward",
    "xgather": "fwd_gather",
    "dxp": "dx_reduce",
    "dz": "backward",
    "dwp": "dw_reduce",
    "v": "update",
    "w": "update",
    "grad": "dw_reduce",
    "stats": "loss",
    "x": "input",
    "y": "input",
    "fetch": "to_host",
    "cw": "w_gather",
    "xhalo": "halo_fwd",
    "xin": "halo_fwd",
    "bwd": "backward",
    "dxhalo": "halo_bwd",
    "dx": "halo_bwd",
    "dxzero": "halo_bwd",
    "rd": "redistribute",
    "rdown": "redistribute",
    "rdj": "redistribute",
    "xg": "redistribute",
    "xs": "forward",
    "dxown": "dx_reduce",
    "rdx": "dx_reduce",
    "rdxown": "dx_reduce",
    "rdxj": "dx_reduce",
}


@functools.lru_cache(maxsize=4096)
def span_of_name(name: str):
    """The ``distributed.span`` annotation of a key name: ``("dask-ipar", layer, phase)``.

    Span ids derive from the names, so every step's tasks join the same spans and the
    dashboard shows one span per layer and phase.

    >>> span_of_name("dense1.act-0a1b2c3d-s7")["name"]
    ('dask-ipar', 'dense1', 'forward')
    """
    layer, _, rest = name.partition(".")
    task = rest.split("-", 1)[0]
    tags = ("dask-ipar", layer, TASK_SPAN.get(task, task))
    ids = tuple(str(uuid.uuid5(uuid.NAMESPACE_URL, "/".join(tags[: k + 1])))
                for k in range(len(tags)))
    return {"name": tags, "ids": ids}


@dataclass(frozen=True)
class LayerLayout:
    """Sizes and block bounds of one dense layer on a grid."""

    index: int
    name: str
    n_in: int
    n_out: int
    bias: bool
    activation: str
    rows: tuple[tuple[int, int], ...]  # output rows over Pr
    in_rows: tuple[tuple[int, int], ...]  # input rows over Pr (previous layer's rows)
    wcols: tuple[tuple[int, int], ...]  # weight columns (bias included) over Pc

    @property
    def n_cols(self) -> int:
        return self.n_in + int(self.bias)

    def n_decay(self, j: int) -> int:
        """Number of non-bias columns in weight slice ``j`` (weight decay applies to them)."""
        c0, c1 = self.wcols[j]
        return max(0, min(c1, self.n_in) - c0)

    @classmethod
    def build(cls, index, n_in, layer, pr, pc):
        n_cols = n_in + int(layer.bias)
        return cls(
            index=index,
            name=f"dense{index}",
            n_in=n_in,
            n_out=layer.units,
            bias=layer.bias,
            activation=layer.activation,
            rows=split_bounds(layer.units, pr),
            in_rows=split_bounds(n_in, pr),
            wcols=split_bounds(n_cols, pc),
        )


@dataclass
class StepGraph:
    """A graph under construction: tasks and the worker each one is pinned to."""

    dsk: dict = field(default_factory=dict)
    place: dict = field(default_factory=dict)
    #: keys to compute although no key asked for depends on them (prefetches)
    roots: list = field(default_factory=list)

    def add(self, key, worker, func, *args):
        """Add task ``key = func(*args)`` pinned to ``worker``; dependencies are ``TaskRef``."""
        self.dsk[key] = Task(key, func, *args)
        self.place[key] = worker

    def add_data(self, key, worker, value):
        """Embed ``value`` (a small input block) as key ``key`` on ``worker``; returns its ref."""
        self.dsk[key] = DataNode(key, value)
        self.place[key] = worker
        return TaskRef(key)

    def to_hlg(self, name: str) -> HighLevelGraph:
        """One graph layer whose annotation pins every task (``allow_other_workers=False``).

        The annotations are ``dict.get`` of plain dicts, so the scheduler needs no
        dask-ipar code to evaluate them: total over the layer's keys (keys it does
        not know, none here, would get no restriction). Each task also joins the
        dashboard span of its layer and phase (:func:`span_of_name`).
        """
        spans = {k: span_of_name(k[0]) for k in self.dsk}
        layer = MaterializedLayer(
            self.dsk,
            annotations={"workers": self.place.get, "allow_other_workers": False,
                         "span": spans.get},
        )
        return HighLevelGraph({name: layer}, {name: set()})


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
        """All-gather of the weight slices over each grid row (phase w_gather)."""
        pr, pc = self.grid.pr, self.grid.pc
        if pc == 1:
            return {(i, 0): TaskRef((w_name, i, 0)) for i in range(pr)}
        wg = self.name(lay.name, "wrow", step)
        out = {}
        for i in range(pr):
            for j in range(pc):
                g.add((wg, i, j), self.binding.worker(i, j), K.concat_cols,
                      *[TaskRef((w_name, i, jj)) for jj in range(pc)])
                out[(i, j)] = TaskRef((wg, i, j))
        return out

    def _forward(self, g: StepGraph, x_in: dict, w_names: list[str], step: int):
        """Forward of every layer: one task per cell and layer.

        The task on cell (i, j) reads the weight slices ``W(i, j')`` of its grid row (the
        w_gather over Pc) and the previous layer's blocks ``A(k, j)`` of its grid column
        (the fwd_gather over Pr) straight from their owners; the gathers end inside it, so
        a layer costs one task and one dependent hop per cell. Returns per layer the input
        parts of every cell (``(row ranges, refs)``) and the weight-slice refs of every grid
        row, and the logits of every cell: refs of its column's last-layer row pieces
        (the loss tasks read them; the fwd_gather of the last layer ends there).
        """
        pr, pc = self.grid.pr, self.grid.pc
        cells = self.grid.cells()
        n0 = self.layouts[0].n_in
        parts = {c: (((0, n0),), [ref]) for c, ref in x_in.items()}
        if pc > 1:
            # The w_gather of every layer starts with the step: one task per cell fetches
            # its grid row's weight slices, and the forward tasks find them there. All
            # cells of a row wait for the same slices (their own too), so the scheduler
            # starts them together, while each slice is still only on its owner: every
            # fetch is from the owner. Fetches left to the forward tasks, later in the step,
            # could be served by another cell's replica, which unbalances the senders.
            pre = self.name("weights", "wpre", step)
            for i, j in cells:
                g.add((pre, i, j), self.binding.worker(i, j), K.fetched,
                      *[TaskRef((w, i, jj)) for w in w_names for jj in range(pc)])
                g.roots.append((pre, i, j))
        inputs, wparts = [], []
        act = None
        for lay, w_name in zip(self.layouts, w_names):
            wp = {i: [TaskRef((w_name, i, jj)) for jj in range(pc)] for i in range(pr)}
            act = self.name(lay.name, "act", step)
            for i, j in cells:
                xb, xr = parts[(i, j)]
                g.add((act, i, j), self.binding.worker(i, j), K.dense_forward,
                      lay.wcols, xb, lay.n_in, lay.activation, *wp[i], *xr)
            inputs.append(parts)
            wparts.append(wp)
            parts = {(i, j): (lay.rows, [TaskRef((act, k, j)) for k in range(pr)])
                     for i, j in cells}
        # the logits: the last layer's row pieces of every cell's column (its fwd_gather
        # ends in the loss tasks that read them)
        logits = {(i, j): [TaskRef((act, k, j)) for k in range(pr)] for i, j in cells}
        return inputs, wparts, logits

    def _loss(self, g: StepGraph, logits: dict, y_keys: dict, batch: int, step: int):
        """Loss gradient rows on every cell and per-column loss statistics on row 0."""
        pr, pc = self.grid.pr, self.grid.pc
        last = self.layouts[-1]
        dz = self.name(last.name, "dz", step)
        for i in range(pr):
            r0, r1 = last.rows[i]
            for j in range(pc):
                g.add((dz, i, j), self.binding.worker(i, j), K.softmax_xent_grad,
                      y_keys[(i, j)], r0, r1, batch, *logits[(i, j)])
        return dz, self._stats(g, logits, y_keys, step)

    def _stats(self, g: StepGraph, logits: dict, y_keys: dict, step: int) -> list:
        st = self.name("loss", "stats", step)
        for j in range(self.grid.pc):
            g.add((st, j), self.binding.worker(0, j), K.softmax_xent_stats,
                  y_keys[(0, j)], *logits[(0, j)])
        return [(st, j) for j in range(self.grid.pc)]

    def _backward(self, g, inputs, wparts, dz, step, reduce_fn, w_names, batch=None):
        """Backward of every layer.

        ``reduce_fn(g, lay, l, dw_args, readers)`` adds the tasks that reduce the dW pieces;
        ``dw_args(i, jj)`` gives the :func:`~dask_ipar.kernels.dense.dw_reduce` arguments
        of slice ``(i, jj)`` (local inputs, then the remote pieces); ``readers(i, jj)`` the
        tasks of cell (i, jj) that read its weight slice after the forward pass (an update
        in place must follow them), or None when they are not known (no update in place).
        """
        pr, pc = self.grid.pr, self.grid.pc
        for l in range(len(self.layouts) - 1, -1, -1):
            lay = self.layouts[l]
            # dW pieces, reduce-scattered over the row onto the slice owners; the
            # piece a cell keeps for itself is computed by the reducing task
            dwp = self.name(lay.name, "dwp", step)
            for i in range(pr):
                for j in range(pc):
                    xb, xr = inputs[l][(i, j)]
                    for jj in range(pc):
                        if jj != j:
                            c0, c1 = lay.wcols[jj]
                            g.add((dwp, i, j, jj), self.binding.worker(i, j), K.dw_piece,
                                  TaskRef((dz, i, j)), xb, c0, c1, lay.n_in, *xr)

            def dw_args(i, jj, lay=lay, l=l, dz=dz, dwp=dwp):
                c0, c1 = lay.wcols[jj]
                xb, xr = inputs[l][(i, jj)]
                return (TaskRef((dz, i, jj)), xb, c0, c1, lay.n_in, *xr,
                        *[TaskRef((dwp, i, j, jj)) for j in range(pc) if j != jj])

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
            for i in range(pr):
                for k in range(pr):
                    if k != i:
                        c0, c1 = lay.in_rows[k]
                        for j in range(pc):
                            g.add((dxp, i, k, j), self.binding.worker(i, j), K.dx_piece,
                                  lay.wcols, c0, c1, TaskRef((dz, i, j)), *wparts[l][i])
            dz_prev = self.name(prev.name, "dz", step)
            for k in range(pr):
                c0, c1 = lay.in_rows[k]
                for j in range(pc):
                    own = inputs[l][(k, j)][1][k]  # this cell's block of the layer's input
                    g.add((dz_prev, k, j), self.binding.worker(k, j), K.dz_from_pieces,
                          own, prev.activation, lay.wcols, c0, c1, TaskRef((dz, k, j)),
                          *wparts[l][k],
                          *[TaskRef((dxp, i, k, j)) for i in range(pr) if i != k])

            def readers(i, jj, dxp=dxp, dz_prev=dz_prev):
                """The tasks of cell (i, jj) that read its weight slice after the forward."""
                return ([TaskRef((dxp, i, k, jj)) for k in range(pr) if k != i]
                        + [TaskRef((dz_prev, i, jj))])

            reduce_fn(g, lay, l, dw_args, readers)
            dz = dz_prev

    # ---------------------------------------------------------------- graphs
    def train_step(self, x_keys, y_keys, batch, w_names, v_names, step, lr, momentum,
                   weight_decay, g=None):
        """Graph of one SGD step. Returns ``(StepGraph, new_w_names, new_v_names, stats_keys)``."""
        g = StepGraph() if g is None else g
        ctx, x_in = self._inputs(g, x_keys, w_names, step, batch)
        (_, w_names), (front_v, v_names) = self._split(w_names), self._split(v_names)
        inputs, wparts, logits = self._forward(g, x_in, w_names, step)
        dz, stats = self._loss(g, logits, y_keys, batch, step)
        pr, pc = self.grid.pr, self.grid.pc
        new_w, new_v = [], []

        def update(g, lay, l, dw_args, readers):
            w_name = self.name(lay.name, "w", step)
            # The first step creates the momentum blocks (a task each); later steps update
            # them in place inside the weight update, one task per cell: a momentum block
            # is read by nothing but its owner's next update, which depends on this one
            # through the weights, so updates of a block never overlap. The weights are
            # rewritten in place too, after every task of the cell that reads them (their
            # copies on other cells were fetched before: the dW pieces this update sums are
            # computed from them).
            v_name = self.name(lay.name, "v", step) if v_names[l] is None else v_names[l]
            for i in range(pr):
                for jj in range(pc):
                    worker = self.binding.worker(i, jj)
                    w_old = TaskRef((w_names[l], i, jj))
                    if v_names[l] is None:
                        g.add((v_name, i, jj), worker, K.sgd_velocity,
                              w_old, momentum, weight_decay, lay.n_decay(jj), None,
                              *dw_args(i, jj))
                        g.add((w_name, i, jj), worker, K.sgd_weight,
                              w_old, TaskRef((v_name, i, jj)), lr)
                    else:
                        after = (None if readers is None or not self.weights_in_place
                                 else readers(i, jj))
                        g.add((w_name, i, jj), worker, K.sgd_update, w_old,
                              TaskRef((v_name, i, jj)), lr, momentum, weight_decay,
                              lay.n_decay(jj), after is not None, len(after or ()),
                              *dw_args(i, jj), *(after or ()))
            new_w.append(w_name)
            new_v.append(v_name)

        dimg = self._backward(g, inputs, wparts, dz, step, update, w_names, batch)
        if self.front is not None:
            fw, fv = self._front_update(g, ctx, dimg, front_v, step, lr, momentum, weight_decay)
            new_w += fw
            new_v += fv
        return g, new_w[::-1], new_v[::-1], stats

    def _front_update(self, g, ctx, dimg, v_names, step, lr, momentum, weight_decay):
        """Backward of the front with momentum SGD on every conv weight block."""
        new_w, new_v = [], []

        def update(g, lay, c, grads, wk, pieces, rows):
            wl = lay.weights
            v_name = self.name(lay.name, "v", step)
            w_name = self.name(lay.name, "w", step)
            for i, j in self.grid.cells():
                worker = self.binding.worker(i, j)
                (r0, r1), (c0, c1) = rows(i), wl.wcols[j]
                old_v = None if v_names[c] is None else TaskRef((v_names[c], i, j))
                g.add((v_name, i, j), worker, K.block_sgd_velocity, TaskRef(wk[(i, j)]),
                      r0, r1, c0, c1, momentum, weight_decay, wl.n_decay(j), old_v,
                      TaskRef(grads[(i, j)]), *pieces(i, j))
                g.add((w_name, i, j), worker, K.block_sgd_weight, TaskRef(wk[(i, j)]),
                      r0, r1, c0, c1, TaskRef((v_name, i, j)), lr)
            new_w.append(w_name)
            new_v.append(v_name)

        self.front.backward(g, ctx, dimg, step, update)
        return new_w, new_v

    def gradient(self, x_keys, y_keys, batch, w_names, step, g=None):
        """Graph of forward + backward without update. Returns ``(StepGraph, grad_names, stats)``.

        Gradient block ``(i, j)`` of layer ``l`` lies where weight block ``(i, j)`` does.
        """
        g = StepGraph() if g is None else g
        ctx, x_in = self._inputs(g, x_keys, w_names, step, batch)
        _, w_names = self._split(w_names)
        inputs, wparts, logits = self._forward(g, x_in, w_names, step)
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

        dimg = self._backward(g, inputs, wparts, dz, step, reduce, w_names, batch)
        if self.front is not None:
            def reduce_front(g, lay, c, grads, wk, pieces, rows):
                gname = self.name(lay.name, "grad", step)
                for i, j in self.grid.cells():
                    (r0, r1), (c0, c1) = rows(i), lay.weights.wcols[j]
                    g.add((gname, i, j), self.binding.worker(i, j), K.block_reduce,
                          TaskRef(grads[(i, j)]), r0, r1, c0, c1, *pieces(i, j))
                names.append(gname)

            self.front.backward(g, ctx, dimg, step, reduce_front)
        return g, names[::-1], stats

    def forward(self, x_keys, w_names, step, y_keys=None, g=None, batch=None):
        """Graph of the forward pass. Returns ``(StepGraph, logits_keys, stats)``.

        ``logits_keys[j]`` is the ``classes x b_j`` logits block of column ``j`` on cell (0, j);
        ``stats`` is empty unless labels are given.
        """
        g = StepGraph() if g is None else g
        _, x_in = self._inputs(g, x_keys, w_names, step, batch)
        _, _, logits = self._forward(g, x_in, self._split(w_names)[1], step)
        stats = [] if y_keys is None else self._stats(g, logits, y_keys, step)
        pieces = [logits[(0, j)] for j in range(self.grid.pc)]
        if self.grid.pr == 1:
            return g, [p[0].key for p in pieces], stats
        # the logits rows gathered on row 0 (fwd_gather of the last layer)
        xg = self.name(self.layouts[-1].name, "xgather", step)
        for j, parts in enumerate(pieces):
            g.add((xg, 0, j), self.binding.worker(0, j), K.concat_rows, *parts)
        return g, [(xg, 0, j) for j in range(self.grid.pc)], stats


# ------------------------------------------------------------ step-time model
def _shape_cost(func, args, shape, itemsize):
    """``(out_shape, flops, mem_bytes)`` of one kernel call, from its argument shapes.

    ``shape(arg)`` gives the shape of a dependency (or None for a literal).
    """
    name = func.__name__
    if name in ("concat_rows", "concat_cols"):
        shapes = [shape(a) for a in args]
        if name == "concat_rows":
            out = (sum(s[0] for s in shapes), shapes[0][1])
        else:
            out = (shapes[0][0], sum(s[1] for s in shapes))
        return out, 0.0, 2 * out[0] * out[1] * itemsize
    # mem_bytes: passes over the output of the allocating elementwise work (a fresh
    # array written is one pass, ``a += b`` three, ``a = s * b`` two)
    if name == "dense_forward":
        wb, xb, n_in, act = args[:4]
        blocks = args[4:]
        w, x = shape(blocks[0]), shape(blocks[len(wb)])
        out = (w[0], x[1])
        n_cols = wb[-1][1] - wb[0][0]
        # the gathers end here: joining slices (pieces) copies them, two passes each
        copies = (2 * w[0] * n_cols if len(wb) > 1 else 0) + (2 * n_in * x[1] if len(xb) > 1
                                                                 else 0)
        passes = 1 + (3 if n_cols > n_in else 0) + (2 if act != "linear" else 0)
        return out, 2.0 * w[0] * n_in * x[1], (passes * out[0] * out[1] + copies) * itemsize
    if name in ("softmax_xent_grad", "softmax_xent_stats"):  # logits pieces joined first
        parts = [shape(a) for a in args[4 if name == "softmax_xent_grad" else 1:]]
        lg = (sum(p[0] for p in parts), parts[0][1])
        mem = (6 + (2 if len(parts) > 1 else 0)) * lg[0] * lg[1] * itemsize
        out = (args[2] - args[1], lg[1]) if name == "softmax_xent_grad" else (2,)
        return out, 0.0, mem
    if name == "dx_piece":
        c0, c1, dz = args[1], args[2], shape(args[3])
        out = (c1 - c0, dz[1])
        return out, 2.0 * dz[0] * out[0] * out[1], out[0] * out[1] * itemsize
    if name == "dz_from_pieces":
        act, wb, c0, c1, dz = args[1], args[2], args[3], args[4], shape(args[5])
        out = (c1 - c0, dz[1])
        nrem = len(args) - 6 - len(wb)
        passes = 1 + 3 * nrem + {"relu": 4, "tanh": 6}.get(act, 0)
        return (out, 2.0 * dz[0] * out[0] * out[1], passes * out[0] * out[1] * itemsize)
    if name in ("dw_piece", "dw_reduce", "sgd_velocity"):
        off = 5 if name == "sgd_velocity" else 0
        dz, xb, (c0, c1, n_in) = shape(args[off]), args[off + 1], args[off + 2:off + 5]
        out = (dz[0], c1 - c0)
        nrem = len(args) - off - 5 - len(xb)
        passes = 1 + 3 * nrem
        if name == "sgd_velocity":  # in-place scale-and-adds: read two, write one
            passes += (3 if args[2] and args[3] else 0) + (3 if args[4] is not None else 0)
        return (out, 2.0 * dz[0] * max(0, min(c1, n_in) - c0) * dz[1],
                passes * out[0] * out[1] * itemsize)
    if name == "sgd_weight":
        out = shape(args[0])
        return out, 0.0, 5 * out[0] * out[1] * itemsize
    if name == "sgd_update":  # sgd_velocity in place, then the weights (in place or new)
        w, dz, xb, (c0, c1, n_in) = shape(args[0]), shape(args[8]), args[9], args[10:13]
        nrem = len(args) - 13 - len(xb) - args[7]
        if args[6]:  # fused in place: dW written and read, v and w read and written once,
            # the remote pieces and the decayed weights read (v stays in cache meanwhile)
            passes = 6 + nrem + (1 if args[4] and args[5] else 0)
        else:
            passes = 3 + 3 * nrem + (3 if args[4] and args[5] else 0) + 5
        return (w, 2.0 * dz[0] * max(0, min(c1, n_in) - c0) * dz[1],
                passes * w[0] * w[1] * itemsize)
    if name == "fetched":
        return (), 0.0, 0.0
    if name in ("to_device", "to_host"):
        s = shape(args[0])
        return s, 0.0, 2 * _numel(s) * itemsize
    raise ValueError(f"no cost model for kernel {name}")


def _numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def sim_tasks(g: StepGraph, external: dict, itemsize: int):
    """The tasks of a step graph as :class:`dask_ipar.cost.SimTask` values.

    ``external`` maps keys the graph uses but does not compute (the previous step's
    weight and momentum slices) to ``(worker, shape)``.
    """
    from dask_ipar.cost import SimTask

    shapes = {k: s for k, (_, s) in external.items()}

    def shape(arg):
        return shapes[arg.key] if isinstance(arg, TaskRef) else None

    out = []
    for key, node in g.dsk.items():  # insertion order is a topological order
        if isinstance(node, DataNode):
            shapes[key] = tuple(node.value.shape)
            continue
        oshape, flops, mem = _shape_cost(node.func, node.args, shape, itemsize)
        shapes[key] = oshape
        deps = tuple(a.key for a in node.args if isinstance(a, TaskRef))
        out.append(SimTask(key, g.place[key], deps, flops, mem, _numel(oshape) * itemsize))
    available = {k: (w, _numel(s) * itemsize) for k, (w, s) in external.items()}
    for key, node in g.dsk.items():
        if isinstance(node, DataNode):
            available[key] = (g.place[key], node.value.nbytes)
    return out, available
