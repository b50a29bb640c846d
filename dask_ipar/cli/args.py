"""Argument types and small helpers shared by the ``dask-ipar`` subcommands."""

from __future__ import annotations

import argparse
import sys

from dask_ipar.errors import IparError

__all__ = ["eprint", "positive_int", "fraction", "widths", "resolve_grid", "report"]


def eprint(*args):
    print(*args, file=sys.stderr, flush=True)


def positive_int(text):
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return v


def widths(text):
    """``--hidden`` / ``--filters``: comma-separated positive widths; ``none`` for no
    hidden layer (an empty value is refused: it would silently drop every layer)."""
    if text.strip().lower() == "none":
        return []
    try:
        out = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated widths such as 128,64, got {text!r}"
        ) from None
    if not out:
        raise argparse.ArgumentTypeError(
            f"{text!r} names no width; give widths such as 128,64 (or 'none' for no hidden "
            "layer)")
    if any(w < 1 for w in out):
        raise argparse.ArgumentTypeError(f"widths must be positive, got {text!r}")
    return out


def fraction(text):
    """A share in [0, 1), e.g. ``--val-fraction 0.1``."""
    try:
        v = float(text)
    except ValueError:
        v = -1.0
    if not 0 <= v < 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1) such as 0.1, got {text!r}")
    return v


def resolve_grid(grid_text, workers):
    from dask_ipar.layout.grid import Grid, parse_grid

    if grid_text is not None:
        grid = parse_grid(grid_text)
        if workers is not None and workers != grid.size:
            raise IparError(
                f"--grid {grid} has P = Pr*Pc = {grid.size} cells but --workers is {workers}; "
                f"they must agree: use --workers {grid.size} or a grid whose Pr*Pc = {workers}."
            )
        return grid
    return Grid(1, workers or 2)


def report(args, line: str, summary: dict) -> int:
    """End a command: its one result line on stdout, or with ``--json`` the line on stderr
    and ``summary`` as one JSON object on stdout. Returns 0."""
    import json

    if getattr(args, "json", False):
        eprint(line)
        print(json.dumps(summary))
    else:
        print(line)
    return 0
