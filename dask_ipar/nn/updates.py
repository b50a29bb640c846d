"""The optimizer's update on the weight slices a cell owns: the tasks one cell adds after
its dW reduce-scatter, for momentum SGD, Nesterov and Adam/AdamW (:mod:`dask_ipar.optim`).

The state of a slice (a momentum block, or Adam's ``(2, rows, cols)`` moments) lives on
the slice's owner under the layer's ``v`` name. Dense slices: the first step creates it
(a task), later steps rewrite it in place inside the weight update, one task per cell; a
state block is read by nothing but its owner's next update, which depends on this one
through the weights, so updates of a block never overlap. The weights are rewritten in
place too (SGD, Adam), after every task of the cell that reads them (``after``: their
copies on other cells were fetched before: the dW pieces this update sums are computed
from them). Replicated (conv) weight blocks get a new state block each step.

With gradient clipping by global norm (:func:`clipped_updates`) every update waits for
the norm: each cell reduces its owned gradient blocks (dense slices and conv blocks),
sums their squares into one word, all-gathers the P words (``clip.gnorm`` keys, phase
``grad_norm``, priced by :func:`dask_ipar.cost.model.grad_norm_phase`), and scales its
blocks by ``min(1, max_norm / (norm + 1e-6))`` before the optimizer's rule; the states
and weights are then new blocks each step (the replicated-block path).
"""

from __future__ import annotations

from dataclasses import dataclass

from dask._task_spec import TaskRef

from dask_ipar.kernels import adam as KA
from dask_ipar.kernels import clip as KC
from dask_ipar.kernels import dense as K

__all__ = ["Rule", "slice_update", "block_update", "blocks_update", "clipped_updates"]


@dataclass(frozen=True)
class Rule:
    """One step's update: ``kind`` is ``sgd``, ``nesterov`` or ``adam`` (AdamW: ``hp``'s
    decoupled flag); ``t`` the 1-based update count of the state (Adam's bias
    correction), or a function of the worker giving the kernels' argument for it (a step
    template's count: a block that comes with each replay, :mod:`dask_ipar.runtime.templates`)."""

    kind: str
    lr: float
    momentum: float = 0.0
    weight_decay: float = 0.0
    hp: tuple | None = None
    t: object = 1
    #: gradient clipping by global norm: the largest norm, or None
    clip: float | None = None

    def count(self, worker):
        """The kernels' argument for ``t`` on ``worker``."""
        return self.t(worker) if callable(self.t) else self.t

    @classmethod
    def of(cls, lr, momentum, weight_decay, optimizer=None, t=1) -> "Rule":
        """From the engine's SGD arguments, or from ``optimizer`` (its rate that of the
        step) when given."""
        if optimizer is None:
            return cls("sgd", lr, momentum, weight_decay)
        clip = getattr(optimizer, "clip_norm", None)
        if optimizer.name in ("adam", "adamw"):
            return cls("adam", optimizer.lr, 0.0, optimizer.weight_decay, optimizer.hp, t, clip)
        kind = "nesterov" if getattr(optimizer, "nesterov", False) else "sgd"
        return cls(kind, optimizer.lr, optimizer.momentum, optimizer.weight_decay, clip=clip)


def slice_update(g, worker, rule: Rule, n_decay, w_old, w_key, v_key, first, dw, after):
    """The update tasks of one dense slice: new weights under ``w_key``; the state under
    ``v_key`` (created when ``first``, else rewritten in place). ``dw``: the arguments of
    the dW reduce (input pieces, remote pieces); ``after``: the cell's readers of
    ``w_old`` (None: the weights are not rewritten in place)."""
    in_place, n_after, after = after is not None, len(after or ()), tuple(after or ())
    lr, m, wd = rule.lr, rule.momentum, rule.weight_decay
    if rule.kind == "adam":
        if first:
            g.add(v_key, worker, KA.adam_state, w_old, rule.hp, n_decay, None, *dw)
            g.add(w_key, worker, KA.adam_weight, w_old, TaskRef(v_key), rule.hp, n_decay, lr,
                  rule.count(worker))
        else:
            g.add(w_key, worker, KA.adam_update, w_old, TaskRef(v_key), rule.hp, n_decay, lr,
                  rule.count(worker), in_place, n_after, *dw, *after)
    elif first:
        g.add(v_key, worker, K.sgd_velocity, w_old, m, wd, n_decay, None, *dw)
        # Nesterov's first direction g + momentum * v, with v = g
        g.add(w_key, worker, K.sgd_weight, w_old, TaskRef(v_key),
              lr * (1 + m) if rule.kind == "nesterov" else lr)
    elif rule.kind == "nesterov":
        g.add(w_key, worker, K.nesterov_update, w_old, TaskRef(v_key), lr, m, wd, n_decay,
              *dw)
    else:
        g.add(w_key, worker, K.sgd_update, w_old, TaskRef(v_key), lr, m, wd, n_decay,
              in_place, n_after, *dw, *after)


