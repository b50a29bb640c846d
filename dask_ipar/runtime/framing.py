"""How the worker programs' messages travel on their direct links
(:mod:`dask_ipar.runtime.wire`): packing, framing, and reading them back.

A message is a pickle (protocol 5) of its blocks' keys, with each NumPy block's bytes in a
frame of its own (its dtype and shape in the pickle) and other values' buffers out of band
(:func:`pack`: NumPy blocks are not copied; CuPy blocks pickle through host memory, as over
dask's TCP comms; 3 us for two small blocks, where NumPy's own pickling takes 14 and
:func:`distributed.protocol.dumps` about 30 for one), framed as dask's TCP comm frames a
message (the number of frames and their lengths, 8-byte big-endian each, then the frames).
Unpickling trusts the peer, as dask's comms do; clusters that must not are the ones with
TLS. A small message to a free link is written
before the sender's call returns (the kernel holds a copy); others are written by the
link's thread from the block's own memory, so a program rewriting a block in place first
waits for its sends (:meth:`~dask_ipar.runtime.sender.Sender.flush`).

Reading: :class:`MessageReader` reads a message a piece at a time and, on a non-blocking
socket, keeps its place where the rest has not come yet (a reading thread never waits on a
peer stopped halfway through a message).
"""

from __future__ import annotations

import pickle
import socket
import struct

import numpy as np

__all__ = ["pack", "unpack", "bytes_view", "write_message", "MessageReader", "read_message",
           "JOIN_BYTES", "MAX_FRAMES", "MAX_MESSAGE_BYTES"]

#: Messages up to this many bytes are joined into one write (one system call).
JOIN_BYTES = 1 << 16


def _raw(value) -> bool:
    """Whether ``value`` travels as its bytes alone: a non-empty C-contiguous NumPy array
    of booleans or numbers (what the programs send)."""
    return (type(value) is np.ndarray and value.flags.c_contiguous and value.size > 0
            and value.dtype.kind in "biufc")


def pack(items) -> list:
    """Frames of ``items`` ``[(key, value), ...]``: a pickle (protocol 5) of the keys and,
    per NumPy block, its dtype and shape, or the value itself (its buffers out of band);
    then the pickle's out-of-band buffers, then the NumPy blocks' bytes, a frame each.
    NumPy's own pickling of an array costs 5 times more (14 us against 3 for two small
    blocks)."""
    entries, raw, buffers = [], [], []
    for key, value in items:
        if _raw(value):
            entries.append((key, value.dtype.str, value.shape))
            raw.append(value.data)
        else:
            entries.append((key, None, value))
    head = pickle.dumps(entries, protocol=5, buffer_callback=buffers.append)
    return [head, *(b.raw() for b in buffers), *raw]


def unpack(frames) -> list:
    """The ``[(key, value), ...]`` of :func:`pack`'s ``frames`` (NumPy blocks over the
    frames' buffers, not copied: writable where the frames are)."""
    rest = iter(frames[1:])  # the pickle takes its out-of-band buffers, the blocks follow
    out = []
    for key, dtype, value in pickle.loads(frames[0], buffers=rest):
        out.append((key, value) if dtype is None
                   else (key, np.frombuffer(next(rest), dtype).reshape(value)))
    return out


def bytes_view(frame) -> memoryview:
    """``frame`` as a flat view of its bytes."""
    view = memoryview(frame)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def write_message(sock: socket.socket, frames) -> int:
    """Write ``frames`` as one message on ``sock``; returns the bytes written."""
    views = [bytes_view(f) for f in frames]
    head = struct.pack(f"!{len(views) + 1}Q", len(views), *(v.nbytes for v in views))
    total = len(head) + sum(v.nbytes for v in views)
    if total <= JOIN_BYTES:
        sock.sendall(b"".join([head, *views]))  # one system call
    else:
        sock.sendall(head)
        for v in views:
            sock.sendall(v)
    return total


