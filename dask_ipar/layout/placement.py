"""Where the blocks of an activation lie on the grid, as small frozen values.

An NCHW activation of a batch has four axes; on a ``Pr x Pc`` grid each grid axis either
splits one array axis in balanced blocks (:class:`Split`) or holds it whole on every cell
(:class:`Replicated`); a gradient before its reduce-scatter is a partial sum over the grid
axis (:class:`Partial`). A :class:`Placement` says both: what grid rows (``pr``) and grid
columns (``pc``) do to the array. Samples always split over ``Pc``.

The four placements the conv schemes use (:mod:`dask_ipar.nn.schemes`):

================== ============================================ ==========================
placement          cell ``(i, j)`` holds                        scheme that reads it
================== ============================================ ==========================
:data:`STRIPS`     rows ``i`` of the images of sample block j   domain
:data:`WHOLE`      the whole images of sample block j           model (its input)
:data:`CHANNELS`   channels ``i`` of the images of sample       model (its output)
                   block j
:data:`SAMPLES_RC` whole images of sample block i of block j    batch
================== ============================================ ==========================

Pure Python, no dask.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SAMPLE_AXIS", "CHANNEL_AXIS", "ROW_AXIS", "Split", "Replicated", "Partial",
           "Placement", "STRIPS", "WHOLE", "CHANNELS", "SAMPLES_RC"]

#: Axes of an NCHW block.
SAMPLE_AXIS, CHANNEL_AXIS, ROW_AXIS = 0, 1, 2


@dataclass(frozen=True)
class Split:
    """Array axis ``axis`` cut in balanced blocks over one grid axis."""

    axis: int

    def __str__(self) -> str:
        return f"split({('samples', 'channels', 'rows')[self.axis]})"


@dataclass(frozen=True)
class Replicated:
    """Every cell along the grid axis holds the whole array."""

    def __str__(self) -> str:
        return "replicated"


@dataclass(frozen=True)
class Partial:
    """Each cell along the grid axis holds a partial sum of the whole (before a
    reduce-scatter)."""

    def __str__(self) -> str:
        return "partial"


@dataclass(frozen=True)
class Placement:
    """What grid rows (``pr``) and grid columns (``pc``) do to an activation."""

    pr: Split | Replicated | Partial
    pc: Split = Split(SAMPLE_AXIS)

    @property
    def pr_axis(self) -> int | None:
        """The array axis split over ``Pr`` (None when none is)."""
        return self.pr.axis if isinstance(self.pr, Split) else None

    def __str__(self) -> str:
        return f"Pr: {self.pr}, Pc: {self.pc}"


#: Image strips: rows over Pr (domain parallelism).
STRIPS = Placement(Split(ROW_AXIS))
#: Whole images on every cell of a column (a model-parallel conv's input).
WHOLE = Placement(Replicated())
#: Channel blocks over Pr (a model-parallel conv's output).
CHANNELS = Placement(Split(CHANNEL_AXIS))
#: The column's samples split again over Pr, whole images (batch parallelism).
SAMPLES_RC = Placement(Split(SAMPLE_AXIS))