def block_update(g, worker, rule: Rule, wfull, r0, r1, c0, c1, n_decay, old_v, grad, pieces,
                 w_key, v_key):
    """The update tasks of block ``[r0:r1, c0:c1]`` of a replicated weight matrix (this
    cell's gathered copy ``wfull``): a new state under ``v_key`` from ``old_v`` (None on
    the first step), the new block under ``w_key``."""
    if rule.kind == "adam":
        g.add(v_key, worker, KA.block_adam_state, wfull, r0, r1, c0, c1, rule.hp, n_decay,
              old_v, grad, *pieces)
        g.add(w_key, worker, KA.block_adam_weight, wfull, r0, r1, c0, c1, TaskRef(v_key),
              rule.hp, n_decay, rule.lr, rule.count(worker))
        return
    g.add(v_key, worker, K.block_sgd_velocity, wfull, r0, r1, c0, c1, rule.momentum,
          rule.weight_decay, n_decay, old_v, grad, *pieces)
    if rule.kind == "nesterov":
        g.add(w_key, worker, K.block_nesterov_weight, wfull, r0, r1, c0, c1, TaskRef(v_key),
              old_v, rule.lr, rule.momentum)
    else:
        g.add(w_key, worker, K.block_sgd_weight, wfull, r0, r1, c0, c1, TaskRef(v_key),
              rule.lr)


def blocks_update(g, engine, rule: Rule, step, wl, name, grads, wk, pieces, rows, v_old,
                  clipped):
    """The update of every block of a replicated weight matrix (a conv's, or a row-parallel
    output layer's): block ``(i, j)`` (rows ``rows(i)``, columns ``wl.wcols[j]``) from the
    cell's partial ``grads[cell]`` plus ``pieces(i, j)``, its gathered copy ``wk[cell]`` and
    the old state ``v_old`` (a name, None on the first step). With clipping the update
    waits for the norm: what it needs goes to ``clipped`` (:func:`clipped_updates`).
    Returns the new ``(w, v)`` names of layer ``name``."""
    w_name, v_name = engine.name(name, "w", step), engine.name(name, "v", step)
    if rule.clip is not None:
        clipped.append((wl, name, grads, wk, pieces, rows, v_old, w_name, v_name))
        return w_name, v_name
    for i, j in engine.grid.cells():
        (r0, r1), (c0, c1) = rows(i), wl.wcols[j]
        old = None if v_old is None else TaskRef((v_old, i, j))
        block_update(g, engine.binding.worker(i, j), rule, TaskRef(wk[(i, j)]), r0, r1, c0, c1,
                     wl.n_decay(j), old, TaskRef(grads[(i, j)]), pieces(i, j), (w_name, i, j),
                     (v_name, i, j))
    return w_name, v_name


def clipped_updates(g, engine, rule: Rule, step, dense, front):
    """The update tasks of a clipped step, after the backward has added every gradient.

    ``dense``: ``(lay, w_name_old, v_name_old, w_name, v_name, dw_args)`` per dense layer;
    ``front``: ``(wl, name, grads, wk, pieces, rows, v_name_old, w_name, v_name)`` per
    replicated weight matrix (:func:`blocks_update`: conv layers, a row-parallel output
    layer).
    """
    from dask_ipar.nn import collectives as C

    binding, cells = engine.binding, engine.grid.cells()
    owned = {c: [] for c in cells}  # cell -> its gradient blocks, in layer order
    todo = []
    for lay, w_old, v_old, w_name, v_name, dw_args in dense:
        gname = engine.name(lay.name, "grad", step)
        for i, jj in cells:
            key = (gname, i, jj)
            g.add(key, binding.worker(i, jj), K.dw_reduce, *dw_args(i, jj))
            owned[(i, jj)].append(key)
            (r0, r1), (c0, c1) = lay.rows[i], lay.wcols[jj]
            old_v = None if v_old is None else TaskRef((v_old, i, jj))
            todo.append((lay.name, (i, jj), key, TaskRef((w_old, i, jj)), 0, r1 - r0, 0,
                         c1 - c0, lay.n_decay(jj), old_v, (w_name, i, jj), (v_name, i, jj)))
    for wl, name, grads, wk, pieces, rows, v_old, w_name, v_name in front:
        gname = engine.name(name, "grad", step)
        for i, j in cells:
            (r0, r1), (c0, c1) = rows(i), wl.wcols[j]
            key = (gname, i, j)
            g.add(key, binding.worker(i, j), K.block_reduce, TaskRef(grads[(i, j)]), r0, r1,
                  c0, c1, *pieces(i, j))
            owned[(i, j)].append(key)
            old_v = None if v_old is None else TaskRef((v_old, i, j))
            todo.append((name, (i, j), key, TaskRef(wk[(i, j)]), r0, r1, c0, c1,
                         wl.n_decay(j), old_v, (w_name, i, j), (v_name, i, j)))
    sq = engine.name("clip", "gsq", step)
    for c in cells:
        g.add((sq, *c), binding.worker(*c), KC.sum_squares, *[TaskRef(k) for k in owned[c]])
    factor = C.all_gather(g, binding, "all", {c: (sq, *c) for c in cells}, layer="clip",
                          phase="grad_norm", words=lambda c: 1, join=KC.clip_factor,
                          lead=(rule.clip,), name=engine.name("clip", "gfac", step),
                          rename=engine.name("clip", "gnorm", step), always_join=True)
    for name, cell, key, wfull, r0, r1, c0, c1, nd, old_v, w_key, v_key in todo:
        ckey = (engine.name(name, "gclip", step), *cell)
        worker = binding.worker(*cell)
        g.add(ckey, worker, KC.clip_grad, TaskRef(key), TaskRef(factor[cell]), r0, c0)
        block_update(g, worker, rule, wfull, r0, r1, c0, c1, nd, old_v, TaskRef(ckey), (),
                     w_key, v_key)
