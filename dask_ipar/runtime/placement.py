"""Batch placement: where each sample block of a batch goes on the grid, and which batch
sizes a grid takes.

Sample block ``j`` (balanced over ``Pc``) goes to every cell of grid column ``j``, in the
layout the network's first layer reads: features x samples for a dense network (the same
block on every cell of the column), image strips (rows ``i`` on cell ``(i, j)``) for a
domain-parallel first conv, whole images for a model-parallel one, and whole images of
sample block ``i`` of the column for a batch-parallel one. The bytes go from the client to
each worker, never between workers.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import numpy as np
from dask._task_spec import TaskRef

from dask_ipar.errors import IparError
from dask_ipar.kernels import blocks as B
from dask_ipar.layout.partition import split_bounds
from dask_ipar.layout.placement import SAMPLES_RC, STRIPS, WHOLE

__all__ = ["place_batch", "min_samples", "check_batch", "batches", "take_sent_bytes",
           "add_sent_bytes", "input_copies", "placement_blocks", "scatter_each"]

#: Bytes of data blocks (features and labels) the client handed to dask per model uid,
#: since :func:`take_sent_bytes` last read them (the comm table's ``input client`` row).
_SENT: dict = {}


def add_sent_bytes(uid: str, nbytes: int) -> None:
    _SENT[uid] = _SENT.get(uid, 0) + int(nbytes)


def take_sent_bytes(uid: str) -> int:
    """Data bytes the client sent to the workers for model ``uid`` since the last call."""
    return _SENT.pop(uid, 0)


def input_copies(engine) -> int:
    """How many copies of a batch's features the cells get: ``Pr`` (every cell of a
    column the column's samples) or 1 (image strips; samples split over the column)."""
    where = None if engine.front is None else engine.front.input_placement
    return 1 if where in (STRIPS, SAMPLES_RC) else engine.grid.pr


def placement_blocks(engine, Xb, xname, bounds):
    """The input blocks ``{(xname, i, j): array}`` of batch ``Xb`` on the engine's grid
    (``bounds``: each grid column's samples), and how many copies of the batch they are."""
    grid = engine.grid
    blocks = {}
    where = None if engine.front is None else engine.front.input_placement
    if where == WHOLE:  # whole images of sample block j on every cell of column j
        for i, j in grid.cells():
            b0, b1 = bounds[j]
            blocks[(xname, i, j)] = np.ascontiguousarray(Xb[b0:b1])
        return blocks, grid.pr
    if where == SAMPLES_RC:  # whole images of sample block i of column j
        engine.front.check_batch(Xb.shape[0])
        sub = engine.front.samples(Xb.shape[0])
        for i, j in grid.cells():
            s0, s1 = sub[j][i]
            b0 = bounds[j][0]
            blocks[(xname, i, j)] = np.ascontiguousarray(Xb[b0 + s0:b0 + s1])
        return blocks, 1
    if where == STRIPS:  # image strips: rows i of sample block j on cell (i, j)
        rows = split_bounds(Xb.shape[2], grid.pr)
        for i, j in grid.cells():
            (b0, b1), (r0, r1) = bounds[j], rows[i]
            blocks[(xname, i, j)] = np.ascontiguousarray(Xb[b0:b1, :, r0:r1])
        return blocks, 1
    # features x samples blocks as transposed views of the samples' rows: no copy here (a
    # transposing copy of a 16 MiB batch took the client 30-60 ms while the workers
    # computed); the kernels take either memory order
    cols = [np.ascontiguousarray(Xb[b0:b1]).T for b0, b1 in bounds]
    for i, j in grid.cells():
        blocks[(xname, i, j)] = cols[j]
    return blocks, grid.pr


def scatter_each(client, per_worker: dict) -> dict:
    """Scatter ``per_worker`` (worker -> ``{key: block}``) straight to each worker under the
    keys given, every worker at once; ``{key: future}``.

    One ``client.scatter`` per worker (dask places one call's data on the workers it is
    given), run side by side on the client's event loop (``asynchronous=True``), so the
    transfers take the time of the slowest worker's link, not the sum over the workers:
    one after the other, each call waits for its worker's answer and the scheduler's
    before the next begins."""
    items = [(worker, blocks) for worker, blocks in per_worker.items() if blocks]
    if not items:
        return {}
    if len(items) == 1:
        worker, blocks = items[0]
        return client.scatter(blocks, workers=[worker], hash=False, direct=True)

    async def one(worker, blocks):
        return await client.scatter(blocks, workers=[worker], hash=False, direct=True,
                                    asynchronous=True)

    async def scatter_all():  # a failed one cancels the others (TaskGroup)
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(one(worker, blocks)) for worker, blocks in items]
        return [t.result() for t in tasks]

    try:
        parts = client.sync(scatter_all)
    except BaseExceptionGroup as group:  # the first error, as one scatter would raise it
        raise group.exceptions[0] from None
    return {key: fut for part in parts for key, fut in part.items()}


