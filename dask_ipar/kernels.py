"""Local kernels run inside tasks on the workers.

Every function here is module level (so it pickles by reference) and written
against the Python array API standard: it takes the array namespace from its
inputs, so the same code runs on NumPy blocks on CPUs and CuPy blocks on
GPUs (the tests run every kernel on ``array_api_strict`` arrays too, which
reject anything outside the standard). Layout follows the paper: activations
are ``features x samples``.
"""

from __future__ import annotations

import numpy as np

try:  # the compat layer gives CuPy and older NumPy the standard names
    from array_api_compat import array_namespace as _compat_namespace
except ImportError:  # pragma: no cover - depends on the environment
    _compat_namespace = None

__all__ = [
    "ACTIVATIONS",
    "xp_of",
    "concat_rows",
    "concat_cols",
    "dense_forward",
    "activation_grad",
    "softmax_xent_grad",
    "softmax_xent_stats",
    "dx_piece",
    "dz_from_pieces",
    "dw_piece",
    "dw_reduce",
    "sgd_velocity",
    "sgd_weight",
    "to_device",
    "to_host",
]

ACTIVATIONS = ("linear", "relu", "tanh")


def xp_of(x):
    """The array namespace of ``x`` (NumPy, CuPy, or any array API library)."""
    if _compat_namespace is not None:
        return _compat_namespace(x)
    ns = getattr(x, "__array_namespace__", None)
    return ns() if ns is not None else np


def concat_rows(*blocks):
    """Stack blocks along the feature axis (an all-gather's local result)."""
    if len(blocks) == 1:
        return blocks[0]
    return xp_of(blocks[0]).concat(list(blocks), axis=0)


def concat_cols(*blocks):
    """Join column slices of a weight block row (an all-gather's local result)."""
    if len(blocks) == 1:
        return blocks[0]
    return xp_of(blocks[0]).concat(list(blocks), axis=1)


def _activate(z, activation):
    xp = xp_of(z)
    if activation == "relu":
        return xp.where(z > 0, z, xp.zeros_like(z))
    if activation == "tanh":
        return xp.tanh(z)
    return z


def dense_forward(wrow, x, n_in, activation):
    """``f(W[:, :n_in] @ x + b)`` for one block row of a dense layer.

    ``wrow`` is the gathered block row ``W(i, :)``; its column ``n_in`` (if
    present) is the bias.
    """
    z = wrow[:, :n_in] @ x
    if wrow.shape[1] > n_in:
        z += wrow[:, n_in:n_in + 1]
    return _activate(z, activation)


def activation_grad(a, activation):
    """Derivative of the activation, written in terms of its output ``a`` (None: identity)."""
    if activation == "relu":
        return xp_of(a).astype(a > 0, a.dtype)
    if activation == "tanh":
        return 1 - a * a
    return None


def _softmax_parts(logits):
    xp = xp_of(logits)
    z = logits - xp.max(logits, axis=0, keepdims=True)
    e = xp.exp(z)
    return xp, z, e, xp.sum(e, axis=0, keepdims=True)


def _one_hot(xp, labels, start, stop, dtype):
    rows = xp.arange(start, stop, dtype=labels.dtype)
    return xp.astype(rows[:, None] == labels[None, :], dtype)


def softmax_xent_grad(logits, labels, row_start, row_stop, batch_total):
    """Rows ``row_start:row_stop`` of d(mean cross-entropy)/d(logits).

    ``logits`` is the gathered ``classes x b`` column block, ``labels`` its
    ``b`` integer labels, ``batch_total`` the global batch size B.
    """
    xp, _, e, s = _softmax_parts(logits)
    p = e[row_start:row_stop, :] / s
    return (p - _one_hot(xp, labels, row_start, row_stop, p.dtype)) / batch_total


def softmax_xent_stats(logits, labels):
    """``[sum of cross-entropy, number correct]`` of one column block, as float64 NumPy."""
    xp, z, e, s = _softmax_parts(logits)
    onehot = _one_hot(xp, labels, 0, logits.shape[0], z.dtype)
    logp = xp.sum(onehot * z, axis=0) - xp.log(s[0, :])
    correct = xp.sum(xp.astype(xp.argmax(logits, axis=0) == labels, xp.int64))
    return np.array([float(-xp.sum(logp)), float(correct)], dtype=np.float64)


def dx_piece(wrow, dz, c0, c1):
    """``W(i, c0:c1)^T dZ(i, j)``: one piece of the dX reduce-scatter."""
    return wrow[:, c0:c1].T @ dz


def dz_from_pieces(x_full, r0, r1, activation, wrow, dz, c0, c1, *remote):
    """The reduce of the dX reduce-scatter on cell (k, j), then the activation'.

    The local piece ``W(k, c0:c1)^T dZ(k, j)`` is computed here; ``remote`` are
    the pieces that cells (i != k, j) computed and sent. The activation output
    of this cell's rows is read from ``x_full[r0:r1]``, the gathered column that
    the forward pass kept on this cell (see the engine for why).
    """
    g = dx_piece(wrow, dz, c0, c1)
    for r in remote:
        g += r
    d = activation_grad(x_full[r0:r1, :], activation)
    return g if d is None else g * d


def dw_piece(dz, x, c0, c1, n_in):
    """Columns ``c0:c1`` of ``dZ(i, j) [X(:, j); 1]^T`` (the bias is column ``n_in``)."""
    xp = xp_of(dz)
    parts = []
    if c0 < n_in:
        parts.append(dz @ x[c0:min(c1, n_in), :].T)
    if c1 > n_in:
        parts.append(xp.sum(dz, axis=1, keepdims=True))
    return parts[0] if len(parts) == 1 else xp.concat(parts, axis=1)


def dw_reduce(dz, x, c0, c1, n_in, *remote):
    """The reduce of the dW reduce-scatter on cell (i, j): local piece plus remote pieces."""
    g = dw_piece(dz, x, c0, c1, n_in)
    for r in remote:
        g += r
    return g


def sgd_velocity(wrow, momentum, weight_decay, n_decay, v, dz, x, c0, c1, n_in, *remote):
    """``v <- momentum * v + g + weight_decay * w`` for the owned slice ``w = wrow[:, c0:c1]``.

    ``g`` is the reduced dW slice (:func:`dw_reduce` of the local and remote
    pieces); weight decay applies to the first ``n_decay`` columns of the slice
    (not to the bias column). ``v`` is None on the first step (then ``v = g``).
    """
    g = dw_reduce(dz, x, c0, c1, n_in, *remote)
    if weight_decay and n_decay:
        g[:, :n_decay] += weight_decay * wrow[:, c0:c0 + n_decay]
    if v is None:
        return g
    # g is this task's own array: scale-and-add into it (one allocation fewer than
    # momentum * v + g, same arithmetic); v itself is never modified.
    g += momentum * v
    return g


def sgd_weight(wrow, c0, c1, v, lr):
    """``w <- w - lr * v`` for the owned slice ``w = wrow[:, c0:c1]`` (one new array)."""
    out = v * (-lr)
    out += wrow[:, c0:c1]
    return out


def to_device(x):
    """Copy a host (NumPy) block into GPU memory (CuPy), on the worker that owns it."""
    import cupy

    return cupy.asarray(x)


def to_host(x):
    """A NumPy copy of a block (CuPy blocks leave the GPU; NumPy blocks pass through)."""
    get = getattr(x, "get", None)
    return get() if callable(get) and not isinstance(x, np.ndarray) else np.asarray(x)
