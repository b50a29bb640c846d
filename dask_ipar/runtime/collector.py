"""Python's cycle collector paused around short, allocation-heavy work.

Its one job: :func:`collector_paused`. Building a submission's graph on the client, and
running a worker program, allocate thousands of short-lived containers (tasks, keys,
records of the dashboard's trace); each automatic collection then traverses the young
ones, and some of them are large (a program's trace, its table of blocks), so on a worker
a collection of the youngest generation took about 0.3 ms, and code allocating in a loop
ran up to ten times slower than with the collector off (measured: the dashboard's
grouping of a 16-step program's records, 3.6-3.9 ms against 0.4-0.8 ms). None of that work
makes reference cycles, so reference counting frees it all; the collector runs again when
the last paused block ends (a pending collection at the next allocation).
"""

from __future__ import annotations

import contextlib
import gc
import threading

__all__ = ["collector_paused"]

_lock = threading.Lock()
_depth = 0  # blocks running now, in any thread
_was = False  # whether the collector was on when the first of them began


@contextlib.contextmanager
def collector_paused():
    """The cycle collector off for the block, and as it was once no paused block runs in
    any thread (blocks may nest and overlap across threads: a worker's programs)."""
    global _depth, _was
    with _lock:
        if _depth == 0:
            _was = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was:
                gc.enable()
