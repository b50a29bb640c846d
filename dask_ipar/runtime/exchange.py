"""The block exchange of worker programs: mailboxes, the push handler and transfer logs.

Its one job: move blocks between the worker programs of
:mod:`dask_ipar.runtime.programs`. :class:`ExchangePlugin` (one per worker, shared by every
model) adds the ``ipar_put`` handler, through which a program pushes a block to another
worker as soon as it exists (the mechanism of dask's P2P shuffle), and the ``ipar_abort``
handler, through which a failed program stops its peers; received blocks wait in the
plugin's mailbox until a program takes them. Each transfer is logged on its sender
(:func:`drain_exchange_log`, read by :class:`dask_ipar.runtime.meter.CommMeter` like dask's
own transfer logs). Client side: :func:`install_exchange` registers the plugin and
:func:`abort_programs` stops the programs of a model.

Transport: messages travel over direct TCP links between the plugins
(:mod:`dask_ipar.runtime.wire`: no event loop between a program and the socket) where the
workers' addresses are plain ``tcp://``; all with TLS, in-process or UCX addresses, or
``ExchangePlugin(transport="dask")``, through dask's comms (the ``ipar_put`` handlers).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections import deque

from distributed.diagnostics.plugin import WorkerPlugin

from dask_ipar.errors import IparError
from dask_ipar.runtime.framing import unpack
from dask_ipar.runtime.wire import Wire, WireServer, retry_settings

__all__ = ["ExchangePlugin", "PLUGIN_NAME", "TRANSPORTS", "DIRECT_MAX_BYTES", "LOG_LENGTH",
           "install_exchange", "abort_programs", "drain_exchange_log", "KEEP_STEPS", "MERGE_BYTES",
           "tag_of", "plugin_of"]

#: Name of the worker plugin (one per worker, shared by every model).
PLUGIN_NAME = "dask-ipar-exchange"
#: Entries a worker's transfer log of programs keeps (the oldest go first).
LOG_LENGTH = 20_000
#: Blocks below this many bytes that a program sends to the same peer within one phase
#: (consecutive tasks of one layer and phase, such as the pieces of a reduce-scatter) go
#: as one message: one latency instead of several
#: (:meth:`dask_ipar.runtime.sender.Sender.push`).
MERGE_BYTES = 16384
#: A block still in a mailbox when its model has sent blocks of a step this many graph
#: submissions newer is dropped: no program will take it (a late duplicate of a retried
#: send, a block of a program that failed). Steps in flight are at most a few apart.
KEEP_STEPS = 32
#: How blocks travel: ``socket`` (direct TCP links where the addresses allow, else dask's
#: comms) or ``dask`` (dask's comms always).
TRANSPORTS = ("socket", "dask")
#: Messages up to this many bytes take the direct links, larger ones dask's comms: all of
#: them (since session 42; 64 KiB before). The direct links win where latency counts (a
#: 4-byte hop 5x shorter) and, on workers sharing cores, for larger blocks too: each
#: message over dask's comms costs each end about 0.3 ms more CPU (two event loops on its
#: way), and a step sends hundreds. ``benchmarks/ab_transport.py``, interleaved rounds,
#: all messages direct against 64 KiB and up over dask's comms: 8 emulated hosts at 10
#: Gbit/s, 8x1 steps of the CNN 0.412-0.459 s against 0.460-0.555, the compute-bound MLP
#: 1.637-1.655 against 1.701-1.744, the weight-dominated 0.703-0.722 against 0.711-0.779; 4
#: hosts at 1 Gbit/s, the weight-dominated MLP's pure batch 1x4 (blocks of 64 MiB) 7.81-7.84
#: against 8.36-8.99 s. Per worker: ``ExchangePlugin.direct_bytes``.
DIRECT_MAX_BYTES = float("inf")


# ------------------------------------------------------------------ worker side
def tag_of(key):
    """``"<uid>-s<step>"`` of a key ``("<layer>.<task>-<uid>-s<step>", ...)``, else None."""
    name = key[0] if isinstance(key, tuple) else key
    if not isinstance(name, str) or "-" not in name:
        return None
    return name.split("-", 1)[1]


def _stale(aborted, tag) -> bool:
    """Whether a block of step tag ``"<uid>-s<n>"`` (or cut ``"<uid>-c<n>"``) belongs to
    programs of its model that an abort of the whole model stopped: a step or cut no later
    than the newest one the model had made by then (later ones are a restarted model's)."""
    uid, _, rest = (tag or "").rpartition("-")
    entry = aborted.get(uid)
    if not (isinstance(entry, tuple) and entry[2] is not None and rest[1:].isdigit()):
        return False
    step, cut = entry[2]
    return int(rest[1:]) <= (step if rest[0] == "s" else cut if rest[0] == "c" else -1)


def _key(k):
    """A key as msgpack delivers it (lists) back to a tuple."""
    return tuple(_key(x) for x in k) if isinstance(k, list) else k


class ExchangePlugin(WorkerPlugin):
    """Worker plugin: the mailbox, the push handler and the transfer log of programs."""

    name = PLUGIN_NAME
    #: registered once per cluster: another model's registration must not replace (tear
    #: down) the plugin while programs use its mailbox
    idempotent = True

    direct_bytes = DIRECT_MAX_BYTES  # messages up to this size take the direct links

    def __init__(self, transport: str = "socket"):
        if transport not in TRANSPORTS:
            raise IparError(f"unknown block transport {transport!r}; expected one of "
                            f"{', '.join(TRANSPORTS)}.")
        self.transport = transport

    def setup(self, worker):
        self.worker = worker
        self.cond = threading.Condition()
        self.box: dict = {}  # key -> value received and not yet taken
        self.aborted: dict = {}  # tag -> reason (one step), uid -> (reason, when) (a model)
        self.dropped: set = set()  # keys of failed programs: dropped on arrival
        self.closing = False  # the worker is shutting down: waiting programs fail
        self.newest: dict = {}  # model uid -> newest step number seen in a block
        self.events = 0  # counts arrivals, aborts and the closing: a waiting program's news
        self.server = None  # direct links' server (set below): waiting programs read it
        # (sender, receiver, seconds, [(key, nbytes)]) of every block sent: bounded, as
        # nothing drains it when no CommMeter runs (one drains every 32 steps)
        self.log: deque = deque(maxlen=LOG_LENGTH)
        worker.handlers["ipar_put"] = self.put
        worker.handlers["ipar_put_many"] = self.put_many
        worker.handlers["ipar_abort"] = self.abort
        worker.handlers["ipar_wire"] = self.wire_port
        self.server, self.wire = self._open_wire(worker)

    def _open_wire(self, worker):
        """This worker's :class:`~dask_ipar.runtime.wire.WireServer` and outgoing
        :class:`~dask_ipar.runtime.wire.Wire`, or ``(None, None)`` (dask's comms)."""
        from distributed.comm.addressing import parse_address, parse_host_port

        scheme, loc = parse_address(worker.address)
        if self.transport != "socket" or scheme != "tcp":
            return None, None
        host = parse_host_port(loc)[0]
        try:
            server = WireServer(host, self._deliver, name=f"ipar-wire-{worker.address}")
        except OSError:  # e.g. a contact address that is not this host's own
            return None, None
        return server, Wire(self._resolve, retry_settings, name=f"ipar-wire-{worker.address}")

    def wire_port(self):
        """Handler ``ipar_wire``: the port of this worker's direct links (None: none)."""
        return None if self.server is None else self.server.port

    def _resolve(self, dest, stopped=None):
        """``(host, port)`` of ``dest``'s direct links, or None (a worker thread); OSError
        where ``dest`` does not answer (dask's connect timeout), or at once when
        ``stopped()`` says why (a dead peer's connect attempts must not hold a program)."""
        from distributed.comm.addressing import parse_address, parse_host_port

        fut = asyncio.run_coroutine_threadsafe(self.worker.rpc(dest).ipar_wire(),
                                               self.worker.loop.asyncio_loop)
        while not concurrent.futures.wait([fut], timeout=0.05).done:
            if stopped is not None and (why := stopped()):
                fut.cancel()
                raise ConnectionAbortedError(f"asking {dest} for its direct links: {why}")
        port = fut.result()  # its own errors are OSErrors (no answer, a timeout)
        scheme, loc = parse_address(dest)
        return None if port is None or scheme != "tcp" else (parse_host_port(loc)[0], port)

    def _deliver(self, frames):
        """A message of the direct links, in the thread that read it (a waiting program or
        the background reader): ``[(key, block), ...]`` pickled, the blocks' buffers out of
        band (:func:`~dask_ipar.runtime.framing.unpack`)."""
        self.put_many(unpack(frames))

    def teardown(self, worker):
        # a program waiting for blocks would otherwise hold the closing worker's process
        # until its timeout (its thread must end before the process can)
        self._notify(closing=True)
        worker.handlers.pop("ipar_put", None)
        worker.handlers.pop("ipar_put_many", None)
        worker.handlers.pop("ipar_abort", None)
        worker.handlers.pop("ipar_wire", None)
        for end in (self.server, self.wire):
            if end is not None:
                end.close()

    # event-loop side
    def put(self, key=None, data=None, sender=None):
        """One block (handler ``ipar_put``)."""
        return self.put_many([(key, data)], sender)

    def put_many(self, items=(), sender=None):
        """Blocks ``[(key, data), ...]`` of one message, into the mailbox under one lock,
        the waiting programs woken once (handler ``ipar_put_many``; the direct links)."""
        with self.cond:
            for key, data in items:
                key = _key(key)
                tag = tag_of(key)
                if key in self.dropped:
                    self.dropped.discard(key)
                elif tag in self.aborted or _stale(self.aborted, tag):
                    pass  # a late block of a stopped step, or of a stopped model's
                else:
                    self.box[key] = data
                    self._purge(tag)
        self._notify()
        return "OK"

    def _notify(self, closing=False) -> None:
        """Wake the programs waiting for news (a block arrived, a step was stopped, the
        worker closes): those waiting on ``cond`` and the one reading the direct links."""
        with self.cond:
            self.closing = self.closing or closing
            self.events += 1
            self.cond.notify_all()
        if self.server is not None:
            self.server.nudge()

    def _sleep(self, seconds: float) -> None:
        """Wait (holding ``cond``) up to ``seconds`` for news: reading the direct links in
        this thread where no other program does (the block then wakes this thread
        itself), else on ``cond``."""
        if self.server is None:
            self.cond.wait(seconds)
            return
        seen = self.events
        self.cond.release()  # held once: wait() and receive() are never entered holding it
        try:
            pumped = self.server.wait(lambda: self.events != seen or self.closing, seconds)
        finally:
            self.cond.acquire()
        if pumped is not None:
            self.cond.notify_all()  # a program waiting below may read the links now
        elif self.events == seen and self.server.pumper is not None:
            self.cond.wait(seconds)  # the reading program's deliveries (or its leaving)

    def _purge(self, tag) -> None:
        """Drop blocks of the model of ``tag`` older than :data:`KEEP_STEPS` submissions
        before its newest (under ``self.cond``): the mailbox stays bounded."""
        uid, sep, step = (tag or "").rpartition("-s")
        if not sep or not step.isdigit():
            return
        n = int(step)
        if n <= self.newest.get(uid, -1):
            return
        self.newest[uid] = n
        old = []
        for k in self.box:
            u, s, t = (tag_of(k) or "").rpartition("-s")
            if u == uid and s and t.isdigit() and int(t) < n - KEEP_STEPS:
                old.append(k)
        for k in old:
            del self.box[k]

    def abort(self, tag=None, reason=None, model=False, upto=None):
        """Stop the programs of step ``tag`` (or, with ``model``, every program of model
        ``tag`` running now; its blocks of steps and cuts up to ``upto = (step, cut)``
        that arrive later are dropped)."""
        with self.cond:
            self.aborted[tag] = (reason or "aborted", time.monotonic(), upto) if model \
                else reason or "aborted"
            if model:
                gone = [k for k in self.box if (tag_of(k) or "").rsplit("-s", 1)[0] == tag]
            else:
                gone = [k for k in self.box if tag_of(k) == tag]
            for k in gone:
                del self.box[k]
        self._notify()
        return "OK"

    def stopped_tag(self, tag) -> str | None:
        """Why the programs of step ``tag`` were stopped, or None (any thread)."""
        if not tag:
            return None
        with self.cond:
            reason = self.aborted.get(tag)
            if reason is None and _stale(self.aborted, tag):
                reason = self.aborted[tag.rsplit("-s", 1)[0]][0]
            return reason if isinstance(reason, str) else None

    # program side (a worker thread)
    def _stopped(self, tag, started):
        if tag in self.aborted:
            return self.aborted[tag]
        reason, when, _ = self.aborted.get(tag.rsplit("-s", 1)[0], (None, 0.0, None))
        return reason if when >= started else None

    def take_ready(self, keys):
        """Values of those of ``keys`` that have arrived (removed from the mailbox)."""
        with self.cond:  # the mailbox is usually far smaller than what a program awaits
            if len(self.box) < len(keys):
                return {k: self.box.pop(k) for k in [k for k in self.box if k in keys]}
            return {k: self.box.pop(k) for k in keys if k in self.box}

    def wait(self, prog, due, started, last_progress, patience=None):
        """Wait until one of the keys ``due`` arrives (True), or ``patience`` seconds have
        passed (False); raise if the step was aborted or nothing came for ``prog.timeout_s``."""
        give_up = None if patience is None else time.monotonic() + patience
        with self.cond:
            while True:
                reason = self._stopped(prog.tag, started) or (
                    "the worker is shutting down" if self.closing else None)
                if reason:
                    raise IparError(f"step {prog.tag} stopped on worker {prog.worker}: {reason}")
                if any(k in due for k in self.box) if len(self.box) < len(due) \
                        else any(k in self.box for k in due):
                    return True
                if give_up is not None and time.monotonic() >= give_up:
                    return False
                left = prog.timeout_s - (time.monotonic() - last_progress)
                if left <= 0:
                    raise IparError(
                        f"step {prog.tag}: worker {prog.worker} waited {prog.timeout_s:g} s "
                        f"without receiving a block (still due: {len(due)}, e.g. "
                        f"{min(map(str, due))} from {prog.remote[min(due, key=str)]}); a peer "
                        "program is stuck or its worker is gone."
                    )
                self._sleep(max(0.0, min(left, 1.0, (give_up or float("inf"))
                                          - time.monotonic())))

    def receive(self, key, timeout: float):
        """Wait for block ``key`` and take it from the mailbox (IparError after
        ``timeout`` seconds without it)."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while key not in self.box and not self.closing:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._sleep(left)
            if key not in self.box:
                raise IparError(f"block {key} did not arrive on worker {self.worker.address} "
                                f"within {timeout:g} s")
            return self.box.pop(key)

    def drop(self, keys):
        """Forget ``keys``: those here now and those arriving later (a failed program)."""
        missing = object()
        with self.cond:
            for k in keys:
                if self.box.pop(k, missing) is missing:
                    self.dropped.add(k)

    def drain(self) -> list:
        out = []
        while self.log:
            out.append(self.log.popleft())
        return out


def plugin_of(worker):
    plugin = worker.plugins.get(PLUGIN_NAME)
    if plugin is None:
        raise IparError(
            f"worker {worker.address} has no {PLUGIN_NAME} plugin; programs need it on every "
            "worker (Model.distribute installs it; a worker that joined later gets it too)."
        )
    return plugin


# ------------------------------------------------------------------ client side
def install_exchange(client, transport: str = "socket") -> None:
    """Add :class:`ExchangePlugin` to every worker of ``client`` (and to later ones);
    ``transport``: :data:`TRANSPORTS` (once per cluster: a later call changes nothing)."""
    client.register_plugin(ExchangePlugin(transport), name=PLUGIN_NAME)


def _abort_here(uid, reason, upto=None, dask_worker=None):
    plugin = dask_worker.plugins.get(PLUGIN_NAME)
    if plugin is not None:
        plugin.abort(tag=uid, reason=reason, model=True, upto=upto)


def abort_programs(client, uid: str, reason: str, workers=None, upto=None) -> None:
    """Make the waiting programs of model ``uid`` fail with ``reason`` (best effort).

    ``upto = (step, cut)``: the model's newest step and lineage cut; blocks of those or
    earlier ones still on their way are dropped when they arrive (none is left in a
    mailbox)."""
    try:
        if workers is None:  # a dead worker still listed would cost a connect timeout
            from dask_ipar.runtime.workers import scheduler_workers

            workers = list(scheduler_workers(client))
        client.run(_abort_here, uid, reason, upto, workers=workers, on_error="ignore")
    except Exception:  # noqa: BLE001 - the cluster may be going away
        pass


def drain_exchange_log(dask_worker=None) -> list:
    """Pop this worker's program transfer log: ``(sender, receiver, seconds, [(key, n)])``."""
    plugin = dask_worker.plugins.get(PLUGIN_NAME)
    return [] if plugin is None else plugin.drain()
