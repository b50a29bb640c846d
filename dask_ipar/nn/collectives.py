"""The collectives of a step graph, each along one grid axis, each beside its adjoint.

Every function adds the tasks of one collective to a :class:`~dask_ipar.nn.graph.StepGraph`
and returns the keys its consumers read, and, on a graph that records routes, the words it
routes from cell to cell (:class:`~dask_ipar.nn.graph.Route`), computed from the same block
bounds the tasks cut. A layer's phases read as collectives around local kernels: a dense layer's
forward is "all-gather (weights over Pc, activations over Pr), local matmul"; its backward
"local dZ, reduce-scatter (dX over Pr, dW over Pc)".

``over`` names the grid axis a collective runs along, and so its groups of cells:

* ``"pc"``: within each grid row ``i``, cells ``(i, 0..Pc-1)`` (batch parallelism);
* ``"pr"``: within each grid column ``j``, cells ``(0..Pr-1, j)`` (model or domain
  parallelism);
* ``"all"``: all ``P`` cells, in row-major order (replicated conv weights).

A group of one moves nothing. Pieces are keyed by source and destination:
``(name, src_i, dst_i, j)`` over ``"pr"``, ``(name, i, src_j, dst_j)`` over ``"pc"`` and
``(name, *src, *dst)`` over ``"all"``.

=================== ============================== ==========================================
collective          what each cell ends with       adjoint
=================== ============================== ==========================================
:func:`all_gather`  every block of its group       :func:`reduce_scatter` (sum of the copies)
:func:`reduce_scatter` its block of the group's    :func:`all_gather`
                    summed partials
:func:`all_to_all`  its part of every block of     :func:`all_to_all` with the cuts swapped
                    its group (a re-split)         (a permutation: adjoint = inverse)
:func:`halo_exchange` its rows plus the halo rows  :func:`ghost_accumulate` (ghost-row
                    of its neighbours              gradients added at their owners)
=================== ============================== ==========================================

The reduce-scatter ends in a task of its caller's (the dX sum, the fused momentum update):
the caller reads its own partial and then the remote pieces in group order, which fixes the
order of the floating-point sums. tests/test_collectives.py checks ``<A x, y> = <x, A^T y>``
for every pair on every grid up to ``P = 8``, with uneven splits.
"""

from __future__ import annotations

from dask._task_spec import TaskRef

from dask_ipar.kernels import blocks as B
from dask_ipar.nn.graph import StepGraph

__all__ = ["OVER", "groups", "all_gather", "reduce_scatter", "all_to_all", "halo_exchange",
           "ghost_accumulate"]

#: The grid axes a collective can run along.
OVER = ("pr", "pc", "all")


def groups(grid, over: str) -> list[list[tuple[int, int]]]:
    """The groups of cells a collective ``over`` one grid axis runs within."""
    if over == "pr":
        return [[(i, j) for i in range(grid.pr)] for j in range(grid.pc)]
    if over == "pc":
        return [[(i, j) for j in range(grid.pc)] for i in range(grid.pr)]
    if over == "all":
        return [grid.cells()]
    raise ValueError(f"over must be one of {OVER}, got {over!r}")


def _piece_key(name, over, src, dst):
    if over == "pr":
        return (name, src[0], dst[0], src[1])
    if over == "pc":
        return (name, src[0], src[1], dst[1])
    return (name, *src, *dst)


