"""The shapes of kernels' results as the step model sees them (:mod:`dask_ipar.kernels.costs`,
:mod:`dask_ipar.kernels.conv_costs`): a tuple result's :class:`Parts`, element counts, and
a product's flops and edge (:func:`gemm`)."""

from __future__ import annotations

__all__ = ["Parts", "numel", "item", "block_bytes", "gemm", "edge_flops", "GEMM_REF_N"]

#: The side of the square product whose rate is a machine's ``flops_per_s``
#: (``dask-ipar calibrate``'s): a product's edge (:func:`gemm`) is counted against it.
GEMM_REF_N = 1024
_REF_EDGE_PER_FLOP = 3.0 / (2.0 * GEMM_REF_N)


def gemm(m, k, n):
    """``(flops, edge)`` of one product of an ``m x k`` and a ``k x n`` matrix: ``2mkn``,
    and the elements of its operands and result beyond those of a square
    :data:`GEMM_REF_N` product of the same flops (``mk + kn + mn - 2mkn * 3 / (2 * 1024)``;
    negative for a larger one). A BLAS streams its operands and result through the caches
    once per block of the others: the thinner a product, the more of that per flop. The
    step model charges :class:`dask_ipar.cost.Machine`'s ``gemm_edge_flops``
    flop-equivalents per element of edge, measured by ``dask-ipar calibrate``."""
    flops = 2.0 * m * k * n
    if not flops:
        return 0.0, 0.0
    return flops, m * k + k * n + m * n - flops * _REF_EDGE_PER_FLOP


def edge_flops(square_rate, n, thin_rate, thin):
    """``gemm_edge_flops`` from the rate of a square ``n`` product and that of a ``thin``
    one, ``(m, k, n)``: the ``e`` for which ``flops + e * edge`` at one rate gives both
    times (:func:`gemm`), 0 where the thin one is as fast, at most 600 (below
    :class:`~dask_ipar.cost.Machine`'s bound). ``dask-ipar calibrate`` measures the two
    rates (:mod:`dask_ipar.runtime.calibrate`)."""
    f_sq, e_sq = gemm(n, n, n)
    f_th, e_th = gemm(*thin)
    ratio = square_rate / thin_rate  # the thin product's time per flop over the square's
    # ratio = (1 + e * e_th / f_th) / (1 + e * e_sq / f_sq), solved for e
    denominator = e_th / f_th - ratio * e_sq / f_sq
    if ratio <= 1.0 or denominator <= 0:
        return 0.0
    return min(600.0, (ratio - 1.0) / denominator)


class Parts(tuple):
    """The shapes of a kernel's tuple result, item by item (None for a None item)."""


def numel(shape) -> int:
    if shape is None:
        return 0
    if isinstance(shape, Parts):
        return sum(numel(s) for s in shape)
    n = 1
    for d in shape:
        n *= d
    return n


def item(shape, k):
    """Item ``k`` of a :class:`Parts` shape (the shape itself where it is not one)."""
    return shape[k] if isinstance(shape, Parts) else shape


def _largest(shape) -> int:
    if isinstance(shape, Parts):
        return max((_largest(s) for s in shape), default=0)
    return numel(shape)


def block_bytes(out_shape, in_shapes, itemsize) -> int:
    """Bytes of a kernel's largest array, among its result (each item of a tuple result)
    and its array inputs: what sets its element-wise rate
    (:meth:`dask_ipar.cost.Machine.elementwise_s_per_B`)."""
    return max([_largest(out_shape), *(_largest(s) for s in in_shapes)]) * itemsize