def place_batch(engine, client, Xb: np.ndarray, yb, step: int, g, *, uid: str,
                embed_bytes: int, block_module=None, pending=None):
    """Put sample block j of a batch on every cell of grid column j (client to workers).

    Batches up to ``embed_bytes`` travel inside the step's graph ``g`` (one message; the
    labels as arguments of the tasks that read them); larger ones are scattered straight
    to their workers. The blocks are views of ``Xb`` where they can be (serialisation copies
    them); in-process workers would hold the caller's memory itself, so for them the batch
    is copied first. Returns ``(x_keys, y_keys, futures)``: refs per cell of the inputs and
    labels (labels inline when embedded), and the futures of scattered blocks, which the
    caller holds until the graph is submitted. With ``pending`` (a dict) the blocks to
    scatter are added to it, ``{worker: {key: block}}``, instead: the caller scatters the
    blocks of several steps at once (:func:`scatter_each`) before it submits them.
    """
    from dask_ipar.io.lazy import LazyBatch

    if isinstance(Xb, LazyBatch):
        return _place_lazy(engine, client, Xb, yb, step, g, uid, block_module)
    binding = engine.binding
    if engine.in_process:
        Xb = np.array(Xb, copy=True)
        yb = None if yb is None else np.array(yb, copy=True)
    grid = binding.grid
    xname = f"input.x-{uid}-s{step}"
    yname = f"input.y-{uid}-s{step}"
    bounds = split_bounds(Xb.shape[0], grid.pc)
    labs = None if yb is None else [yb[b0:b1] for b0, b1 in bounds]
    blocks, copies = placement_blocks(engine, Xb, xname, bounds)
    embed = Xb.nbytes * copies <= embed_bytes
    # labels of an embedded batch are arguments of the loss tasks themselves: no key of
    # their own, one scheduler task fewer per cell and step (their readers, the loss
    # gradient and statistics tasks, are on their cell; on row 0 both carry a copy,
    # a few bytes per sample, still from the client through the scheduler)
    inline_labels = labs is not None and embed and not block_module
    if labs is not None and not inline_labels:
        for i, j in grid.cells():
            blocks[(yname, i, j)] = labs[j]
    add_sent_bytes(uid, sum(v.nbytes for v in blocks.values())
          + (0 if labs is None or not inline_labels else grid.pr * yb.nbytes))
    futures = {}
    if embed:
        for key, value in blocks.items():
            g.add_data(key, binding.worker(*key[1:]), value)
    else:
        # labels first: dask reads a message's first array into the buffer of its
        # header (at any offset) and each later one into an allocation of its own, so
        # the input block then arrives aligned for BLAS (kernels copy misaligned ones)
        ordered = sorted(blocks.items(), key=lambda kv: kv[0][0] != yname)
        per_worker: dict = {} if pending is None else pending
        for key, value in ordered:
            per_worker.setdefault(binding.worker(*key[1:]), {})[key] = value
        if pending is None:
            futures.update(scatter_each(client, per_worker))
    if block_module:  # each cell copies its block to its GPU: one task, no hop
        for key in blocks:
            g.add((key[0] + "-dev", *key[1:]), binding.worker(*key[1:]), B.to_device,
                  TaskRef(key), block_module)
        xname, yname = xname + "-dev", yname + "-dev"
    x_keys = {(i, j): TaskRef((xname, i, j)) for i, j in grid.cells()}
    if yb is None:
        y_keys = None
    elif inline_labels:
        y_keys = {(i, j): labs[j] for i, j in grid.cells()}
    else:
        y_keys = {(i, j): TaskRef((yname, i, j)) for i, j in grid.cells()}
    return x_keys, y_keys, futures


