"""Adam and AdamW on the weight slices a cell owns (Kingma & Ba 2015; Loshchilov & Hutter
2019, decoupled weight decay), array-module generic (NumPy, CuPy).

The optimizer state of a slice is one block of shape ``(2, rows, cols)``: the first
moment ``m`` and the second ``s``, beside the weight slice on its owner (as momentum is
for SGD). ``hp = (beta1, beta2, eps, weight_decay, decoupled)``; ``t`` is the 1-based
update count of the state (bias correction). Per step, as ``torch.optim.Adam``/``AdamW``
(decay applies to the first ``n_decay`` columns of a slice: not to the bias column)::

    Adam:   g <- g + wd * w                      AdamW: w <- w * (1 - lr * wd)
    m <- beta1 * m + (1 - beta1) * g
    s <- beta2 * s + (1 - beta2) * g * g
    w <- w - (lr / (1 - beta1^t)) * m / (sqrt(s) / sqrt(1 - beta2^t) + eps)

The state block is read by nothing but its owner's next update (ordered after this one
through the weights), so it is rewritten in place where it may be. On NumPy blocks both
passes run a row slice at a time, shared among the worker's kernel threads (the same bits).
"""

from __future__ import annotations

import math

from dask_ipar.kernels.blocks import xp_of
from dask_ipar.kernels.dense import _writable, block_reduce, dw_reduce
from dask_ipar.kernels.threads import by_rows

__all__ = ["adam_state", "adam_weight", "adam_update", "block_adam_state",
           "block_adam_weight"]


def _moments(w, hp, n_decay, state, g):
    b1, b2, _, wd, decoupled = hp
    xp = xp_of(g)
    if state is None:
        state = xp.zeros((2, *g.shape), dtype=g.dtype)
    elif not _writable(state):
        state = xp.asarray(state, copy=True)

    def rows(r0, r1, t):
        gr, m, s = g[r0:r1], state[0][r0:r1], state[1][r0:r1]
        if wd and n_decay and not decoupled:
            gr[:, :n_decay] += wd * w[r0:r1, :n_decay]
        m *= b1
        m += (1 - b1) * gr
        s *= b2
        s += (1 - b2) * (gr * gr)

    by_rows(g, rows)
    return state


def _step(out, state, hp, n_decay, lr, t):
    """``out`` (a copy of the slice, or the slice itself) minus the Adam step, in place."""
    b1, b2, eps, wd, decoupled = hp
    xp = xp_of(out)
    c2, c1 = math.sqrt(1 - b2 ** t), lr / (1 - b1 ** t)

    def rows(r0, r1, _):
        o = out[r0:r1]
        if wd and n_decay and decoupled:
            o[:, :n_decay] *= 1 - lr * wd
        denom = xp.sqrt(state[1][r0:r1]) / c2 + eps
        o -= c1 * state[0][r0:r1] / denom

    by_rows(out, rows)
    return out


def adam_state(w, hp, n_decay, state, dz, xb, c0, c1, n_in, *rest):
    """The state after this step's gradient of the owned slice ``w`` (columns ``c0:c1``;
    ``rest``: the input pieces, then the remote dW pieces); ``state`` None on the first
    step (zeros, then updated)."""
    return _moments(w, hp, n_decay, state, dw_reduce(dz, xb, c0, c1, n_in, *rest))


def adam_weight(w, state, hp, n_decay, lr, t):
    """The new slice (a new array) from the updated ``state``."""
    return _step(xp_of(w).asarray(w, copy=True), state, hp, n_decay, lr, t)


def adam_update(w, state, hp, n_decay, lr, t, in_place, n_after, dz, xb, c0, c1, n_in,
                *rest):
    """Moments and weights in one task. With ``in_place`` (and writable blocks) the slice
    is rewritten in place; the last ``n_after`` arguments are the tasks of this cell that
    read ``w`` (they run first; their values are unused)."""
    if n_after:
        rest = rest[:-n_after]
    new = adam_state(w, hp, n_decay, state, dz, xb, c0, c1, n_in, *rest)
    if new is not state:
        state[...] = new
    if in_place and _writable(w):
        return _step(w, state, hp, n_decay, lr, t)
    return adam_weight(w, state, hp, n_decay, lr, t)


def block_adam_state(wfull, r0, r1, c0, c1, hp, n_decay, state, grad, *remote):
    """:func:`adam_state` for block ``[r0:r1, c0:c1]`` of a replicated (conv) weight matrix:
    a new state block (the old one, if any, is read, not written)."""
    g = block_reduce(grad, r0, r1, c0, c1, *remote)
    old = None if state is None else xp_of(state).asarray(state, copy=True)
    return _moments(wfull[r0:r1, c0:c1], hp, n_decay, old, g)


def block_adam_weight(wfull, r0, r1, c0, c1, state, hp, n_decay, lr, t):
    """The new block ``[r0:r1, c0:c1]`` of ``wfull`` from the updated ``state``."""
    return _step(xp_of(wfull).asarray(wfull[r0:r1, c0:c1], copy=True), state, hp, n_decay,
                 lr, t)
