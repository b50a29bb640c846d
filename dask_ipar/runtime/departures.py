"""Hearing at once that a grid worker left the cluster: the scheduler's per-worker events.

When the scheduler removes a worker (its process died, its connection broke, it was
retired) it logs a ``remove-worker`` event on the topic named by the worker's address
(``Scheduler.remove_worker`` -> ``log_event``). A client subscribed to that topic
(``Client.subscribe_topic``, public API) hears it within milliseconds, where polling the
scheduler's worker list would hear it at the next poll. :class:`Departures` subscribes a
client to the topics of the grid workers it waits on, so that
:meth:`~dask_ipar.runtime.state.BlockStore.wait_alive` wakes as soon as one leaves (its
step's programs wait for the dead worker's blocks and would otherwise fail only at the
next liveness check, ``liveness_check_s`` later), and the run recovers at once.

One instance per client (:func:`departures`): dask keeps one handler per topic and
client, so two models of one client share it. The topics are a worker's own: dask logs
only its add, close and remove events there (a handler of the user's own on a grid
worker's topic, on the client that trains, would be replaced).
"""

from __future__ import annotations

import threading
import weakref

__all__ = ["Departures", "departures"]

_LOCK = threading.Lock()
_BY_CLIENT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # client -> Departures


class Departures:
    """The grid workers a client's scheduler has removed, as its events say."""

    def __init__(self, client):
        self.client = weakref.ref(client)  # the client keeps this (its handlers) alive
        self.lock = threading.Lock()
        self.topics: set = set()  # worker addresses subscribed to
        self.left: set = set()  # workers the scheduler removed

    def watch(self, workers) -> None:
        """Hear of the removal of each of ``workers`` from now on."""
        with self.lock:
            new = [w for w in workers if w not in self.topics]
            self.topics.update(new)
        client = self.client()
        for w in new if client is not None else ():
            client.subscribe_topic(w, lambda event, w=w: self._on_event(w, event))

    def _on_event(self, worker, event) -> None:
        _, msg = event
        action = msg.get("action") if isinstance(msg, dict) else None
        if action == "remove-worker":
            with self.lock:
                self.left.add(worker)
        elif action == "add-worker":  # back at the same address (a fixed port)
            with self.lock:
                self.left.discard(worker)

    def gone(self, workers) -> list:
        """Those of ``workers`` the scheduler has removed (as far as its events came)."""
        with self.lock:
            return [w for w in workers if w in self.left]


def departures(client) -> Departures:
    """The :class:`Departures` of ``client`` (made on first use)."""
    with _LOCK:
        dep = _BY_CLIENT.get(client)
        if dep is None:
            dep = _BY_CLIENT[client] = Departures(client)
        return dep
