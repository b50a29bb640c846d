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
Where the update rewrites the slice in place (:func:`adam_update`), the gradient is never
whole either: the local dW product is made about 16 MiB of rows at a time into one scratch
buffer, and each row slice of it gets its bias column, the remote pieces, the moments and
the weight step while it is in cache (as momentum SGD's fused update does).
"""

from __future__ import annotations

import math

from dask_ipar.kernels.blocks import ufuncs_of, xp_of
from dask_ipar.kernels.dense import _writable, block_reduce, dw_reduce, fused_dw_rows
from dask_ipar.kernels.threads import by_rows

__all__ = ["adam_state", "adam_weight", "adam_update", "block_adam_state",
           "block_adam_weight"]


def _moment_rows(hp, n_decay, w, state, g, r0, r1):
    """The moments of rows ``r0:r1`` from their gradient rows ``g`` (decayed in place)."""
    b1, b2, _, wd, decoupled = hp
    m, s = state[0][r0:r1], state[1][r0:r1]
    if wd and n_decay and not decoupled:
        g[:, :n_decay] += wd * w[r0:r1, :n_decay]
    m *= b1
    m += (1 - b1) * g
    s *= b2
    s += (1 - b2) * (g * g)


def _step_rows(xp, hp, n_decay, lr, t, out, state, r0, r1):
    """Rows ``r0:r1`` of ``out`` (the slice or its copy) minus the Adam step, in place."""
    b1, b2, eps, wd, decoupled = hp
    c2, c1 = math.sqrt(1 - b2 ** t), lr / (1 - b1 ** t)
    o = out[r0:r1]
    if wd and n_decay and decoupled:
        o[:, :n_decay] *= 1 - lr * wd
    denom = xp.sqrt(state[1][r0:r1]) / c2 + eps
    o -= c1 * state[0][r0:r1] / denom


def _moments(w, hp, n_decay, state, g):
    xp = xp_of(g)
    if state is None:
        state = xp.zeros((2, *g.shape), dtype=g.dtype)
    elif not _writable(state):
        state = xp.asarray(state, copy=True)
    by_rows(g, lambda r0, r1, _: _moment_rows(hp, n_decay, w, state, g[r0:r1], r0, r1))
    return state


def _step(out, state, hp, n_decay, lr, t):
    """``out`` (a copy of the slice, or the slice itself) minus the Adam step, in place."""
    xp = xp_of(out)
    by_rows(out, lambda r0, r1, _: _step_rows(xp, hp, n_decay, lr, t, out, state, r0, r1))
    return out


def _adam_rows(m, w, state, hp, n_decay, lr, t, dz, xb, c0, c1, n_in, *rest):
    """:func:`adam_update` in place, fused (:func:`~dask_ipar.kernels.dense.fused_dw_rows`:
    the local dW product by chunks of about 16 MiB of rows into a scratch buffer as wide
    as the slice): each row slice, in cache, gets its bias column and the remote pieces,
    then the moments and the weight step. Each element as :func:`adam_state` then
    :func:`_step` make it. ``m``: the array module (NumPy or CuPy)."""

    def finish(g, s0, s1, _, nw, bias, remote):
        if bias is not None:
            g[:, nw] = bias[s0:s1]
        for r in remote:
            g += r[s0:s1, :]
        _moment_rows(hp, n_decay, w, state, g, s0, s1)
        _step_rows(m, hp, n_decay, lr, t, w, state, s0, s1)

    fused_dw_rows(m, w, True, dz, xb, c0, c1, n_in, *rest, finish=finish)
    return w


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
    m = ufuncs_of(w)
    if in_place and m is not None and ufuncs_of(state) is m and _writable(w) \
            and _writable(state):
        return _adam_rows(m, w, state, hp, n_decay, lr, t, dz, xb, c0, c1, n_in, *rest)
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
