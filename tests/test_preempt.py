"""The run's side of preemption notices (:class:`dask_ipar.runtime.preempt.PreemptWatch`)
without a cluster: the end to end checks are in tests/test_faults.py and test_slurm.py."""

from __future__ import annotations

import pytest

from dask_ipar.runtime.preempt import TOPIC, PreemptWatch

pytestmark = pytest.mark.fast


class _Client:
    id = "Client-test"
    cluster = None

    def __init__(self):
        self.handlers, self.meta, self.plugins = {}, {}, []

    def register_plugin(self, plugin, name=None):
        self.plugins.append(name)

    def subscribe_topic(self, topic, handler):
        self.handlers[topic] = handler

    def unsubscribe_topic(self, topic):
        del self.handlers[topic]

    def set_metadata(self, key, value):
        self.meta[tuple(key)] = value


def test_two_runs_on_one_client_each_get_their_own_notices():
    client = _Client()
    a = PreemptWatch(client, ["w1", "w2"], "run-a", grace_s=5.0)
    b = PreemptWatch(client, ["w3"], "run-b", grace_s=5.0)
    a.start()
    b.start()
    assert client.meta[("dask-ipar-preempt", "w3")] == {"run": "run-b", "grace": 5.0,
                                                         "saved": None}
    notify = client.handlers[TOPIC]
    notify((0.0, {"worker": "w2", "why": "SIGTERM", "run": "run-a"}))
    notify((0.0, {"worker": "w3", "why": "SIGTERM", "run": "run-b"}))
    notify((0.0, {"worker": "w9", "why": "SIGTERM", "run": "run-a"}))  # not a grid worker
    assert a.pending() == {"w2": "SIGTERM"} and b.pending() == {"w3": "SIGTERM"}
    a.ack(["w2"], 17)
    assert a.pending() == {} and client.meta[("dask-ipar-preempt", "w2")]["saved"] == 17
    a.close()
    assert TOPIC in client.handlers  # run b still listens
    assert client.meta[("dask-ipar-preempt", "w1")] is None
    b.rebind(["w4"])
    assert client.meta[("dask-ipar-preempt", "w3")] is None
    assert client.meta[("dask-ipar-preempt", "w4")]["run"] == "run-b"
    b.close()
    assert TOPIC not in client.handlers
