"""The loss kernels: softmax cross-entropy's gradient rows and statistics on a grid
column's logits, and a submission's statistics stacked (array-API generic, as
:mod:`dask_ipar.kernels.dense`)."""

from __future__ import annotations

import numpy as np

from dask_ipar.kernels.blocks import concat_rows, xp_of

__all__ = ["softmax_xent_grad", "softmax_xent_stats", "stack_stats"]


def _softmax_parts(logits):
    xp = xp_of(logits)
    z = logits - xp.max(logits, axis=0, keepdims=True)
    e = xp.exp(z)
    return xp, z, e, xp.sum(e, axis=0, keepdims=True)


def _one_hot(xp, labels, start, stop, dtype):
    rows = xp.arange(start, stop, dtype=labels.dtype)
    return xp.astype(rows[:, None] == labels[None, :], dtype)


def softmax_xent_grad(labels, row_start, row_stop, batch_total, *logits):
    """Rows ``row_start:row_stop`` of d(mean cross-entropy)/d(logits).

    ``logits`` is the ``classes x b`` column block, given as its row pieces in order
    (the last layer's outputs of the grid column: the gather ends here), ``labels`` its
    ``b`` integer labels, ``batch_total`` the global batch size B.
    """
    xp, _, e, s = _softmax_parts(concat_rows(*logits))
    p = e[row_start:row_stop, :] / s
    return (p - _one_hot(xp, labels, row_start, row_stop, p.dtype)) / batch_total


def softmax_xent_stats(labels, *logits):
    """``[sum of cross-entropy, number correct]`` of one column block (``logits``: its row
    pieces in order), as float64 NumPy."""
    logits = concat_rows(*logits)
    xp, z, e, s = _softmax_parts(logits)
    onehot = _one_hot(xp, labels, 0, logits.shape[0], z.dtype)
    logp = xp.sum(onehot * z, axis=0) - xp.log(s[0, :])
    correct = xp.sum(xp.astype(xp.argmax(logits, axis=0) == labels, xp.int64))
    return np.array([float(-xp.sum(logp)), float(correct)], dtype=np.float64)


def stack_stats(*stats):
    """The loss statistics of several steps (each ``[loss sum, correct]``) as one ``(k, 2)``
    array: what a worker returns for all the steps of one submission."""
    return np.stack(stats)
