"""Kernels of a row-parallel output layer (:mod:`dask_ipar.nn.rowpar`): the network's last
dense layer contracted over the input rows each cell already holds.

Cell ``(i, j)`` holds the whole weight matrix ``W`` (gathered over all P cells: it is
small) and its own rows ``c0:c1`` of the layer's input ``X(:, j)`` (the previous layer's
output block, never gathered). It computes the partial product ``W(:, c0:c1) X(c0:c1, j)``;
the grid column's partials are summed in grid-row order on every cell of the column (so
every cell holds the same logits, bit for bit), the bias added once. In the backward the
input gradient of its rows is local, ``W(:, c0:c1)^T dZ(:, j)``, and its weight-gradient
partial has only columns ``c0:c1`` (and the bias column, on the last grid row) non-zero.

Array-API generic, as :mod:`dask_ipar.kernels.dense`. Layout: activations are
``features x samples``.
"""

from __future__ import annotations

from dask_ipar.kernels.blas import matmul
from dask_ipar.kernels.blocks import xp_of
from dask_ipar.kernels.dense import _activate, _aligned, times_activation_grad_

__all__ = ["partial_forward", "partial_sum", "dz_rows", "grad_partial"]


def partial_forward(c0, c1, wfull, x, *after):
    """``W(:, c0:c1) @ X(c0:c1, j)``: this cell's share of the output (``x``: its input
    rows). Arguments after ``x`` are not read (order-only dependencies)."""
    return matmul(wfull[:, c0:c1], _aligned(x))


def partial_sum(n_in, bias, activation, wfull, *partials):
    """The layer's output block: the column's partials summed in the order given (grid
    row order), plus the bias column of ``wfull`` (column ``n_in``) when ``bias``, then the
    activation. A fresh array."""
    xp = xp_of(partials[0])
    z = xp.asarray(partials[0], copy=True)
    for p in partials[1:]:
        z += p
    if bias:
        z += wfull[:, n_in:n_in + 1]
    return _activate(z, activation)


def dz_rows(a, activation, c0, c1, wfull, dz):
    """The previous layer's output gradient on this cell's rows ``c0:c1``:
    ``(W(:, c0:c1)^T dZ) * f'(a)`` (``a``: the cell's block of that output)."""
    return times_activation_grad_(matmul(wfull[:, c0:c1].T, dz), a, activation)


def grad_partial(c0, c1, n_cols, bias_sum, dz, x):
    """This cell's partial of the whole ``classes x n_cols`` weight gradient, as ``(None,
    G)`` (the form of a replicated weight's partial, which
    :func:`dask_ipar.kernels.dense.grad_block` cuts): ``G`` holds ``dZ X(c0:c1, j)^T`` in
    columns ``c0:c1``, the row sums of ``dZ`` in the last (bias) column when ``bias_sum``
    (one grid row adds them), zeros elsewhere."""
    xp = xp_of(dz)
    g = xp.zeros((dz.shape[0], n_cols), dtype=dz.dtype)
    g[:, c0:c1] = matmul(dz, _aligned(x).T)
    if bias_sum:
        g[:, n_cols - 1] = xp.sum(dz, axis=1)
    return (None, g)
