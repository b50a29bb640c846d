"""The process grid and its binding to dask workers.

A :class:`Grid` is an abstract ``Pr x Pc`` mesh: it knows nothing of workers.
A :class:`GridBinding` maps each cell ``(i, j)`` to one worker address of a
running cluster. Row ``i`` of the grid shares block row ``i`` of every weight
(model parallelism over ``Pr``); column ``j`` shares sample block ``j`` of
every activation (batch parallelism over ``Pc``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dask_ipar.cost.planner import factorizations as cost_factorizations
from dask_ipar.errors import IparError

if TYPE_CHECKING:  # pragma: no cover
    from distributed import Client

__all__ = ["Grid", "GridBinding", "parse_grid", "factorizations", "bind_grid"]


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
    return [Grid(pr, pc) for pr, pc in cost_factorizations(p)]


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


def _worker_order(info: dict) -> list[str]:
    """Workers sorted by name (numeric names numerically), then address."""

    def key(item):
        addr, w = item
        name = w.get("name", addr)
        return (0, int(name), addr) if str(name).isdigit() else (1, str(name), addr)

    return [addr for addr, _ in sorted(info.items(), key=key)]


def bind_grid(grid: Grid, client: "Client", workers: list[str] | None = None) -> GridBinding:
    """Bind ``grid`` to the first ``grid.size`` workers of ``client`` (by worker name).

    Raises
    ------
    IparError
        If the cluster has fewer workers than grid cells.
    """
    grid = parse_grid(grid)
    if workers is None:
        from dask_ipar.cluster import scheduler_workers

        workers = _worker_order(scheduler_workers(client))
    if len(workers) < grid.size:
        raise IparError(
            f"grid {grid} needs {grid.size} workers but the cluster has {len(workers)}. "
            f"Start the cluster with at least {grid.size} workers (--workers {grid.size}) "
            f"or choose a smaller grid whose Pr*Pc <= {len(workers)}."
        )
    return GridBinding(grid, tuple(workers[: grid.size]))
