"""The process grid.

A :class:`Grid` is an abstract ``Pr x Pc`` mesh: it knows nothing of workers.
A :class:`GridBinding` maps each cell ``(i, j)`` to one worker address of a
running cluster (made by :func:`dask_ipar.runtime.workers.bind_grid`). Row ``i`` of
the grid shares block row ``i`` of every weight (model parallelism over ``Pr``);
column ``j`` shares sample block ``j`` of every activation (batch parallelism over
``Pc``).

Next hops: a dense layer's phases on the grid are built in :mod:`dask_ipar.nn.dense`
from the collectives of :mod:`dask_ipar.nn.collectives`; each phase's cost formula is
in :mod:`dask_ipar.cost.model` (:func:`~dask_ipar.cost.model.dense_layer_phases`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from dask_ipar.errors import IparError
from dask_ipar.layout.partition import grid_shapes

__all__ = ["Grid", "GridBinding", "parse_grid", "factorizations"]


@dataclass(frozen=True)
class Grid:
    """A ``pr x pc`` process grid: ``pr`` model/domain parallel, ``pc`` batch parallel.

    >>> Grid(2, 3)
    Grid(2x3)
    >>> Grid(2, 3).size
    6
    """

    pr: int
    pc: int

    def __post_init__(self):
        for name in ("pr", "pc"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise IparError(
                    f"Grid {name} must be a positive integer, got {v!r}. "
                    "Use e.g. Grid(2, 2) or parse_grid('2x2')."
                )

    @property
    def size(self) -> int:
        """Number of processes ``P = pr * pc``."""
        return self.pr * self.pc

    def cells(self):
        """All cells ``(i, j)`` in row-major order."""
        return [(i, j) for i in range(self.pr) for j in range(self.pc)]

    def __repr__(self) -> str:
        return f"Grid({self.pr}x{self.pc})"

    def __str__(self) -> str:
        return f"{self.pr}x{self.pc}"


def parse_grid(text: str | Grid | tuple[int, int]) -> Grid:
    """Parse ``"PRxPC"`` (also ``"PR,PC"``) into a :class:`Grid`.

    >>> parse_grid("2x4")
    Grid(2x4)
    """
    if isinstance(text, Grid):
        return text
    if isinstance(text, tuple) and len(text) == 2:
        return Grid(int(text[0]), int(text[1]))
    m = re.fullmatch(r"\s*(\d+)\s*[xX,*]\s*(\d+)\s*", str(text))
    if not m:
        raise IparError(
            f"grid {text!r} is not of the form PRxPC; expected for example '2x2' "
            "(2 model-parallel rows times 2 batch-parallel columns)."
        )
    return Grid(int(m.group(1)), int(m.group(2)))


def factorizations(p: int) -> list[Grid]:
    """Every grid with ``pr * pc == p`` by increasing ``Pr``, pure batch (``1 x p``) first:
    the grids, and the order, of :func:`dask_ipar.cost.factorizations` (the planner's).

    >>> factorizations(6)
    [Grid(1x6), Grid(2x3), Grid(3x2), Grid(6x1)]
    """
    if isinstance(p, bool) or not isinstance(p, int) or p < 1:
        raise IparError(f"number of processes must be a positive integer, got {p!r}")
    return [Grid(pr, pc) for pr, pc in grid_shapes(p)]


@dataclass(frozen=True)
class GridBinding:
    """A grid bound to worker addresses: cell ``(i, j)`` runs on ``workers[i * pc + j]``."""

    grid: Grid
    workers: tuple[str, ...]

    def __post_init__(self):
        if len(self.workers) != self.grid.size:
            raise IparError(
                f"grid {self.grid} needs P = {self.grid.pr}*{self.grid.pc} = "
                f"{self.grid.size} workers, got {len(self.workers)} addresses."
            )
        if len(set(self.workers)) != len(self.workers):
            raise IparError("each grid cell needs its own worker; addresses repeat.")

    def worker(self, i: int, j: int) -> str:
        """Address of the worker that owns cell ``(i, j)``."""
        return self.workers[i * self.grid.pc + j]

    def row(self, i: int) -> list[str]:
        return [self.worker(i, j) for j in range(self.grid.pc)]

    def column(self, j: int) -> list[str]:
        return [self.worker(i, j) for i in range(self.grid.pr)]

    @classmethod
    def placeholder(cls, grid) -> "GridBinding":
        """``grid`` bound to addresses no worker listens on: for building graphs only
        (the step-time simulation, graph tests)."""
        grid = parse_grid(grid)
        return cls(grid, tuple(f"tcp://10.255.{k // 250}.{k % 250 + 1}:1"
                               for k in range(grid.size)))