def all_gather(g: StepGraph, binding, over: str, blocks: dict, *, layer: str, phase: str,
               words=None, join=None, name: str | None = None, lead: tuple = (),
               rename: str | None = None, always_join: bool = False, dests=None):
    """Every cell of a group receives the blocks of all its members.

    ``blocks[cell]`` is the key of the cell's block; ``words(cell)`` its size in words.
    Without ``join`` no task is added: the consumer joins the blocks itself (the gather
    ends inside it) and the result is ``{cell: [TaskRef of the group's blocks in group
    order]}``. With ``join``, task ``(name, *cell) = join(*lead, *blocks)`` is added on
    every cell and the result is ``{cell: key}``; a group of one then gets its own block
    (no task) unless ``always_join``. ``rename`` first renames each block in place (an
    ``identity`` task keyed ``(rename, *cell)``), so the moved keys carry the phase's
    name. ``dests`` restricts the receiving cells (a gather to a root).

    Adjoint: :func:`reduce_scatter`, each member summing the slices of the copies.
    """
    words = g.words_of(words)
    if rename is not None:
        for cell, key in blocks.items():
            g.add((rename, *cell), binding.worker(*cell), B.identity, TaskRef(key))
        blocks = {cell: (rename, *cell) for cell in blocks}
    out, pairs = {}, []
    for group in groups(binding.grid, over):
        refs = [TaskRef(blocks[c]) for c in group]
        for dst in group:
            if dests is not None and dst not in dests:
                continue
            if words is not None:
                pairs += [(src, dst, words(src)) for src in group if src != dst]
            if join is None:
                out[dst] = refs
            elif len(group) == 1 and not always_join:
                out[dst] = blocks[dst]
            else:
                g.add((name, *dst), binding.worker(*dst), join, *lead, *refs)
                out[dst] = (name, *dst)
    if words is not None:
        g.route(layer, phase, pairs)
    return out


def reduce_scatter(g: StepGraph, binding, over: str, name: str, piece, *, layer: str,
                   phase: str, words=None) -> dict:
    """Each cell's partial result, cut by destination and sent to each member of its group.

    ``piece(src, dst)`` returns ``(func, *args)``: the task on ``src`` that cuts (or
    computes) its part for ``dst``; ``words(src, dst)`` its size. Returns ``{dst: [TaskRef
    of the pieces from the other members, in group order]}``; the caller's reducing task
    adds them to its own part (first), in that order.

    Adjoint: :func:`all_gather` of the reduced blocks.
    """
    words = g.words_of(words)
    out, pairs = {}, []
    for group in groups(binding.grid, over):
        for dst in group:
            refs = []
            for src in group:
                if src == dst:
                    continue
                key = _piece_key(name, over, src, dst)
                func, *args = piece(src, dst)
                g.add(key, binding.worker(*src), func, *args)
                refs.append(TaskRef(key))
                if words is not None:
                    pairs.append((src, dst, words(src, dst)))
            out[dst] = refs
    if words is not None:
        g.route(layer, phase, pairs)
    return out


def all_to_all(g: StepGraph, binding, over: str, blocks: dict, layer: str, task: str,
               token: str, cut_axis: int, cut, join_axis: int, *, phase: str,
               words=None) -> dict:
    """Re-split blocks within each group: member ``src`` sends part ``cut(src, dst)`` (a
    range ``(a, b)`` along ``cut_axis``) of its block to ``dst``, which joins the parts in
    group order along ``join_axis``.

    ``words(src, dst)`` is the part's size. Parts that move are keyed
    ``<layer>.<task>-<token>``, kept parts ``<layer>.<task>own-<token>``, the joined blocks
    ``<layer>.<task>j-<token>``; returns ``{cell: joined key}``.

    Adjoint: the :func:`all_to_all` that cuts along ``join_axis`` and joins along
    ``cut_axis`` (a permutation of the entries: its adjoint is its inverse).
    """
    words = g.words_of(words)
    name, own = f"{layer}.{task}-{token}", f"{layer}.{task}own-{token}"
    pairs = []
    for group in groups(binding.grid, over):
        for src in group:
            for dst in group:
                key = _piece_key(own if src == dst else name, over, src, dst)
                g.add(key, binding.worker(*src), B.slice_axis, TaskRef(blocks[src]), cut_axis,
                      *cut(src, dst))
                if words is not None and src != dst:
                    pairs.append((src, dst, words(src, dst)))
    out = {}
    for group in groups(binding.grid, over):
        for dst in group:
            key = (f"{layer}.{task}j-{token}", *dst)
            g.add(key, binding.worker(*dst), B.concat_axis, join_axis,
                  *[TaskRef(_piece_key(own if src == dst else name, over, src, dst))
                    for src in group])
            out[dst] = key
    if words is not None:
        g.route(layer, phase, pairs)
    return out