#: What a message's header may announce at most: more frames, or more bytes, are garbage.
MAX_FRAMES = 1 << 20
MAX_MESSAGE_BYTES = 1 << 36
#: A frame's buffer starts at most this large and doubles as its bytes come, so that a
#: header announcing far more than arrives costs no more memory than what did arrive.
FIRST_BUFFER_BYTES = 1 << 24


class MessageReader:
    """Reads the messages of one link a piece at a time (the frame count, the frames'
    lengths, then each frame into a buffer of its own: a NumPy ``uint8`` array, not
    cleared first), resumable: on a non-blocking socket it reads what the socket has now
    and keeps its place until the rest comes, so that a peer stopped halfway through a
    message holds no thread. It reads exactly up to the message's end (no read-ahead): a
    readiness check of the socket afterwards tells whether another message waits."""

    __slots__ = ("buf", "got", "need", "stage", "lengths", "frames")

    def __init__(self):
        self._start()

    def _start(self) -> None:
        # stage 0: the frame count, 1: the lengths, 2: the frames
        self.buf, self.got, self.need = bytearray(8), 0, 8
        self.stage, self.lengths, self.frames = 0, (), []

    @property
    def midway(self) -> bool:
        """Whether part of a message has been read."""
        return self.stage > 0 or self.got > 0

    def read(self, sock: socket.socket):
        """The frames of the next message once it is whole, or None where the link ended
        between messages. Raises ``BlockingIOError`` where a non-blocking ``sock`` has no
        more bytes now (what came is kept for the next call), ``ConnectionError`` where
        the link ended mid-message and ``ValueError`` on bytes that are no message."""
        while True:
            while self.got < self.need:
                if self.got == len(self.buf):  # a large frame's buffer grows as it comes
                    self._grow()
                with memoryview(self.buf) as view:
                    r = sock.recv_into(view[self.got:])
                if not r:
                    if not self.midway:
                        return None
                    raise ConnectionError(f"link closed {self.got} bytes into piece "
                                          f"{self.stage} of a message")
                self.got += r
            done = self._next_piece()
            if done is not None:
                return done

    def _next_piece(self):
        """The piece in ``buf`` is whole: make room for the next one, or return the
        message's frames after its last."""
        if self.stage == 0:
            (n,) = struct.unpack("!Q", self.buf)
            if not 0 < n <= MAX_FRAMES:  # a message has its pickle at least
                raise ValueError(f"not a message of dask-ipar's links ({n} frames)")
            self.stage = 1
            self._expect(8 * n)
        elif self.stage == 1:
            self.lengths = struct.unpack(f"!{self.need // 8}Q", self.buf)
            if sum(self.lengths) > MAX_MESSAGE_BYTES:
                raise ValueError(f"not a message of dask-ipar's links "
                                 f"({sum(self.lengths)} bytes)")
            self.stage = 2
        else:
            self.frames.append(self.buf)
        self.got = 0
        if self.stage == 2:
            if len(self.frames) == len(self.lengths):
                frames = self.frames
                self._start()
                return frames
            self._expect(self.lengths[len(self.frames)])
        return None

    def _expect(self, nbytes: int) -> None:
        self.need, self.buf = nbytes, _frame_buffer(min(nbytes, FIRST_BUFFER_BYTES))

    def _grow(self) -> None:
        bigger = _frame_buffer(min(2 * len(self.buf), self.need))
        bigger[:self.got] = self.buf[:self.got]
        self.buf = bigger


def _frame_buffer(nbytes: int):
    """A writable buffer of ``nbytes`` for a frame, not cleared first: the socket fills it
    (a ``bytearray`` is zeroed, one more pass over every byte received: 1.7% of the CPU
    of the compute-bound MLP's steps on 8 workers, ``docs/benchmarks.md``, "Session 45")."""
    return np.empty(nbytes, dtype=np.uint8)


def read_message(sock: socket.socket) -> list | None:
    """The frames (writable buffers) of the next message on a blocking ``sock``, or
    None where the link ends between messages (:class:`MessageReader`, once)."""
    return MessageReader().read(sock)
