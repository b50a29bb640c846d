"""Direct TCP links between workers: the transport of the worker programs' blocks.

Why not dask's comms: a block pushed through ``worker.rpc`` crosses two event loops. The
program's thread hands it to its worker's loop, which writes it; the receiver's loop reads
it, answers, and wakes the program's thread waiting for it: four thread hand-offs and two
loop iterations per hop (0.6-0.9 ms on an emulated link, several times gloo's blocking send
and receive, ``docs/benchmarks.md``). Here a program writes a small message into the peer's
socket itself, and the program waiting for it on the other side reads the socket itself
(:meth:`WireServer.wait`): no event loop and no thread between them (0.08-0.14 ms a hop on
the emulated links, gloo's 0.07-0.12). While no program waits, a background thread reads
the links. A large message, or one while the link is busy, goes to the link's own thread,
so that the program computes on while it is written (sends never wait for the receiver).

What travels: a message of :mod:`dask_ipar.runtime.framing` (a pickle with the blocks'
buffers out of band). The receiver does not answer: the program that waits for the block
is the acknowledgement.

Which messages: those up to :data:`~dask_ipar.runtime.exchange.DIRECT_MAX_BYTES` (the
exchange decides: all of them by default), on plain TCP addresses only: with TLS (a cluster's security settings),
in-process or UCX addresses, :class:`~dask_ipar.runtime.exchange.ExchangePlugin` keeps
dask's comms.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import random
import selectors
import socket
import struct
import threading
import time
from collections import deque

from dask_ipar.runtime.framing import MessageReader, bytes_view, write_message

__all__ = ["WireServer", "Wire", "backoff", "retry_settings", "send_with_retry",
           "DIRECT_BYTES"]

logger = logging.getLogger(__name__)

#: Messages up to this many bytes are written by the sending program's own thread when the
#: link is free (they land in the socket's buffer at once); larger ones, and any while the
#: link is busy, by the link's thread.
DIRECT_BYTES = 1 << 16
#: The background thread reads the links once no program has read them for this long
#: (programs of a step wait for blocks every few milliseconds: waking the background thread
#: each time would cost them CPU and the GIL; a block nobody waits for can wait).
LINGER_S = 0.05


def backoff(attempt: int, dmin: float, dmax: float) -> float:
    """Seconds to wait before retry ``attempt`` (0: at once, then ``dmin``, ``3 * dmin``,
    ... at most ``dmax``, 10 % jitter): the schedule of dask's P2P shuffle retries."""
    delay = min(dmin * (2 ** attempt - 1), dmax)
    return delay * (1 + 0.1 * (2 * random.random() - 1))


def retry_settings() -> tuple[int, float, float]:
    """``(count, delay_min, delay_max)`` of a failed send's retries: dask's P2P shuffle
    settings ``distributed.p2p.comm.retry.*`` (10 retries, 1 s doubling to 30 s)."""
    import dask
    from dask.utils import parse_timedelta

    get = dask.config.get
    return (int(get("distributed.p2p.comm.retry.count")),
            float(parse_timedelta(get("distributed.p2p.comm.retry.delay.min"), default="s")),
            float(parse_timedelta(get("distributed.p2p.comm.retry.delay.max"), default="s")))


async def send_with_retry(op, stopped, what: str, settings=None):
    """``await op()``, retried after a connection error (``OSError``, which dask's closed
    comms are) as dask's P2P shuffle retries: at once, then after ``delay_min``,
    ``3 * delay_min``, ... at most ``delay_max`` apart (10 % jitter), ``count`` times. It
    stops retrying as soon as ``stopped()`` says why (the step was aborted: the peer is
    gone or hung, and the client knows), raising the last error."""
    count, dmin, dmax = retry_settings() if settings is None else settings
    for attempt in range(count + 1):
        try:
            return await op()
        except OSError as exc:
            _give_up(exc, what, attempt, count, stopped())
            await asyncio.sleep(backoff(attempt, dmin, dmax))