def halo_exchange(g: StepGraph, binding, layer: str, token: str, plan, owners, x_keys, *,
                  row_words=None) -> dict:
    """Each cell's input rows plus the halo rows its windows read from its neighbours.

    ``plan`` is the layer's :func:`~dask_ipar.layout.halo.halo_plan`, ``owners`` the input
    rows of every grid row; only the halo rows travel (``<layer>.xhalo`` pieces, cut on
    their owner), and each cell assembles its rows in one local key (``<layer>.xin``,
    returned per cell) that the forward and backward both read. ``row_words(j)`` is the
    size of one row of column ``j``'s blocks (``C * W * b_j``). Over ``"pr"``.

    Adjoint: :func:`ghost_accumulate`.
    """
    row_words = g.words_of(row_words)
    xhalo, xin_name = f"{layer}.xhalo-{token}", f"{layer}.xin-{token}"
    xin_keys, pairs = {}, []
    for need in plan:
        i = need.cell
        for j in range(binding.grid.pc):
            parts = []
            for q, a, b in need.pieces:
                if q == i and (a, b) == owners[q]:
                    parts.append(TaskRef(x_keys[(q, j)]))
                    continue
                key = (xhalo, i, q, j)
                g.add(key, binding.worker(q, j), B.take_rows, TaskRef(x_keys[(q, j)]),
                      a - owners[q][0], b - owners[q][0])
                parts.append(TaskRef(key))
                if row_words is not None and q != i:
                    pairs.append(((q, j), (i, j), (b - a) * row_words(j)))
            if not parts:  # windows over padding only: no input row, an empty strip
                key = (xhalo, i, i, j)
                g.add(key, binding.worker(i, j), B.take_rows, TaskRef(x_keys[(i, j)]), 0, 0)
                parts.append(TaskRef(key))
            xin = (xin_name, i, j)
            g.add(xin, binding.worker(i, j), B.assemble, *parts)
            xin_keys[(i, j)] = xin
    if row_words is not None:
        g.route(layer, "halo_fwd", pairs)
    return xin_keys


def ghost_accumulate(g: StepGraph, binding, layer: str, token: str, plan, owners, grad_keys,
                     x_keys, *, row_words=None, made=frozenset()) -> dict:
    """The gradient of every row a cell read, sent home and added to its owner's rows.

    ``grad_keys[cell]`` is the gradient of the rows of ``plan``'s need of that cell (a
    backward's result, or its first item); rows owned by a neighbour go back as
    ``<layer>.dxhalo`` pieces and are added there (``<layer>.dx``, returned per cell).
    ``made``: the keys of pieces the caller computed already (a conv's rim first), not
    cut from ``grad_keys``.

    Adjoint: :func:`halo_exchange`.
    """
    row_words = g.words_of(row_words)
    dxhalo, dx_name, zero = (f"{layer}.dxhalo-{token}", f"{layer}.dx-{token}",
                             f"{layer}.dxzero-{token}")
    dx, pairs = {}, []
    for q, (q0, q1) in enumerate(owners):
        for j in range(binding.grid.pc):
            own, ghosts = None, []
            for need in plan:
                for owner, a, b in need.pieces:
                    if owner != q:
                        continue
                    key = (dxhalo, need.cell, q, j)
                    r0 = need.rows[0]
                    if key not in made:
                        g.add(key, binding.worker(need.cell, j), B.rows_slice,
                              TaskRef(grad_keys[(need.cell, j)]), a - r0, b - r0)
                    if need.cell == q and (a, b) == (q0, q1):
                        own = key
                    else:
                        ghosts += [a - q0, TaskRef(key)]
                    if row_words is not None and need.cell != q:
                        pairs.append(((need.cell, j), (q, j), (b - a) * row_words(j)))
            if own is None:  # a cell that reads none or part of its own rows (strides)
                own = (zero, q, j)
                g.add(own, binding.worker(q, j), B.zeros_like, TaskRef(x_keys[(q, j)]))
            key = (dx_name, q, j)
            g.add(key, binding.worker(q, j), B.add_rows, TaskRef(own), *ghosts)
            dx[(q, j)] = key
    if row_words is not None:
        g.route(layer, "halo_bwd", pairs)
    return dx
