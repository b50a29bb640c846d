"""Direct TCP links between workers: the transport of the worker programs' blocks.

Why not dask's comms: a block pushed through ``worker.rpc`` crosses two event loops. The
program's thread hands it to its worker's loop, which writes it; the receiver's loop reads
it, answers, and wakes the program's thread waiting for it: four thread hand-offs and two
loop iterations per hop (0.3 ms on an emulated link, 2.5-4.4x gloo's blocking send and
receive, ``docs/benchmarks.md``). Here a program writes a small message into the peer's
socket itself, and a thread of the receiver, blocked reading that socket, puts the block
into the mailbox and wakes the program: two hand-offs, no event loop. A large message, or
one while the link is busy, goes to the link's own thread, so that the program computes on
while it is written (sends never wait for the receiver).

What travels: a message is a pickle (protocol 5) with the blocks' buffers out of band
(:func:`pack`: NumPy blocks are not copied; CuPy blocks pickle through host memory, as over
dask's TCP comms; 4 us for a small block where :func:`distributed.protocol.dumps` takes
30), framed as dask's TCP comm frames a message (the number of frames and their lengths,
8-byte big-endian each, then the frames). Unpickling trusts the peer, as dask's comms do;
clusters that must not are the ones with TLS. A message is written
once the sender's call returns: the kernel holds a copy, so the block may be updated in
place afterwards. The receiver does not answer: the program that waits for the block is the
acknowledgement.

Which messages: those up to :data:`~dask_ipar.runtime.exchange.DIRECT_MAX_BYTES` (the
exchange decides), on plain TCP addresses only: with TLS (a cluster's security settings),
in-process or UCX addresses, :class:`~dask_ipar.runtime.exchange.ExchangePlugin` keeps
dask's comms.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import pickle
import random
import socket
import struct
import threading
import time
from collections import deque

__all__ = ["WireServer", "Wire", "backoff", "retry_settings", "send_with_retry", "write_message",
           "read_message", "pack", "unpack", "DIRECT_BYTES"]

logger = logging.getLogger(__name__)

#: Messages up to this many bytes are written by the sending program's own thread when the
#: link is free (they land in the socket's buffer at once); larger ones, and any while the
#: link is busy, by the link's thread.
DIRECT_BYTES = 1 << 16


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


def pack(obj) -> list:
    """Frames of ``obj``: its pickle (protocol 5), then its out-of-band buffers."""
    buffers: list = []
    head = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    return [head, *(b.raw() for b in buffers)]


def unpack(frames):
    """The object of :func:`pack`'s ``frames``."""
    return pickle.loads(frames[0], buffers=frames[1:])


def _bytes_view(frame) -> memoryview:
    view = memoryview(frame)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def write_message(sock: socket.socket, frames) -> int:
    """Write ``frames`` as one message on ``sock``; returns the bytes written."""
    views = [_bytes_view(f) for f in frames]
    head = struct.pack(f"!{len(views) + 1}Q", len(views), *(v.nbytes for v in views))
    total = len(head) + sum(v.nbytes for v in views)
    if total <= DIRECT_BYTES:
        sock.sendall(b"".join([head, *views]))  # one system call
    else:
        sock.sendall(head)
        for v in views:
            sock.sendall(v)
    return total


def _read_exact(stream, n: int, eof_ok: bool = False):
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        r = stream.readinto(view[got:])
        if not r:
            if eof_ok and got == 0:
                return None
            raise ConnectionError(f"link closed after {got} of {n} bytes of a message")
        got += r
    return buf


def read_message(stream) -> list | None:
    """The frames (writable ``bytearray``) of the next message on a binary ``stream``
    (``socket.makefile("rb")``), or None where the stream ends between messages."""
    first = _read_exact(stream, 8, eof_ok=True)
    if first is None:
        return None
    (n,) = struct.unpack("!Q", first)
    lengths = struct.unpack(f"!{n}Q", _read_exact(stream, 8 * n))
    return [_read_exact(stream, m) for m in lengths]


def _shut(sock) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


class WireServer:
    """Accepts links from other workers on ``host`` (a free port) and calls
    ``deliver(frames)`` for each message, from the link's reading thread."""

    def __init__(self, host: str, deliver, name: str = "ipar-wire"):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.create_server((host, 0), family=family)
        self.port = self.sock.getsockname()[1]
        self.deliver, self.name = deliver, name
        self.lock = threading.Lock()
        self.conns: set = set()
        self.closed = False
        threading.Thread(target=self._accept, name=f"{name}-accept", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, peer = self.sock.accept()
            except OSError:
                return  # closed
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self.lock:
                if self.closed:
                    _shut(conn)
                    return
                self.conns.add(conn)
            threading.Thread(target=self._read, args=(conn,), daemon=True,
                             name=f"{self.name}-from-{peer[0]}:{peer[1]}").start()

    def _read(self, conn) -> None:
        stream = conn.makefile("rb", buffering=1 << 16)
        try:
            while (frames := read_message(stream)) is not None:
                try:
                    self.deliver(frames)
                except Exception:  # noqa: BLE001 - one bad message must not end the link
                    logger.exception("dask-ipar: a block received on %s could not be read",
                                     self.name)
        except OSError:
            pass  # the peer went away mid-message: it sends the message again on a new link
        finally:
            stream.close()
            with self.lock:
                self.conns.discard(conn)
            _shut(conn)

    def close(self) -> None:
        with self.lock:
            self.closed = True
            conns, self.conns = list(self.conns), set()
        _shut(self.sock)
        for c in conns:
            _shut(c)


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

    ``resolve(dest)`` gives the ``(host, port)`` of worker ``dest``'s
    :class:`WireServer`, or None where it has none (then :meth:`send` returns None and the
    caller uses dask's comms); ``retry()`` gives ``(count, delay_min, delay_max)`` of a
    failed write's retries (reconnecting each time)."""

    def __init__(self, resolve, retry, name: str = "ipar-wire"):
        self.resolve, self.retry, self.name = resolve, retry, name
        self.lock = threading.Lock()
        self.links: dict = {}
        self.addrs: dict = {}  # dest -> (host, port) or None, as resolved
        self.closed = False

    def _addr(self, dest):
        with self.lock:
            if dest in self.addrs:
                return self.addrs[dest]
        addr = self.resolve(dest)
        with self.lock:
            self.addrs[dest] = addr
        return addr

    def send(self, dest: str, frames, stopped, what: str):
        """Write message ``frames`` to ``dest`` without waiting for it to be written:
        a future of the bytes written (or of the error after the retries), or None where
        ``dest`` has no wire. ``stopped()`` says why to stop retrying (None: go on)."""
        try:
            if self._addr(dest) is None:
                return None
        except OSError:
            pass  # unreachable now: the link's thread retries
        with self.lock:
            link = self.links.get(dest) or self.links.setdefault(dest, _Link(dest))
        fut = concurrent.futures.Future()
        size = sum(_bytes_view(f).nbytes for f in frames)
        if size <= DIRECT_BYTES and not link.queue and link.wlock.acquire(blocking=False):
            try:  # the program's own thread: a small write into a free link
                fut.set_result(self._write(link, frames))
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

    def _write(self, link, frames) -> int:
        try:
            if link.sock is None:
                addr = self._addr(link.dest)
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
                return self._write(link, frames)
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
