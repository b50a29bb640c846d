"""Where a dense layer's blocks lie on a grid (:class:`LayerLayout`), which grids its
layers can be split over (:func:`check_dense_grid`), and which cells compute the product
over their own input rows first, apart, while the other rows travel (:func:`own_first`,
:func:`own_dx_first`). Shapes alone decide all of it: the engine builds from it and the
step-time model simulates what the engine builds."""

from __future__ import annotations

from dataclasses import dataclass

from dask_ipar.errors import IparError
from dask_ipar.layout.partition import split_bounds

__all__ = ["LayerLayout", "check_dense_grid", "own_first", "own_dx_first", "OWN_FIRST_MACS"]

#: Multiply-adds of a cell's own-rows product from which a forward task (or the sum of a
#: dX reduce-scatter) is split in two: below it the extra task and pass cost more than the
#: overlap can hide (2**23 is about 0.17 ms of matmul at 100 GFLOP/s).
OWN_FIRST_MACS = 2 ** 23


@dataclass(frozen=True)
class LayerLayout:
    """Sizes and block bounds of one dense layer on a grid."""

    index: int
    name: str
    n_in: int
    n_out: int
    bias: bool
    activation: str
    rows: tuple[tuple[int, int], ...]  # output rows over Pr
    in_rows: tuple[tuple[int, int], ...]  # input rows over Pr (previous layer's rows)
    wcols: tuple[tuple[int, int], ...]  # weight columns (bias included) over Pc

    @property
    def n_cols(self) -> int:
        return self.n_in + int(self.bias)

    def n_decay(self, j: int) -> int:
        """Number of non-bias columns in weight slice ``j`` (weight decay applies to them)."""
        c0, c1 = self.wcols[j]
        return max(0, min(c1, self.n_in) - c0)

    @classmethod
    def build(cls, index, n_in, layer, pr, pc):
        n_cols = n_in + int(layer.bias)
        return cls(
            index=index,
            name=f"dense{index}",
            n_in=n_in,
            n_out=layer.units,
            bias=layer.bias,
            activation=layer.activation,
            rows=split_bounds(layer.units, pr),
            in_rows=split_bounds(n_in, pr),
            wcols=split_bounds(n_cols, pc),
        )


def own_first(grid, lay, xb, i, cols, j) -> bool:
    """Whether cell (i, j)'s forward of ``lay`` computes the product over its own input
    piece (row block ``i`` of the previous layer's output, gathered over the grid column;
    ``xb`` the pieces' row ranges, ``cols`` the samples of each grid column) first, in a
    task of its own, while the column's other pieces travel: where the column's pieces
    are the layer's input rows over Pr, on :func:`own_dx_first`'s condition (the own piece
    is the cell's input rows ``lay.in_rows[i]``)."""
    return len(xb) == grid.pr and own_dx_first(grid, lay, i, cols, j)


def own_dx_first(grid, lay, k, cols, j) -> bool:
    """Whether cell (k, j) computes its own piece of ``lay``'s dX reduce-scatter in a task
    of its own, before the sum that waits for the other cells' pieces (so the update in
    place need not wait for them): on Pr > 1 where that product has at least
    :data:`OWN_FIRST_MACS` multiply-adds."""
    if grid.pr == 1 or cols is None:
        return False
    rows = lay.rows[k][1] - lay.rows[k][0]
    c0, c1 = lay.in_rows[k]
    return rows * (c1 - c0) * cols[j] >= OWN_FIRST_MACS


def check_dense_grid(dense_layers, first: int, grid, sizes=None):
    """Refuse a grid the dense layers cannot be split over: every grid row must own an
    output row of every layer and, once the input sizes are known (``sizes``, the widths
    ``[d_0, ..., d_L]`` of the whole network), every grid column a weight column.
    ``first`` is the index of the first dense layer in the network (for the messages)."""
    for k, lay in enumerate(dense_layers, start=first):
        if lay.units < grid.pr:
            raise IparError(
                f"layer {k} has {lay.units} outputs, fewer than the grid's Pr = {grid.pr} rows; "
                "each grid row must own at least one output row. Use a grid with "
                f"Pr <= {min(l.units for l in dense_layers)}."
            )
        if sizes is not None:
            cols = sizes[k] + int(lay.bias)
            if cols < grid.pc:
                raise IparError(
                    f"layer {k} has {cols} weight columns (inputs + bias), fewer than the "
                    f"grid's Pc = {grid.pc} columns that share its weights. Use a grid with "
                    f"Pc <= {cols}."
                )
