"""Pushing a program's blocks to the programs of other workers.

Its one job: :class:`Sender` sends the blocks a worker program makes to the workers whose
programs read them, without the program waiting: small blocks merged into one message per
peer and phase, over the direct links of :mod:`dask_ipar.runtime.wire` where they exist,
else through dask's comms (the ``ipar_put`` handlers of
:class:`~dask_ipar.runtime.exchange.ExchangePlugin`, retried as dask's P2P shuffle
retries). Every message is logged in the plugin's transfer log.
"""

from __future__ import annotations

import asyncio
import time

from dask_ipar.errors import IparError
from dask_ipar.runtime.exchange import MERGE_BYTES, tag_of
from dask_ipar.runtime.framing import pack
from dask_ipar.runtime.wire import send_with_retry

__all__ = ["Sender"]


def _what(items, dest) -> str:
    """What a message of ``items`` ``[(key, value, nbytes)]`` to ``dest`` is, for errors."""
    name = items[0][0][0]
    what = name if len(items) == 1 else f"{len(items)} blocks ({name}, ...)"
    return f"sending {what} to {dest}"


class Sender:
    """Pushes blocks to other workers from a program's thread, without waiting.

    A block of at least :data:`MERGE_BYTES` goes at once, in a message of its own. Smaller
    ones are held per peer while the program pushes blocks without computing in between
    (the blocks it holds at its start) or runs tasks of the same layer and phase, and go
    together, one message per peer (:meth:`release`), before the program runs a task of
    another phase (:meth:`phase`; not before a task known to be short), waits for blocks,
    or flushes: one latency instead of one per block, and never later than the program
    would otherwise have idled.

    Small blocks that only tasks of later steps read (a program of several steps: the
    updated weight slices its peers gather for the next step) are held longer, until the
    program has run its tasks of the block's step (:meth:`release_later`) or flushes them:
    the slices of every layer then go as one message per peer. Nothing of the block's own
    step or earlier can depend on it (a step's tasks read blocks of that step and earlier
    ones only), so every program still reaches the end of that step, and the block goes
    before any task of a later step needs it."""

    def __init__(self, plugin, worker, recorder=None, direct=True, tag=None):
        from distributed.protocol import to_serialize
        from distributed.sizeof import sizeof

        self.plugin, self.worker = plugin, worker
        self.wire = plugin.wire if direct else None  # None: dask's comms
        self.recorder = recorder  # the dashboard's timeline, or None
        self.loop = worker.loop.asyncio_loop
        self._ser, self._sizeof = to_serialize, sizeof
        self.pending: dict = {}  # key -> [concurrent futures]
        self.small: dict = {}  # dest -> [(key, value, nbytes)] held back
        self._phase = None  # layer and phase name of the blocks held back
        self.later: dict = {}  # key -> (step, dests, value, nbytes): held for later steps
        self._later_min = None  # the earliest step in ``later``
        #: the sending program's tag: a program of several steps is stopped under its
        #: first step's tag, which its later steps' blocks do not carry (None: the block's)
        self.tag = tag

    async def _send(self, dest, items):
        """One message to ``dest`` with ``items`` ``[(key, value, nbytes)]``."""
        t0, w0 = time.perf_counter(), time.time()
        tag = self.tag or tag_of(items[0][0])
        me = self.worker.address
        if len(items) == 1:
            key, value, _ = items[0]
            data = self._ser(value)

            async def put():
                return await self.worker.rpc(dest).ipar_put(key=key, data=data, sender=me)
        else:
            # lists, not tuples: an in-process comm unwraps Serialize in lists and dicts only
            many = [[key, self._ser(value)] for key, value, _ in items]

            async def put():
                return await self.worker.rpc(dest).ipar_put_many(items=many, sender=me)

        await send_with_retry(put, lambda: self.plugin.stopped_tag(tag), _what(items, dest))
        self._sent(dest, items, t0, w0)

    def _sent(self, dest, items, t0, w0) -> None:
        """Log a message sent: the transfer log, the dashboard's timeline."""
        self.plugin.log.append((self.worker.address, dest, time.perf_counter() - t0,
                                [(key, nbytes) for key, _, nbytes in items]))
        if self.recorder is not None:
            for key, _, _ in items:
                self.recorder.add(key[0], "send", w0, time.time(), dest)

    def _direct(self, dest, items):
        """Send ``items`` over the direct link to ``dest``: a future, or None (no link)."""
        t0, w0 = time.perf_counter(), time.time()
        tag = self.tag or tag_of(items[0][0])
        f = self.wire.send(dest, pack([(k, v) for k, v, _ in items]),
                           lambda: self.plugin.stopped_tag(tag), _what(items, dest))
        if f is not None:
            f.add_done_callback(lambda f: f.exception() or self._sent(dest, items, t0, w0))
        return f

    def _go(self, dest, items):
        small = sum(n for _, _, n in items) <= self.plugin.direct_bytes
        f = self._direct(dest, items) if self.wire is not None and small else None
        if f is None:
            f = asyncio.run_coroutine_threadsafe(self._send(dest, items), self.loop)
        for key, _, _ in items:
            self.pending.setdefault(key, []).append(f)

    def push(self, key, value, dests, later=None):
        """Send ``value`` of ``key`` to ``dests``; ``later``: the key's step when only tasks
        of later steps read it (held while small, see the class)."""
        nbytes = self._sizeof(value)
        if later is not None and nbytes < MERGE_BYTES:
            self.later[key] = (later, dests, value, nbytes)
            if self._later_min is None or later < self._later_min:
                self._later_min = later
            return
        for d in dests:
            if nbytes < MERGE_BYTES:
                self.small.setdefault(d, []).append((key, value, nbytes))
            else:
                self._go(d, [(key, value, nbytes)])

    def phase(self, name, hold: bool = False) -> None:
        """The program runs a task named ``name`` next: blocks held back from another layer
        or phase go now, unless ``hold`` (the task is known to be short: they go with the
        next release, before the program waits at the latest)."""
        name = name.split("-", 1)[0] if isinstance(name, str) else name
        if name != self._phase:
            if not hold:
                self.release()
            self._phase = name

    def held_before(self, step) -> bool:
        """Whether blocks of a step before ``step`` are held for later steps."""
        return self._later_min is not None and self._later_min < step

    def release_later(self, step=None, keys=None) -> None:
        """Move the blocks held for later steps that are of a step before ``step`` (all
        when None), or among ``keys``, to the small blocks held back: they go with the
        next :meth:`release`, merged per peer."""
        if not self.later:
            return
        if keys is not None:
            go = [k for k in keys if k in self.later]
        else:
            go = [k for k, e in self.later.items() if step is None or e[0] < step]
        for k in go:
            _, dests, value, nbytes = self.later.pop(k)
            for d in dests:
                self.small.setdefault(d, []).append((k, value, nbytes))
        if go:
            self._later_min = min((e[0] for e in self.later.values()), default=None)

    def release(self) -> None:
        """Send the small blocks held back: one message per peer."""
        small, self.small = self.small, {}
        for d, items in small.items():
            self._go(d, items)

    def flush(self, keys=None, tag=None):
        """Wait until the sends of ``keys`` (all when None) are written; raise their errors.
        With ``tag``, stop waiting (IparError) once step ``tag`` is stopped: a send to a
        dead peer would hold this worker's thread through its retries."""
        import concurrent.futures

        self.release_later(keys=keys)  # a block about to be rewritten goes first
        self.release()
        for k in list(self.pending) if keys is None else [k for k in keys if k in self.pending]:
            for f in self.pending.pop(k):
                while True:
                    try:
                        f.result(timeout=0.5)
                        break
                    except concurrent.futures.TimeoutError:
                        reason = None if tag is None else self.plugin.stopped_tag(tag)
                        if reason:
                            raise IparError(f"step {tag} stopped on worker "
                                            f"{self.worker.address}: {reason}") from None

    def abort_peers(self, prog, reason):
        for p in prog.peers:
            if p != self.worker.address:
                asyncio.run_coroutine_threadsafe(self._abort(p, prog.tag, reason), self.loop)

    async def _abort(self, dest, tag, reason):
        try:
            await self.worker.rpc(dest).ipar_abort(tag=tag, reason=reason)
        except Exception:  # noqa: BLE001 - best effort: the peer may be gone
            pass