def _give_up(exc, what, attempt, count, reason, closing=False) -> None:
    """Raise the error of failed attempt ``attempt`` if it is the last one (``count``
    retries done, or a ``reason`` to stop, or the worker ``closing``); else return."""
    if attempt == count or reason or closing:
        raise OSError(f"{what} failed after {attempt + 1} attempt(s)"
                      + (f" ({reason})" if reason else "") + f": {exc}") from exc


def _shut(sock) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


class WireServer:
    """Accepts links from other workers on ``host`` (a free port) and calls
    ``deliver(frames)`` for each message they bring, from the thread that read it.

    Who reads: a program waiting for blocks reads the links itself (:meth:`wait`): the
    message wakes the waiting thread straight from the socket, with no hand-off between
    threads (a 4-byte hop 0.11 ms instead of 0.17 ms on loopback, interleaved A/B). While
    no program has waited for :data:`LINGER_S`, a background thread reads them, so that
    links never fill up. Both keep a selector over the links; a link is read by one thread
    at a time (its lock), a message at a time, without blocking: its
    :class:`MessageReader` keeps a message that has not wholly come yet, so a peer stopped
    halfway through one holds no reading thread."""

    def __init__(self, host: str, deliver, name: str = "ipar-wire"):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.create_server((host, 0), family=family)
        self.sock.setblocking(False)  # accepted by whichever thread sees it first
        self.port = self.sock.getsockname()[1]
        self.deliver, self.name = deliver, name
        self.lock = threading.Lock()
        self.idle = threading.Condition(self.lock)  # the background thread, while one pumps
        self.plock = threading.Lock()  # one waiting program reads the links at a time
        self.conns: dict = {}  # socket -> (its read lock, its MessageReader)
        self.closed = False
        self.pumper = None  # thread id of the program reading the links now
        self.pumped = 0.0  # when a program last stopped reading them (time.monotonic)
        self._bwake, self._pwake = socket.socketpair(), socket.socketpair()
        self.bsel, self.psel = selectors.DefaultSelector(), selectors.DefaultSelector()
        for sel, wake in ((self.bsel, self._bwake), (self.psel, self._pwake)):
            for end in wake:  # a wake-up never blocks its sender (a full pipe: one is due)
                end.setblocking(False)
            sel.register(self.sock, selectors.EVENT_READ)
            sel.register(wake[0], selectors.EVENT_READ)
        threading.Thread(target=self._background, name=f"{name}-read", daemon=True).start()

    # --------------------------------------------------------------- reading
    def _ready(self, obj) -> None:
        """Act on a readable ``obj`` of a selector: accept, drain a wake-up, or read one
        message (unless another thread is reading that link now)."""
        if obj is self.sock:
            self._accept()
        elif obj is self._bwake[0] or obj is self._pwake[0]:
            try:
                obj.recv(4096)
            except OSError:
                pass
        else:
            rlock, reader = self.conns.get(obj, (None, None))
            if rlock is None or not rlock.acquire(blocking=False):
                return
            try:
                frames = reader.read(obj)
            except BlockingIOError:  # the rest of the message has not come yet (or another
                return  # thread read the message this one was woken for)
            except (OSError, ValueError, OverflowError, MemoryError, struct.error):
                frames = None  # the peer went away mid-message, or garbage
            finally:
                rlock.release()
            if frames is None:
                self._drop(obj)
                return
            # delivered outside the link's lock: two messages of one link may be delivered
            # out of order by two threads; harmless, every block has a key of its own
            try:
                self.deliver(frames)
            except Exception:  # noqa: BLE001 - one bad message must not end the link
                logger.exception("dask-ipar: a block received on %s could not be read",
                                 self.name)

    def _accept(self) -> None:
        try:
            conn, _ = self.sock.accept()
        except OSError:  # another thread took it, or closed
            return
        try:
            conn.setblocking(False)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            _shut(conn)
            return
        with self.lock:
            if self.closed:
                _shut(conn)
                return
            self.conns[conn] = (threading.Lock(), MessageReader())
            for sel in (self.bsel, self.psel):
                sel.register(conn, selectors.EVENT_READ)

    def _drop(self, conn) -> None:
        with self.lock:
            if self.conns.pop(conn, None) is None:
                return
            for sel in (self.bsel, self.psel):
                try:
                    sel.unregister(conn)
                except (KeyError, ValueError, OSError):
                    pass
        _shut(conn)

    def _background(self) -> None:
        while True:
            with self.lock:  # not while programs wait for blocks now and then: wake-ups
                while not self.closed and (self.pumper is not None or  # would cost them
                                           time.monotonic() - self.pumped < LINGER_S):
                    since = time.monotonic() - self.pumped
                    self.idle.wait(LINGER_S if self.pumper is not None else
                                   max(0.001, LINGER_S - since))
                if self.closed:
                    break
            try:
                events = self.bsel.select()
            except (OSError, ValueError):
                break  # closed under it
            for key, _ in events:
                if self.closed or self.pumper is not None:
                    break  # a waiting program reads them
                self._ready_safely(key.fileobj)
        _close_all(self.bsel, *self._bwake)

    def _ready_safely(self, obj) -> None:
        try:
            self._ready(obj)
        except Exception:  # noqa: BLE001 - the reading thread must live on
            logger.exception("dask-ipar: reading the direct links of %s failed", self.name)

    def wait(self, done, timeout: float):
        """Read the links in this (a waiting program's) thread until ``done()`` or
        ``timeout`` seconds: ``done()``'s value, or None at once where another program is
        reading them (wait for its deliveries instead). :meth:`nudge` ends a wait early
        when something arrives by another path."""
        if not self.plock.acquire(blocking=False):
            return None
        with self.lock:
            self.pumper = threading.get_ident()
        try:
            deadline = time.monotonic() + timeout
            while not (ok := done()) and not self.closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                for key, _ in self.psel.select(left):
                    self._ready_safely(key.fileobj)
            return ok
        except (OSError, ValueError):
            return done()  # closed under it
        finally:
            with self.lock:  # the background thread reads again after LINGER_S
                self.pumper, self.pumped = None, time.monotonic()
                closed = self.closed
                if not closed:
                    self.plock.release()
            if closed:  # no more reading programs: this one closes their side
                _close_all(self.psel, *self._pwake)

    def nudge(self) -> None:
        """Wake the program reading the links (something it waits for may have come by
        another path: dask's comms, an abort); nothing if none is, or if it is this thread."""
        p = self.pumper
        if p is not None and p != threading.get_ident():
            try:
                self._pwake[1].send(b"x")
            except OSError:
                pass

    def close(self) -> None:
        with self.lock:
            self.closed = True
            conns, self.conns = list(self.conns), {}
            self.idle.notify_all()
            free = self.plock.acquire(blocking=False)  # kept: no program reads any more
        for wake in (self._bwake, self._pwake):
            try:
                wake[1].send(b"x")
            except OSError:
                pass
        _shut(self.sock)
        for c in conns:
            _shut(c)
        if free:  # else the reading program closes its side
            _close_all(self.psel, *self._pwake)


