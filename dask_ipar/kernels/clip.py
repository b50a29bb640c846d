"""Gradient clipping by global norm, on the blocks each cell owns (array-module generic):
each cell's sum of squares (one word), the factor from all of them, the scaled block.
The engine's side is :func:`dask_ipar.nn.updates.clipped_updates`."""

from __future__ import annotations

from dask_ipar.kernels.blocks import xp_of

__all__ = ["sum_squares", "clip_factor", "clip_grad"]


def sum_squares(*blocks):
    """The sum of squares of a cell's owned gradient blocks, as a one-element array (the
    word the cell sends in the norm's all-reduce)."""
    xp = xp_of(blocks[0])
    total = sum(float(xp.sum(b * b)) for b in blocks)
    return xp.asarray([total], dtype=blocks[0].dtype)


def clip_factor(max_norm, *sums):
    """``min(1, max_norm / (norm + 1e-6))`` from every cell's sum of squares (as
    ``torch.nn.utils.clip_grad_norm_``)."""
    norm = sum(float(s[0]) for s in sums) ** 0.5
    return min(1.0, max_norm / (norm + 1e-6))


def clip_grad(g, factor, r_off=0, c_off=0):
    """``(r_off, c_off, g * factor)``: a clipped gradient block in the form
    :func:`grad_block` reads."""
    return (r_off, c_off, g * factor)
