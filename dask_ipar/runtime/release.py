"""Kept memory handed back when a worker idles (``cluster.reuse_memory``).

Workers started with :data:`dask_ipar.runtime.worker_env.REUSE_MEMORY_ENV` keep every array's
freed memory for the next step's arrays: during training that spares each step the page
faults of fresh memory. Kept after training, the same memory is lost to everything else on
the host (another model, the next job, a peer process: an emulated 8-host sweep's PyTorch
ranks were killed for memory while idle dask workers held 1.6 GB each). This worker plugin
hands it back: a worker that has run nothing for :data:`IDLE_S` seconds (no task executing,
no worker program running or waiting, no task changing state) calls glibc's
``malloc_trim(0)`` once, which returns every free page of the heap to the system.

Written here because neither dask nor glibc does it: dask leaves trimming to the user
(``client.run`` of ``malloc_trim``, its "memory not released back to the OS" docs), and
glibc trims only the heap's top beyond ``MALLOC_TRIM_THRESHOLD_``, which these workers set
out of reach. Client side: :func:`install_release`, once per scheduler, when a grid is bound.
"""

from __future__ import annotations

import ctypes
import os
import platform
import time

from distributed.diagnostics.plugin import WorkerPlugin

__all__ = ["MemoryRelease", "install_release", "IDLE_S", "RELEASE_NAME"]

#: Seconds a worker must idle before its kept memory goes back (longer than the pause
#: between a run's submissions, shorter than a user waits for memory after a run).
IDLE_S = 2.0
#: Name of the worker plugin.
RELEASE_NAME = "dask-ipar-release"

_INSTALLED: set = set()


def _malloc_trim():
    """glibc's ``malloc_trim`` where this process keeps freed memory (the reuse settings),
    else None: nothing to hand back that glibc would not hand back itself."""
    from dask_ipar.runtime.worker_env import REUSE_MEMORY_ENV

    if platform.libc_ver()[0] != "glibc":
        return None
    keep = REUSE_MEMORY_ENV["MALLOC_TRIM_THRESHOLD_"]
    if os.environ.get("MALLOC_TRIM_THRESHOLD_") != keep:
        return None
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None


class MemoryRelease(WorkerPlugin):
    """Worker plugin: ``malloc_trim(0)`` once the worker has idled :data:`IDLE_S` seconds
    since it last ran something (see the module)."""

    name = RELEASE_NAME
    idempotent = True

    def setup(self, worker):
        self.worker = worker
        self.trim = _malloc_trim()
        self.activity = 0  # task transitions seen
        self.seen = -1
        self.quiet_since = time.monotonic()
        self.trimmed = True  # nothing kept yet worth a call
        self.trims = 0
        self.callback = None
        if self.trim is not None:
            from tornado.ioloop import PeriodicCallback

            self.callback = PeriodicCallback(self.check, IDLE_S * 1000 / 4)
            self.callback.start()

    def teardown(self, worker):
        if self.callback is not None:
            self.callback.stop()

    def transition(self, key, start, finish, **kwargs):
        self.activity += 1

    def check(self) -> None:
        """One look (the worker's event loop, every quarter of :data:`IDLE_S`)."""
        now = time.monotonic()
        state = self.worker.state
        if state.executing_count or state.long_running or self.activity != self.seen:
            self.seen, self.quiet_since, self.trimmed = self.activity, now, False
        elif not self.trimmed and now - self.quiet_since >= IDLE_S:
            self.trim(0)
            self.trimmed = True
            self.trims += 1


def install_release(client) -> None:
    """Register :class:`MemoryRelease` on ``client``'s workers (and those that join later),
    once per cluster (:func:`dask_ipar.runtime.worker_env.cluster_key`: an emulated sweep
    starts its 4- and 8-host schedulers at one address)."""
    from dask_ipar.runtime.worker_env import cluster_key

    key = cluster_key(client)
    if key in _INSTALLED:
        return
    done = client.register_plugin(MemoryRelease(), name=RELEASE_NAME)
    if hasattr(done, "close") and hasattr(done, "send"):  # an asynchronous client: not here
        done.close()
        return
    if key:
        _INSTALLED.add(key)