def _close_all(*things) -> None:
    for t in things:
        try:
            t.close()
        except OSError:
            pass


class _Link:
    """The connection to one peer, its queue of messages and its writing thread."""

    def __init__(self, dest: str):
        self.dest = dest
        self.sock = None
        self.wlock = threading.Lock()  # one writer at a time
        self.cv = threading.Condition()
        self.queue: deque = deque()
        self.thread = None


class Wire:
    """This worker's links to its peers (one per peer, shared by all its programs).

    ``resolve(dest, stopped)`` gives the ``(host, port)`` of worker ``dest``'s
    :class:`WireServer`, or None where it has none (then :meth:`send` returns None and the
    caller uses dask's comms); it raises ``OSError`` where ``dest`` does not answer, and
    at once where ``stopped()`` says why: a dead peer holds a program no longer than the
    client takes to stop its step. ``retry()`` gives ``(count, delay_min, delay_max)`` of a
    failed write's retries (reconnecting each time). A program's thread writes a small
    message itself only into a connected, idle link: connecting (a dead host's timeout)
    is the link thread's work."""

    def __init__(self, resolve, retry, name: str = "ipar-wire"):
        self.resolve, self.retry, self.name = resolve, retry, name
        self.lock = threading.Lock()
        self.links: dict = {}
        self.addrs: dict = {}  # dest -> (host, port) or None, as resolved
        self.closed = False

    def _addr(self, dest, stopped=None):
        with self.lock:
            if dest in self.addrs:
                return self.addrs[dest]
        addr = self.resolve(dest, stopped)
        with self.lock:
            self.addrs[dest] = addr
        return addr

    def send(self, dest: str, frames, stopped, what: str):
        """Write message ``frames`` to ``dest`` without waiting for it to be written:
        a future of the bytes written (or of the error after the retries), or None where
        ``dest`` has no wire. ``stopped()`` says why to stop retrying (None: go on)."""
        try:
            if self._addr(dest, stopped) is None:
                return None
        except OSError:
            pass  # unreachable now (or the step stopped): the link's thread retries
        with self.lock:
            link = self.links.get(dest) or self.links.setdefault(dest, _Link(dest))
        fut = concurrent.futures.Future()
        size = sum(bytes_view(f).nbytes for f in frames)
        if size <= DIRECT_BYTES and link.sock is not None and not link.queue \
                and link.wlock.acquire(blocking=False):
            try:  # the program's own thread: a small write into a free, connected link
                if link.sock is None:  # dropped meanwhile: reconnecting is the thread's
                    raise ConnectionResetError(f"link to {dest} closed")
                fut.set_result(self._write(link, frames, stopped))
                return fut
            except OSError:
                pass  # the link's thread retries it
            finally:
                link.wlock.release()
        with link.cv:
            link.queue.append((frames, fut, stopped, what))
            if link.thread is None:
                link.thread = threading.Thread(target=self._run, args=(link,), daemon=True,
                                               name=f"{self.name}-to-{dest}")
                link.thread.start()
            link.cv.notify()
        return fut

    def _write(self, link, frames, stopped=None) -> int:
        try:
            if link.sock is None:
                addr = self._addr(link.dest, stopped)
                if addr is None:
                    raise ConnectionError(f"{link.dest} no longer accepts direct links")
                sock = socket.create_connection(addr, timeout=10.0)
                sock.settimeout(None)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                link.sock = sock
            return write_message(link.sock, frames)
        except OSError:
            if link.sock is not None:
                _shut(link.sock)
                link.sock = None
            with self.lock:  # the peer may be back on another port: resolve it again
                self.addrs.pop(link.dest, None)
            raise

    def _run(self, link) -> None:
        while True:
            with link.cv:
                while not link.queue and not self.closed:
                    link.cv.wait()
                if self.closed:
                    for _, fut, _, what in link.queue:
                        fut.set_exception(OSError(f"{what}: the worker is closing"))
                    link.queue.clear()
                    return
                frames, fut, stopped, what = link.queue.popleft()
            with link.wlock:
                try:
                    fut.set_result(self._write_retrying(link, frames, stopped, what))
                except BaseException as exc:  # noqa: BLE001 - handed to the program
                    fut.set_exception(exc)

    def _write_retrying(self, link, frames, stopped, what) -> int:
        count, dmin, dmax = self.retry()
        for attempt in range(count + 1):
            try:
                return self._write(link, frames, stopped)
            except OSError as exc:
                _give_up(exc, what, attempt, count, stopped(), self.closed)
                time.sleep(backoff(attempt, dmin, dmax))

    def close(self) -> None:
        with self.lock:
            self.closed = True
            links = list(self.links.values())
        for link in links:
            with link.cv:
                link.cv.notify_all()
            if link.sock is not None:
                _shut(link.sock)
