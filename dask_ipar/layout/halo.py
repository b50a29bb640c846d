"""Halo geometry of height-split (domain-parallel) convolution and pooling layers.

Pure functions, no dask: which input rows each grid row needs for the output
rows it owns, and which cells own them. The exchange itself (the tasks that
move the pieces) is in :mod:`dask_ipar.nn.conv`; see docs/conv.md.

Each layer's output rows are split over ``Pr`` in balanced blocks (as every
layout in dask-ipar), so a layer's input split is the previous layer's output
split. Output row ``o`` of a window ``k`` with stride ``s`` and top padding
``p`` reads padded rows ``o*s .. o*s+k-1``, i.e. input rows
``o*s - p .. o*s - p + k - 1`` clipped to the image; rows outside are padding.
"""

from __future__ import annotations

from dataclasses import dataclass

from dask_ipar.layout.partition import split_bounds

__all__ = ["RowNeed", "halo_plan", "halo_rows"]


@dataclass(frozen=True)
class RowNeed:
    """What grid row ``cell`` needs to compute output rows ``out`` of one layer.

    ``rows``: the input rows ``[r0, r1)`` it reads (clipped to the image);
    ``pad``: zero rows to add above and below them (outer image edges only);
    ``pieces``: ``(owner, r0, r1)`` input row ranges by owning grid row, its own included.
    """

    cell: int
    out: tuple[int, int]
    rows: tuple[int, int]
    pad: tuple[int, int]
    pieces: tuple[tuple[int, int, int], ...]

    @property
    def halo_rows(self) -> int:
        """Input rows that come from other grid rows."""
        return sum(b - a for owner, a, b in self.pieces if owner != self.cell)


def halo_plan(h_in: int, pr: int, k: int, stride: int = 1, pad: tuple[int, int] = (0, 0)):
    """The :class:`RowNeed` of every grid row for one layer.

    Parameters
    ----------
    h_in : int
        Input height, split over ``pr`` grid rows in balanced blocks.
    k, stride : int
        Window height and vertical stride.
    pad : (top, bottom)
        Zero padding of the whole image.

    Blocks thinner than the halo simply take pieces from several neighbours. A grid
    row with no output rows (more grid rows than output rows) is an error.
    """
    h_out = (h_in + pad[0] + pad[1] - k) // stride + 1
    if h_out < pr:
        raise ValueError(
            f"the layer has {h_out} output rows, fewer than Pr = {pr} grid rows; every grid "
            f"row needs at least one. Use Pr <= {h_out} for this layer."
        )
    owners = split_bounds(h_in, pr)
    plan = []
    for cell, (o0, o1) in enumerate(split_bounds(h_out, pr)):
        lo = o0 * stride - pad[0]
        hi = (o1 - 1) * stride - pad[0] + k
        r0, r1 = max(lo, 0), min(hi, h_in)
        if r1 < r0:  # windows over padding only (padding of a window or more): no row
            r0 = r1 = lo if lo >= h_in else hi
        pieces = tuple((owner, max(a, r0), min(b, r1)) for owner, (a, b) in enumerate(owners)
                       if max(a, r0) < min(b, r1))
        plan.append(RowNeed(cell, (o0, o1), (r0, r1), (r0 - lo, hi - r1), pieces))
    return plan


def halo_rows(h_in: int, pr: int, k: int, stride: int = 1, pad: tuple[int, int] = (0, 0)):
    """Total input rows moved between grid rows by one layer's forward halo exchange."""
    return sum(n.halo_rows for n in halo_plan(h_in, pr, k, stride, pad))
