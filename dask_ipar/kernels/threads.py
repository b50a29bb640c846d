"""Element-wise passes of a kernel shared among the threads its process may use.

A worker with several cores multiplies on all of them (its BLAS threads) but NumPy's
element-wise passes run on the calling thread alone: on a 1x1 grid of the 4096-wide MLP
they (momentum SGD's passes over the weights, the activations) were 7-8% of the program
thread's samples (py-spy, sessions 39 and 40) while PyTorch's optimizer used both cores. :func:`over_rows`
shares the row slices of such a pass among :func:`kernel_threads` threads: each slice is
computed exactly as before, by one thread, so the results are the same bits (NumPy's ufuncs
release the GIL in their loops). Workers of one thread (the grids' usual worker) run the
slices on the calling thread, as before.

Written here rather than taken from a library: the passes are NumPy ufuncs on views, which
need nothing but threads; numexpr or numba would compile them anew and add a dependency.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

__all__ = ["SLICE_BYTES", "kernel_threads", "over_rows", "by_rows"]

#: Bytes of a row slice of the element-wise passes on NumPy blocks (stays in cache).
SLICE_BYTES = 1 << 18

_pool: ThreadPoolExecutor | None = None
_lock = threading.Lock()


def kernel_threads() -> int:
    """The threads this process's kernels may use: its BLAS thread count
    (``OMP_NUM_THREADS``, which the clusters dask-ipar starts set to each worker's cores, and
    dask's nannies to 1 otherwise), at most the CPUs this process may run on; 1 where unset."""
    try:
        n = int(os.environ.get("OMP_NUM_THREADS", "1"))
    except ValueError:
        return 1
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on every platform
        cpus = os.cpu_count() or 1
    return max(1, min(n, cpus))


def _executor() -> ThreadPoolExecutor:
    """The process's one pool (its threads start as calls need them, at most one per CPU:
    never resized, so concurrent calls never meet a pool being shut down)."""
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=os.cpu_count() or 1,
                                       thread_name_prefix="ipar-kernel")
        return _pool


def over_rows(fn, r0: int, r1: int, step: int, threads: int | None = None) -> None:
    """``fn(s0, s1, t)`` for every slice ``s0:s1`` of ``step`` rows of ``r0:r1``.

    With ``threads`` (default :func:`kernel_threads`) above 1 and at least two slices per
    thread, thread ``t`` (0 the calling thread) takes a run of consecutive slices; ``t``
    names the thread's own scratch buffers. Returns when all are done; the first error of
    any thread is raised."""
    slices = [(s, min(s + step, r1)) for s in range(r0, r1, step)]
    n = min(kernel_threads() if threads is None else threads, len(slices) // 2)
    if n <= 1:
        for s0, s1 in slices:
            fn(s0, s1, 0)
        return
    per = -(-len(slices) // n)
    runs = [slices[k * per:(k + 1) * per] for k in range(n)]

    def run(t):
        for s0, s1 in runs[t]:
            fn(s0, s1, t)

    futures = [_executor().submit(run, t) for t in range(1, n) if runs[t]]
    try:
        run(0)
    finally:
        for f in futures:
            f.result()


def by_rows(x, fn) -> None:
    """``fn(r0, r1, t)`` over ``x``'s rows: on NumPy matrices by :func:`over_rows`, a slice
    of about :data:`SLICE_BYTES` at a time; other arrays once, on all rows (``t`` 0)."""
    if isinstance(x, np.ndarray) and x.ndim == 2 and x.shape[0] > 1:
        over_rows(fn, 0, x.shape[0], max(1, SLICE_BYTES // max(1, x.shape[1] * x.itemsize)))
    else:
        fn(0, x.shape[0], 0)