def _place_lazy(engine, client, Xb, yb, step, g, uid, block_module):
    """:func:`place_batch` for data the cells read themselves (:mod:`dask_ipar.io.lazy`):
    per cell a task on its worker that reads the cell's block (the same samples, rows and
    memory layout as the blocks the client would send)."""
    from dask_ipar.io.lazy import LazyBatch, read_inputs, read_labels

    binding, grid = engine.binding, engine.grid
    xname = f"input.x-{uid}-s{step}"
    yname = f"input.y-{uid}-s{step}"
    where = None if engine.front is None else engine.front.input_placement
    n = Xb.shape[0]
    sub = None
    if where == SAMPLES_RC:
        engine.front.check_batch(n)
        sub = engine.front.samples(n)
    rows = split_bounds(Xb.shape[2], grid.pr) if where == STRIPS else None
    src, held, sent = Xb.of.placed(client, binding, uid)
    add_sent_bytes(uid, sent)
    held = dict(held)
    for i, j in grid.cells():
        take = replace(Xb.take, pc=grid.pc, j=j, sub=None if sub is None else sub[j][i],
                       strip=None if rows is None else rows[i], transpose=where is None)
        g.add((xname, i, j), binding.worker(i, j), read_inputs, TaskRef((src, i, j)), take)
    keys = [(xname, i, j) for i, j in grid.cells()]
    if isinstance(yb, LazyBatch):
        ysrc, yheld, sent = yb.of.placed(client, binding, uid)
        add_sent_bytes(uid, sent)
        held.update(yheld)
        for i, j in grid.cells():
            g.add((yname, i, j), binding.worker(i, j), read_labels, TaskRef((ysrc, i, j)),
                  replace(yb.take, pc=grid.pc, j=j))
    elif yb is not None:  # labels in memory, features read by the cells
        for (i, j), (b0, b1) in zip(grid.cells(), [split_bounds(n, grid.pc)[j]
                                                 for _, j in grid.cells()]):
            g.add_data((yname, i, j), binding.worker(i, j), np.asarray(yb[b0:b1]))
            add_sent_bytes(uid, np.asarray(yb[b0:b1]).nbytes)
    if yb is not None:
        keys += [(yname, i, j) for i, j in grid.cells()]
    if block_module:
        for key in keys:
            g.add((key[0] + "-dev", *key[1:]), binding.worker(*key[1:]), B.to_device,
                  TaskRef(key), block_module)
        xname, yname = xname + "-dev", yname + "-dev"
    x_keys = {(i, j): TaskRef((xname, i, j)) for i, j in grid.cells()}
    y_keys = None if yb is None else {(i, j): TaskRef((yname, i, j)) for i, j in grid.cells()}
    return x_keys, y_keys, held


def min_samples(engine, grid) -> int:
    """Fewest samples a step takes: one per grid column, or per cell with batch-parallel
    conv layers (they split each column's samples over Pr as well)."""
    front = None if engine is None else engine.front
    return grid.size if front is not None and front.has_batch else grid.pc


def check_batch(engine, grid, batch_size, n) -> int:
    """The batch size a step of ``grid`` uses for ``n`` samples, or a clear error."""
    pc = grid.pc
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise IparError(f"batch_size must be a positive integer, got {batch_size!r}.")
    least = min_samples(engine, grid)
    if least > pc and min(batch_size, n) < least:
        raise IparError(
            f"batch size {min(batch_size, n)} is smaller than the {least} cells of grid "
            f"{grid}; the batch-parallel conv layers need a sample on every "
            f"cell. Use a batch of at least {least}."
        )
    if batch_size < pc:
        raise IparError(
            f"batch size {batch_size} is smaller than the grid's Pc = {pc} batch-parallel "
            f"columns; every column needs at least one sample. Use a batch of at least {pc} "
            f"or a grid with Pc <= {batch_size}."
        )
    if n < pc:
        raise IparError(f"{n} samples cannot be split over Pc = {pc} grid columns.")
    return min(batch_size, n)


def batches(engine, grid, X, y, batch_size):
    """Inference batches of ``(X, y)``: ``batch_size`` samples each (None: all at once), a
    tail too short for the grid folded into its neighbour."""
    n = X.shape[0]
    batch = n if batch_size is None else check_batch(engine, grid, batch_size, n)
    pc = min_samples(engine, grid)
    if n < pc:
        raise IparError(f"{n} samples cannot be split over the grid's {pc} "
                        f"{'columns' if pc == grid.pc else 'cells'}.")
    starts = list(range(0, n, batch))
    if len(starts) > 1 and n - starts[-1] < pc:  # fold a too-short tail into its neighbour
        starts.pop()
    for k, s in enumerate(starts):
        e = starts[k + 1] if k + 1 < len(starts) else n
        yield X[s:e], None if y is None else y[s:e]
