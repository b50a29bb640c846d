"""The row-parallel output layer: when the engine runs a network's last dense layer that
way, and what it then sends.

A classifier's last layer is narrow (``m`` classes) and wide (``n`` inputs), so on a grid
with ``Pr > 1`` the 1.5D layer of Eq. 8 pays for activations it barely uses: the previous
layer's output (``n x B``) is all-gathered over Pr so that each cell can compute its
``m / Pr`` output rows, and its gradient reduce-scattered back. Run row-parallel
(Megatron's ``RowwiseParallel``; :mod:`dask_ipar.nn.rowpar`), each cell contracts over
the input rows it already holds with the whole (small) weight matrix, and only the
``m x b_j`` partial outputs travel:

=========== ================================================ ===============================
phase       row-parallel                                     1.5D (Eq. 8)
=========== ================================================ ===============================
w_gather    whole ``W`` on every cell, over all P            ``W``'s block row, over Pc
fwd_gather  partials ``m x b_j``, all-gathered over Pr       ``Y``'s rows, over Pr
dx_reduce   none: each cell's input rows are its own         ``n x b_j``, over Pr
dw_reduce   ``W``'s blocks, reduce-scattered over all P      over Pc
=========== ================================================ ===============================

and the previous layer's output is not gathered (its ``fwd_gather`` moves nothing). The
weights stay where the 1.5D layer keeps them (block ``(i, j)``: rows ``i`` over Pr,
columns ``j`` over Pc), so checkpoints, replicas and the optimizer state are the same in
both forms, and each step's graph can take either. The engine takes the row-parallel form
where it moves at least :data:`ROW_PARALLEL_MIN_WORDS` fewer words and needs no more memory
per cell (:func:`row_parallel_output`); it adds messages (the weight phases run over all
P), which only pay off against enough bytes.

Pure Python: no dask.
"""

from __future__ import annotations

from dask_ipar.cost.layers import FC, as_layer_spec
from dask_ipar.cost.machine import Machine
from dask_ipar.cost.model import PhaseCost, _ceil_div, _check_grid, _phase

__all__ = ["ROW_PARALLEL_MIN_WORDS", "row_parallel_output", "row_parallel_phases",
           "row_parallel_words", "dense_form"]

#: Words a row-parallel output layer must save per step before the engine runs it so
#: (1 MiB of float32): its weight phases run over all P cells instead of Pc, a few more
#: messages per cell (a millisecond or more each on the clusters measured,
#: docs/benchmarks.md), which fewer bytes than this do not repay.
ROW_PARALLEL_MIN_WORDS = 2 ** 18


def row_parallel_words(n_in: int, n_out: int, bias: bool, pr: int, pc: int,
                       batch: int) -> tuple[int, int]:
    """``(1.5D, row-parallel)``: the words each form of the last layer moves per step,
    summed over all processes, with the gather of its input that the 1.5D form needs."""
    p, n_w = pr * pc, n_out * (n_in + int(bias))
    split = (pr - 1) * (2 * n_in + n_out) * batch + 2 * (pc - 1) * n_w
    rowpar = 2 * (p - 1) * n_w + pr * (pr - 1) * n_out * batch
    return split, rowpar


def row_parallel_output(n_in: int, n_out: int, bias: bool, pr: int, pc: int, batch,
                        after_dense: bool) -> bool:
    """Whether the engine runs a network's last dense layer (``n_in`` inputs, ``n_out``
    outputs) row-parallel on a ``pr x pc`` grid with ``batch`` samples per step: only
    after another dense layer (``after_dense``: its input rows are then split over Pr),
    on ``Pr > 1``, for a known batch, where the whole ``W`` and a gradient partial of its
    size (what each cell then holds) take no more memory than the gathered input the
    1.5D form holds instead, and where it saves at least :data:`ROW_PARALLEL_MIN_WORDS`
    words (:func:`row_parallel_words`)."""
    if not after_dense or pr == 1 or batch is None:
        return False
    # memory: the whole W and a whole-W gradient partial on every cell, no more than the
    # gathered input the 1.5D form holds (n_in x b_j), so the 1.5D memory bounds it
    if 2 * n_out * (n_in + int(bias)) > n_in * (batch // pc):
        return False
    split, rowpar = row_parallel_words(n_in, n_out, bias, pr, pc, batch)
    return split - rowpar >= ROW_PARALLEL_MIN_WORDS


def row_parallel_phases(fc: FC, pr: int, pc: int, batch: int, machine: Machine, *,
                        name: str | None = None) -> list[PhaseCost]:
    """The phases of a row-parallel output layer (engine convention, exact bytes; the
    table above). Totals over all processes, with ``|W| = m (n + 1)`` (bias included),
    ``P = Pr Pc``:

    - ``w_gather``: ``(P-1) |W|``; each cell receives every block but its own;
    - ``fwd_gather``: ``Pr (Pr-1) m B``; cell ``(i, j)`` receives ``Pr - 1`` partials of
      ``m x b_j``;
    - ``dx_reduce``: nothing;
    - ``dw_reduce``: ``(P-1) |W|``; each owner receives ``P - 1`` pieces of its block.
    """
    fc = as_layer_spec(fc)
    _check_grid(pr, pc, batch)
    name = name or fc.name
    w, m, p = machine.word_bytes, fc.d_out, pr * pc
    n_w, cols = fc.n_params, fc.weight_cols
    bmax = _ceil_div(batch, pc)
    big = _ceil_div(m, pr) * _ceil_div(cols, pc)
    small = (m // pr) * (cols // pc)
    return [
        _phase(name, "fwd_gather", pr, pr * (pr - 1) * m * batch * w, (pr - 1) * m * bmax * w,
               pr - 1, machine),
        _phase(name, "dx_reduce", 1, 0, 0, 0, machine),
        _phase(name, "dw_reduce", p, (p - 1) * n_w * w, (p - 1) * big * w, p - 1, machine),
        _phase(name, "w_gather", p, (p - 1) * n_w * w, (n_w - small) * w, p - 1, machine),
    ]


def dense_form(layer: FC, after_dense: bool, following, pr: int, pc: int,
               batch) -> tuple[bool, bool]:
    """``(row_parallel, gather_output)`` of a dense layer as the engine runs it: whether it
    is the network's last layer run row-parallel (``following``: the layers after it, None
    when not known), and whether its output is gathered (not when the next layer is that
    row-parallel last layer)."""
    if following is None:
        return False, True
    if not following:
        return row_parallel_output(layer.d_in, layer.d_out, layer.bias, pr, pc, batch,
                                   after_dense), True
    nxt = following[0]
    return False, not (len(following) == 1 and isinstance(nxt, FC) and row_parallel_output(
        nxt.d_in, nxt.d_out, nxt.bias, pr, pc, batch, after_dense=True))
