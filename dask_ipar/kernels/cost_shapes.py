"""The shapes of kernels' results as the step model sees them (:mod:`dask_ipar.kernels.costs`,
:mod:`dask_ipar.kernels.conv_costs`): a tuple result's :class:`Parts`, element counts."""

from __future__ import annotations

__all__ = ["Parts", "numel", "item", "block_bytes"]


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
