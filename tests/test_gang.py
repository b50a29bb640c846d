"""Gang safety: one training run at a time on a grid worker (``dask-ipar.gang``)."""

from __future__ import annotations

import threading
import time

import dask
import numpy as np
import pytest

from dask_ipar import Dense, Sequential
from dask_ipar.errors import IparError
from dask_ipar.runtime.gang import GangLock, gang_mode
from dask_ipar.runtime.loop import Callback


def _data(n=240, d=12, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, d)), rng.integers(0, 3, n)


def _model(client, grid="1x2"):
    return Sequential([Dense(8, "relu"), Dense(3)], input_dim=12, seed=1).distribute(
        client, grid)


class Hold(Callback):
    """Keeps run A in its first epoch until ``release`` is set; ``started`` once it runs."""

    def __init__(self):
        self.started, self.release = threading.Event(), threading.Event()

    def on_step_end(self, loop, stats):
        self.started.set()
        self.release.wait(60)


def _run_a(a, hold, out):
    X, y = _data()
    out["a"] = a.fit(X, y, epochs=1, batch_size=40, callbacks=[hold])
    out["a_end"] = time.monotonic()


def test_second_run_on_the_same_workers_is_refused_or_waits(client):
    X, y = _data()
    a, b = _model(client), _model(client)
    assert a.binding.workers == b.binding.workers  # the first two workers, both
    hold, out = Hold(), {}
    t = threading.Thread(target=_run_a, args=(a, hold, out))
    t.start()
    try:
        assert hold.started.wait(60)
        with pytest.raises(IparError, match="are training model .*dask-ipar.gang: wait") as e:
            b.fit(X, y, epochs=1, batch_size=40)
        assert a.binding.workers[0] in str(e.value) and "\n" not in str(e.value)
        # a run on other workers is not held up
        others = [w for w in sorted(client.scheduler_info()["workers"])
                  if w not in a.binding.workers][:2]
        c = Sequential([Dense(8, "relu"), Dense(3)], input_dim=12, seed=1).distribute(
            client, "1x2", workers=others)
        assert c.fit(X, y, epochs=1, batch_size=40).steps
        c.close()
    finally:
        hold.release.set()
        t.join()
    # with dask-ipar.gang: wait, B runs once A has ended
    hold2, out2 = Hold(), {}
    t = threading.Thread(target=_run_a, args=(a, hold2, out2))
    t.start()
    try:
        assert hold2.started.wait(60)
        timer = threading.Timer(1.0, hold2.release.set)
        timer.start()
        with dask.config.set({"dask-ipar.gang": "wait"}):
            b.fit(X, y, epochs=1, batch_size=40)
        b_end = time.monotonic()
    finally:
        hold2.release.set()
        t.join()
    assert out2["a_end"] <= b_end
    a.close()
    b.close()


def test_a_dead_clients_lock_is_taken_over(client):
    """A run whose client died (never released) does not block the workers forever."""
    from distributed import Client

    workers = sorted(client.scheduler_info()["workers"])[:2]
    other = Client(client.scheduler.address, set_as_default=False)
    stale = GangLock(other, workers, "model dead")
    stale.acquire()
    other.close()  # dies holding it: no release
    mine = GangLock(client, workers, "model alive")
    mine.acquire()  # takes over at once
    try:
        assert mine.lock is not None
        with pytest.raises(IparError, match="model alive"):
            GangLock(client, workers, "model third").acquire()
    finally:
        mine.release()
    again = GangLock(client, workers, "model after")
    again.acquire()
    again.release()


@pytest.mark.fast
def test_gang_setting_is_checked():
    assert gang_mode() == "error"
    with dask.config.set({"dask-ipar.gang": "sometimes"}), \
            pytest.raises(IparError, match="expected one of error, wait, off"):
        gang_mode()
