"""Workers that keep freed memory (``cluster.reuse_memory``) hand it back when they idle
(:mod:`dask_ipar.runtime.release`)."""

from __future__ import annotations

import time

import pytest

from dask_ipar.config import DEFAULTS
from dask_ipar.runtime.cluster import make_cluster


def _cfg(**cluster):
    import copy

    cfg = copy.deepcopy(DEFAULTS)
    cfg["cluster"].update(cluster)
    return cfg


def _rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * 4096


def _use_and_free(nbytes: int) -> int:
    import numpy as np

    a = np.ones(nbytes // 4, np.float32)  # touched: resident
    del a
    return _rss()


@pytest.mark.parametrize("reuse", [True, False])
def test_idle_workers_hand_kept_memory_back(reuse):
    import platform

    from dask_ipar.runtime.release import IDLE_S, RELEASE_NAME, install_release

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("glibc's malloc settings only")
    n = 256 * 2**20
    with make_cluster(_cfg(dashboard=False, reuse_memory=reuse), 1) as client:
        install_release(client)
        (w,) = client.scheduler_info()["workers"]
        trims = lambda: client.run(  # noqa: E731
            lambda dask_worker: (dask_worker.plugins[RELEASE_NAME].trim is not None,
                                 dask_worker.plugins[RELEASE_NAME].trims))[w]
        (base,) = client.run(_rss).values()
        after = client.submit(_use_and_free, n, pure=False).result()  # a task: activity
        kept_now = after - base
        time.sleep(IDLE_S * 2)
        (later,) = client.run(_rss).values()
        active, count = trims()
    if reuse:  # kept while it might be reused, handed back once the worker idled
        assert active and count >= 1
        assert kept_now > 0.75 * n, (base, after)
        assert later - base < 0.25 * n, (base, later)
    else:  # glibc hands it back at once; nothing for the plugin to do
        assert not active and count == 0
        assert kept_now < 0.25 * n, (base, after)


def test_memory_kept_before_the_plugin_came_is_handed_back_too():
    """``calibrate`` (or another model's run) may leave kept memory before any grid is
    bound: the plugin installed afterwards hands it back once the worker idles."""
    import platform

    from dask_ipar.runtime.release import IDLE_S, install_release

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("glibc's malloc settings only")
    n = 256 * 2**20
    with make_cluster(_cfg(dashboard=False, reuse_memory=True), 1) as client:
        (base,) = client.run(_rss).values()
        after = client.submit(_use_and_free, n, pure=False).result()  # no plugin yet
        install_release(client)
        time.sleep(IDLE_S * 2)
        (later,) = client.run(_rss).values()
    assert after - base > 0.75 * n, (base, after)
    assert later - base < 0.25 * n, (base, later)


@pytest.mark.fast
def test_release_is_installed_once_per_cluster_even_at_a_reused_address():
    """An emulated sweep starts its 4- and 8-host schedulers at one address: the second
    cluster's workers need the plugin too (keyed by the scheduler's id)."""
    import uuid

    from dask_ipar.runtime.release import RELEASE_NAME, install_release

    calls = []

    class FakeClient:
        def __init__(self, sid):
            self.sid = sid
            self.scheduler = type("S", (), {"address": "tcp://10.213.0.1:8786"})()

        def scheduler_info(self):
            return {"id": self.sid}

        def register_plugin(self, plugin, name):
            calls.append((self.sid, name))

    first, second = (f"Scheduler-{uuid.uuid4()}" for _ in range(2))
    for sid in (first, first, second, second):
        install_release(FakeClient(sid))
    assert calls == [(first, RELEASE_NAME), (second, RELEASE_NAME)]
