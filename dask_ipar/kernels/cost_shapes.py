"""The shapes of kernels' results as the step model sees them (:mod:`dask_ipar.kernels.costs`,
:mod:`dask_ipar.kernels.conv_costs`): a tuple result's :class:`Parts`, element counts."""

from __future__ import annotations

__all__ = ["Parts", "numel", "item"]


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
