"""What one grid cell reads of a batch (:class:`Take`), and the per-process state of the
cells' reads on a worker: each epoch's sample order, the prefetch thread, the decoded
chunks of a shuffle window and the bytes read (drained by the byte meter)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from dask_ipar.layout.partition import split_bounds

__all__ = ["Take", "Cell", "plan_indices", "pool", "count_read", "drain_read_bytes"]


@dataclass(frozen=True)
class Take:
    """What one cell reads of a batch: the batch (``plan`` and ``step``, or samples
    ``start:stop``), then sample block ``j`` of ``pc`` of it, then (optional) samples
    ``sub`` of that block and image rows ``strip``; ``transpose``: features x samples."""

    plan: object = None
    step: int = 0
    start: int = 0
    stop: int = 0
    pc: int = 1
    j: int = 0
    sub: tuple | None = None
    strip: tuple | None = None
    transpose: bool = False

    def positions(self) -> np.ndarray:
        if self.plan is not None:
            pos = plan_indices(self.plan, self.step)
        else:
            pos = np.arange(self.start, self.stop)
        b0, b1 = split_bounds(len(pos), self.pc)[self.j]
        pos = pos[b0:b1]
        if self.sub is not None:
            pos = pos[self.sub[0]:self.sub[1]]
        return pos

    def next(self) -> "Take | None":
        """The same cell's take of the next training step (None: not known here: ``sub``
        depends on the batch size, which changes at the epoch's leftover batch)."""
        if self.plan is None:
            return None
        if self.sub is not None and _batch_len(self.plan, self.step + 1) != _batch_len(
                self.plan, self.step):
            return None
        from dataclasses import replace

        return replace(self, step=self.step + 1)


def _batch_len(plan, step: int) -> int:
    start, stop = plan.span(step)
    return stop - start


_ORDERS: OrderedDict = OrderedDict()
_ORDERS_LOCK = threading.Lock()


def plan_indices(plan, step: int) -> np.ndarray:
    """``plan.indices(step)`` with each epoch's order computed once per process."""
    epoch = step // plan.steps_per_epoch
    with _ORDERS_LOCK:
        order = _ORDERS.get((plan, epoch))
        if order is None:
            order = plan.order(epoch)
            _ORDERS[(plan, epoch)] = order
            while len(_ORDERS) > 2:
                _ORDERS.popitem(last=False)
        else:
            _ORDERS.move_to_end((plan, epoch))
    start, stop = plan.span(step)
    return order[start:stop]


class Cell:
    """What a cell's copy of a data set keeps on its worker: prefetched blocks, the
    decoded chunks of the current shuffle window, and its read counter."""

    def __init__(self):
        self.lock = threading.Lock()
        self.pending: dict = {}
        #: per part of the rows read (a strip: in-process workers share one copy of the
        #: data set between cells) the decoded chunks, oldest first
        self.chunks: dict = {}


_POOL: ThreadPoolExecutor | None = None
_READ_BYTES: dict = {}
_READ_LOCK = threading.Lock()


def pool() -> ThreadPoolExecutor:
    global _POOL
    with _READ_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(1, thread_name_prefix="dask-ipar-prefetch")
        return _POOL


def count_read(tag: str, nbytes: int):
    with _READ_LOCK:
        _READ_BYTES[tag] = _READ_BYTES.get(tag, 0) + int(nbytes)


def drain_read_bytes(prefix: str) -> dict:
    """Bytes read from storage in this process since the last call, per data-set tag
    starting with ``prefix`` (run on each worker by the byte meter)."""
    with _READ_LOCK:
        out = {k: v for k, v in _READ_BYTES.items() if k.startswith(prefix)}
        for k in out:
            del _READ_BYTES[k]
    return out
