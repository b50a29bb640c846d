"""Balanced splits of an axis over the processes of one grid axis.

Pure functions, no dask: block ``k`` of ``n`` items over ``p`` parts has
``n // p + 1`` items for ``k < n % p`` and ``n // p`` otherwise, so sizes
differ by at most one (the layout of ``numpy.array_split``).
"""

from __future__ import annotations

import math

__all__ = ["split_sizes", "split_bounds", "grid_shapes"]


def split_sizes(n: int, p: int) -> tuple[int, ...]:
    """Sizes of the ``p`` balanced blocks of an axis of length ``n``.

    >>> split_sizes(10, 3)
    (4, 3, 3)
    """
    if p < 1:
        raise ValueError(f"number of parts must be >= 1, got {p}")
    q, r = divmod(n, p)
    return tuple(q + 1 if k < r else q for k in range(p))


def split_bounds(n: int, p: int) -> tuple[tuple[int, int], ...]:
    """``(start, stop)`` of each balanced block.

    >>> split_bounds(10, 3)
    ((0, 4), (4, 7), (7, 10))
    """
    out = []
    start = 0
    for size in split_sizes(n, p):
        out.append((start, start + size))
        start += size
    return tuple(out)


def grid_shapes(procs: int) -> list[tuple[int, int]]:
    """All grids ``(Pr, Pc)`` with ``Pr * Pc = procs``, by increasing Pr (not only powers of two)."""
    if isinstance(procs, bool) or not isinstance(procs, int) or procs < 1:
        raise ValueError(f"procs: got {procs!r}; expected a positive integer number of processes")
    small = [d for d in range(1, math.isqrt(procs) + 1) if procs % d == 0]
    divisors = sorted(set(small) | {procs // d for d in small})
    return [(pr, procs // pr) for pr in divisors]
