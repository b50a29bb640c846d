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
"""

from __future__ import annotations

from dataclasses import dataclass

from dask._task_spec import TaskRef

from dask_ipar.kernels import adam as KA
from dask_ipar.kernels import dense as K

__all__ = ["Rule", "slice_update", "block_update"]


@dataclass(frozen=True)
class Rule:
    """One step's update: ``kind`` is ``sgd``, ``nesterov`` or ``adam`` (AdamW: ``hp``'s
    decoupled flag); ``t`` the 1-based update count of the state (Adam's bias
    correction)."""

    kind: str
    lr: float
    momentum: float = 0.0
    weight_decay: float = 0.0
    hp: tuple | None = None
    t: int = 1

    @classmethod
    def of(cls, lr, momentum, weight_decay, optimizer=None, t=1) -> "Rule":
        """From the engine's SGD arguments, or from ``optimizer`` (its rate that of the
        step) when given."""
        if optimizer is None:
            return cls("sgd", lr, momentum, weight_decay)
        if optimizer.name in ("adam", "adamw"):
            return cls("adam", optimizer.lr, 0.0, optimizer.weight_decay, optimizer.hp, t)
        kind = "nesterov" if getattr(optimizer, "nesterov", False) else "sgd"
        return cls(kind, optimizer.lr, optimizer.momentum, optimizer.weight_decay)


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
                  rule.t)
        else:
            g.add(w_key, worker, KA.adam_update, w_old, TaskRef(v_key), rule.hp, n_decay, lr,
                  rule.t, in_place, n_after, *dw, *after)
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
              rule.hp, n_decay, rule.lr, rule.t)
        return
    g.add(v_key, worker, K.block_sgd_velocity, wfull, r0, r1, c0, c1, rule.momentum,
          rule.weight_decay, n_decay, old_v, grad, *pieces)
    if rule.kind == "nesterov":
        g.add(w_key, worker, K.block_nesterov_weight, wfull, r0, r1, c0, c1, TaskRef(v_key),
              old_v, rule.lr, rule.momentum)
    else:
        g.add(w_key, worker, K.block_sgd_weight, wfull, r0, r1, c0, c1, TaskRef(v_key),
              rule.lr)
