"""The direct links of worker programs (dask_ipar.runtime.wire): framing, pickling out of
band, delivery, retries, and that the programs use them on a TCP cluster."""

import socket
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from dask_ipar.errors import IparError
from dask_ipar.runtime.exchange import ExchangePlugin
from dask_ipar.runtime.framing import pack, read_message, unpack, write_message
from dask_ipar.runtime.wire import DIRECT_BYTES, Wire, WireServer



@pytest.mark.fast
def test_pack_keeps_blocks_out_of_band_and_unpacks_writable_equal_arrays():
    c = np.arange(12, dtype=np.float32).reshape(3, 4)
    f = np.asfortranarray(np.arange(6.0).reshape(2, 3))
    strided = np.arange(20, dtype=np.int64)[::3]  # not contiguous: pickled in band
    empty, flags = np.zeros((0, 4)), np.array([True, False])
    items = [(("dense0.act-u-s1", 0, 1), c), (("x-u-s1", 2), (f, strided, 3.5)),
             (("e-u-s1", 0), empty), (("b-u-s1", 0), flags)]
    frames = pack(items)
    # the pickle, the buffers of the values it holds (the Fortran array, the empty block),
    # then the C-contiguous NumPy blocks' own memory
    assert len(frames) == 5
    assert np.shares_memory(np.frombuffer(frames[3], dtype=np.float32), c)
    # as MessageReader hands them on: each frame a NumPy uint8 buffer of its own
    got = unpack([np.frombuffer(memoryview(fr).cast("B"), np.uint8).copy() for fr in frames])
    assert [k for k, _ in got] == [k for k, _ in items]
    assert got[2][1].shape == (0, 4) and got[3][1].dtype == bool
    np.testing.assert_array_equal(got[3][1], flags)
    np.testing.assert_array_equal(got[0][1], c)
    np.testing.assert_array_equal(got[1][1][0], f)
    assert got[1][1][0].flags.f_contiguous
    np.testing.assert_array_equal(got[1][1][1], strided)
    assert got[1][1][2] == 3.5
    got[0][1][0, 0] = -1.0  # received blocks may be updated in place
    assert c[0, 0] == 0.0


@pytest.mark.fast
@pytest.mark.parametrize("size", [4, DIRECT_BYTES + 1, 3 * 2**20])
def test_a_message_arrives_whole_over_a_socket(size):
    a, b = socket.socketpair()
    payload = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)
    frames = [b"head", payload, b""]
    out = {}
    t = threading.Thread(target=lambda: out.update(n=write_message(a, frames)))
    t.start()
    got = read_message(b)
    t.join()
    assert [bytes(g) for g in got] == [b"head", payload.tobytes(), b""]
    assert out["n"] == 8 * 4 + 4 + size
    write_message(a, [b"next"])
    assert [bytes(g) for g in read_message(b)] == [b"next"]  # no read-ahead: one at a time
    a.close()
    assert read_message(b) is None  # the end of the link between messages
    b.close()


def _pair(retry=(0, 0.01, 0.02)):
    box, cv = [], threading.Condition()

    def deliver(frames):
        with cv:
            box.extend(unpack(frames))
            cv.notify_all()

    server = WireServer("127.0.0.1", deliver, name="test-wire")
    addr = {"peer": ("127.0.0.1", server.port)}
    wire = Wire(lambda dest, stopped=None: addr.get(dest), lambda: retry, name="test-wire")
    return server, wire, addr, box, cv


@pytest.mark.fast
def test_small_and_large_blocks_reach_the_peer_and_their_futures_tell_the_bytes():
    server, wire, _, box, cv = _pair()
    try:
        small = np.ones(4, dtype=np.float32)
        large = np.arange(DIRECT_BYTES, dtype=np.float64)  # 8x DIRECT_BYTES: the link's thread
        futs = [wire.send("peer", pack([(("a-u-s1", k), v)]), lambda: None, "test")
                for k, v in enumerate([small, large, small])]
        assert all(f.result(timeout=10) > 0 for f in futs)
        with cv:
            assert cv.wait_for(lambda: len(box) == 3, timeout=10)
        got = dict(box)
        np.testing.assert_array_equal(got[("a-u-s1", 1)], large)
        np.testing.assert_array_equal(got[("a-u-s1", 2)], small)
        assert futs[0].result() < futs[1].result()
    finally:
        wire.close()
        server.close()


@pytest.mark.fast
def test_a_waiting_program_reads_its_block_itself_and_the_background_thread_otherwise():
    """While a thread waits in ``WireServer.wait``, the blocks are read (delivered) by that
    thread: no hand-off between threads; when nobody waits, by the background thread."""
    readers = []
    box, cv = [], threading.Condition()

    def deliver(frames):
        with cv:
            readers.append(threading.get_ident())
            box.extend(unpack(frames))
            cv.notify_all()

    server = WireServer("127.0.0.1", deliver, name="test-wire")
    wire = Wire(lambda dest, stopped=None: ("127.0.0.1", server.port), lambda: (0, 0.01, 0.02),
                name="t")
    try:
        wire.send("peer", pack([(("a-u-s1", 0), 0)]), lambda: None, "t").result(10)
        with cv:  # nobody waits: the background thread reads it
            assert cv.wait_for(lambda: len(box) == 1, timeout=10)
        assert readers == [readers[0]] and readers[0] != threading.get_ident()

        def later():
            time.sleep(0.2)
            wire.send("peer", pack([(("a-u-s1", 1), 1)]), lambda: None, "t")
        threading.Thread(target=later).start()
        t0 = time.monotonic()
        assert server.wait(lambda: len(box) == 2, timeout=10) is True
        assert time.monotonic() - t0 < 5
        assert readers[1] == threading.get_ident()  # this thread read it

        # another thread reading the links: this one is told to wait on its deliveries
        hold = threading.Event()
        other = threading.Thread(target=server.wait, args=(hold.is_set, 10))
        other.start()
        time.sleep(0.1)
        assert server.wait(lambda: False, timeout=0.1) is None
        hold.set()
        server.nudge()  # ends the other thread's wait at once
        other.join(timeout=5)
        assert not other.is_alive()
        assert server.wait(lambda: False, timeout=0.05) is False  # a wait that times out
        # a close ends a wait at once
        threading.Timer(0.2, server.close).start()
        t0 = time.monotonic()
        assert server.wait(lambda: False, timeout=10) is False
        assert time.monotonic() - t0 < 5
    finally:
        wire.close()
        server.close()


@pytest.mark.fast
def test_a_peer_without_direct_links_gets_none_so_dask_comms_carry_the_block():
    server, wire, _, _, _ = _pair()
    wire.resolve = lambda dest, stopped=None: None  # the peer's answer: no port
    try:
        assert wire.send("peer", pack([]), lambda: None, "test") is None
    finally:
        wire.close()
        server.close()


@pytest.mark.fast
def test_a_send_to_a_closed_peer_is_retried_then_stops_with_the_reason():
    server, wire, addr, _, _ = _pair(retry=(50, 0.01, 0.02))
    server.close()
    stop = {"why": None}
    try:
        fut = wire.send("peer", pack([(("a-u-s1", 0), np.zeros(3))]), lambda: stop["why"],
                        "sending a to peer")
        time.sleep(0.1)
        stop["why"] = "worker peer is gone"
        with pytest.raises(OSError, match=r"sending a to peer failed after \d+ attempt\(s\) "
                                          r"\(worker peer is gone\)"):
            fut.result(timeout=10)
    finally:
        wire.close()


@pytest.mark.fast
def test_a_peer_back_on_another_port_is_found_again():
    server, wire, addr, box, cv = _pair(retry=(20, 0.01, 0.05))
    try:
        assert wire.send("peer", pack([(("a-u-s1", 0), 1)]), lambda: None, "t").result(10)
        server.close()
        again, _, _, box2, cv2 = _pair()
        addr["peer"] = ("127.0.0.1", again.port)
        # the old connection may take a write or two to fail; the block arrives in the end
        for k in range(1, 4):
            wire.send("peer", pack([(("a-u-s1", k), k)]), lambda: None, "t").result(timeout=10)
        with cv2:
            assert cv2.wait_for(lambda: ("a-u-s1", 3) in dict(box2), timeout=10)
        again.close()
    finally:
        wire.close()
        server.close()


@pytest.mark.fast
def test_the_plugin_opens_direct_links_on_tcp_only():
    with pytest.raises(IparError, match="unknown block transport 'udp'"):
        ExchangePlugin("udp")
    for address, transport, opened in [("tls://127.0.0.1:1", "socket", False),
                                       ("inproc://x/1", "socket", False),
                                       ("tcp://127.0.0.1:1", "dask", False),
                                       ("tcp://127.0.0.1:1", "socket", True)]:
        plugin = ExchangePlugin(transport)
        plugin.setup(SimpleNamespace(handlers={}, address=address))
        try:
            assert (plugin.server is not None) is opened
            assert (plugin.wire_port() is not None) is opened
        finally:
            plugin.teardown(SimpleNamespace(handlers={}))


def test_programs_send_their_blocks_over_the_direct_links(client):
    """A 2x2 step run as programs on the session's cluster (TCP): it equals the reference
    (check_mlp), and every worker holds direct links to the peers it sent blocks to."""
    from dask_ipar.runtime.exchange import PLUGIN_NAME
    from dask_ipar.testing import check_mlp

    errors = check_mlp(client, "2x2", steps=2, executor="programs")
    assert all(abs(r.ratio - 1) <= 1e-9 for r in errors["comm"].rows)

    def links(dask_worker=None):
        plugin = dask_worker.plugins[PLUGIN_NAME]
        return None if plugin.wire is None else sorted(plugin.wire.links)

    got = client.run(links)
    assert all(v is not None for v in got.values())
    assert sum(map(len, got.values())) >= 4  # a 2x2 step sends between all four


@pytest.mark.fast
def test_a_program_reading_the_links_hears_of_blocks_that_came_another_way():
    """A program waits reading the direct links; a block that comes through dask's comms
    (the ``ipar_put`` handler), and then the worker's closing, end its wait at once."""
    plugin = ExchangePlugin()
    plugin.setup(SimpleNamespace(handlers={}, address="tcp://127.0.0.1:1"))
    try:
        assert plugin.server is not None
        key = ("a-u-s1", 0)
        threading.Timer(0.2, plugin.put, kwargs={"key": key, "data": 7}).start()
        t0 = time.monotonic()
        assert plugin.receive(key, timeout=20) == 7
        assert time.monotonic() - t0 < 10
        threading.Timer(0.2, plugin.teardown, args=(SimpleNamespace(handlers={}),)).start()
        t0 = time.monotonic()
        with pytest.raises(IparError, match="did not arrive"):
            plugin.receive(("a-u-s1", 1), timeout=20)
        assert time.monotonic() - t0 < 10
    finally:
        plugin.teardown(SimpleNamespace(handlers={}))


@pytest.mark.fast
def test_a_link_stalled_mid_message_holds_no_reader_and_garbage_ends_only_its_link():
    """A peer that stops halfway through a message (stopped, partitioned) holds neither a
    waiting program nor the background thread: blocks from other links arrive meanwhile,
    and the message arrives whole once its rest comes. Garbage ends its own link, not the
    reader."""
    import struct

    server, wire, _, box, cv = _pair()
    try:
        stalled = socket.create_connection(("127.0.0.1", server.port))
        head = pack([(("s-u-s1", 0), np.arange(5.0))])
        views = [memoryview(f).cast("B") for f in head]
        raw = (struct.pack(f"!{len(views) + 1}Q", len(views), *(v.nbytes for v in views))
               + b"".join(bytes(v) for v in views))
        stalled.sendall(raw[:len(raw) - 7])  # the last 7 bytes come later
        time.sleep(0.1)
        t0 = time.monotonic()
        assert server.wait(lambda: False, timeout=0.5) is False  # read what came, waited on
        assert time.monotonic() - t0 < 2
        wire.send("peer", pack([(("a-u-s1", 0), 5)]), lambda: None, "t").result(10)
        with cv:  # the background thread reads the other link meanwhile
            assert cv.wait_for(lambda: len(box) == 1, timeout=10)
        assert len(server.conns) == 2  # the stalled link kept, its message half read
        stalled.sendall(raw[len(raw) - 7:])
        with cv:
            assert cv.wait_for(lambda: len(box) == 2, timeout=10)
        assert box[1][0] == ("s-u-s1", 0)
        np.testing.assert_array_equal(box[1][1], np.arange(5.0))
        garbage = socket.create_connection(("127.0.0.1", server.port))
        garbage.sendall(struct.pack("!Q", 1 << 60))  # a count no message has
        deadline = time.monotonic() + 10
        while len(server.conns) != 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)
        assert len(server.conns) == 2  # the garbage link dropped, the others kept
        wire.send("peer", pack([(("b-u-s1", 0), 6)]), lambda: None, "t").result(10)
        with cv:
            assert cv.wait_for(lambda: len(box) == 3, timeout=10)
        stalled.close()
        garbage.close()
    finally:
        wire.close()
        server.close()


@pytest.mark.fast
def test_a_message_read_in_pieces_on_a_nonblocking_socket_keeps_its_place():
    """MessageReader on a socket that has part of a message: BlockingIOError, then the
    whole message once the rest comes, byte by byte; the end of the link between
    messages is None, within one a ConnectionError."""
    from dask_ipar.runtime.framing import MessageReader

    a, b = socket.socketpair()
    b.setblocking(False)
    r = MessageReader()
    raw = bytearray()
    write_message(_Buf(raw), [b"head", b"x" * 300, b""])
    for k in range(len(raw) - 1):
        a.sendall(raw[k:k + 1])
        with pytest.raises(BlockingIOError):
            r.read(b)
    a.sendall(raw[-1:])
    assert [bytes(f) for f in r.read(b)] == [b"head", b"x" * 300, b""]
    with pytest.raises(BlockingIOError):
        r.read(b)
    a.sendall(raw[:5])
    with pytest.raises(BlockingIOError):
        r.read(b)
    a.close()
    with pytest.raises(ConnectionError):
        r.read(b)
    b.close()
    c, d = socket.socketpair()
    c.close()
    assert MessageReader().read(d) is None
    d.close()


@pytest.mark.fast
def test_a_large_frame_grows_as_it_comes_and_a_message_without_frames_is_garbage(monkeypatch):
    """A header announcing far more bytes than arrive costs the memory of what arrived
    (the buffer doubles as bytes come); a large frame still arrives whole; a frame count
    of 0 is no message."""
    import os
    import struct

    from dask_ipar.runtime import framing as F

    monkeypatch.setattr(F, "FIRST_BUFFER_BYTES", 1000)
    a, b = socket.socketpair()
    b.setblocking(False)
    a.sendall(struct.pack("!2Q", 1, 1 << 35) + b"x" * 10)
    r = F.MessageReader()
    with pytest.raises(BlockingIOError):
        r.read(b)
    assert len(r.buf) == 1000
    c, d = socket.socketpair()
    big = os.urandom(123_457)
    t = threading.Thread(target=write_message, args=(c, [b"head", big]))
    t.start()
    got = read_message(d)
    t.join()
    assert bytes(got[1]) == big
    c.sendall(struct.pack("!Q", 0))
    with pytest.raises(ValueError):
        read_message(d)
    for s in (a, b, c, d):
        s.close()


class _Buf:
    """A socket stand-in that collects what write_message writes."""

    def __init__(self, out):
        self.out = out

    def sendall(self, data):
        self.out += bytes(data)


@pytest.mark.fast
def test_two_programs_waiting_on_one_worker_both_get_their_blocks():
    """Two programs of one worker wait at once (one reads the links, the other waits for
    its deliveries, then reads them itself once the first has its block)."""
    plugin = ExchangePlugin()
    plugin.setup(SimpleNamespace(handlers={}, address="tcp://127.0.0.1:1"))
    wire = Wire(lambda dest, stopped=None: ("127.0.0.1", plugin.server.port),
                lambda: (0, 0.01, 0.02), name="t")
    got, errors = {}, []

    def wait_for(key):
        try:
            got[key] = plugin.receive(key, timeout=20)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    try:
        keys = [("a-u-s1", 0), ("b-u-s1", 0)]
        threads = [threading.Thread(target=wait_for, args=(k,)) for k in keys]
        for t in threads:
            t.start()
        time.sleep(0.2)
        for n, k in enumerate(keys):
            wire.send("peer", pack([(k, n)]), lambda: None, "t").result(10)
            time.sleep(0.1)
        for t in threads:
            t.join(timeout=20)
        assert not errors, errors
        assert got == {keys[0]: 0, keys[1]: 1}
    finally:
        wire.close()
        plugin.teardown(SimpleNamespace(handlers={}))


class _Unanswering:
    """A worker stand-in whose peers never answer ``ipar_wire`` (a dead host: dask's
    connect attempts go on until its connect timeout), on an event loop of its own."""

    def __init__(self):
        import asyncio

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.cancelled = threading.Event()
        outer = self

        class _Rpc:
            async def ipar_wire(self):
                try:
                    await asyncio.sleep(3600)
                except asyncio.CancelledError:
                    outer.cancelled.set()
                    raise

        self.worker = SimpleNamespace(handlers={}, address="tcp://127.0.0.1:1",
                                      rpc=lambda dest: _Rpc(),
                                      loop=SimpleNamespace(asyncio_loop=self.loop))

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.mark.fast
def test_a_send_to_a_peer_that_never_answers_ends_when_its_step_is_stopped():
    """A program's send to a dead peer (asking it for its link's port hangs) holds the
    program only until the step is aborted, not through dask's connect timeout: it
    returns once stopped, and its future fails with the abort's reason."""
    fake = _Unanswering()
    plugin = ExchangePlugin()
    plugin.setup(fake.worker)
    reason = []
    try:
        threading.Timer(0.3, lambda: reason.append("worker gone")).start()
        t0 = time.monotonic()
        fut = plugin.wire.send("tcp://127.0.0.1:9", pack([(("a-u-s1", 0), 1)]),
                               lambda: reason[0] if reason else None, "sending a to peer")
        returned = time.monotonic() - t0
        with pytest.raises(OSError, match="worker gone"):
            fut.result(10)
        assert 0.25 < returned < 5, returned
        assert fake.cancelled.wait(5)  # the question to the dead peer does not linger
    finally:
        plugin.teardown(fake.worker)
        fake.close()


@pytest.mark.fast
def test_a_program_thread_writes_only_into_connected_links(monkeypatch):
    """Connecting (a dead host's timeout) is the link thread's work: the first small
    message to a peer connects there; later ones go from the sending thread itself."""
    import dask_ipar.runtime.wire as wire_mod

    got = []
    server = WireServer("127.0.0.1", lambda frames: got.append(unpack(frames)), name="t")
    connects = []
    real = wire_mod.socket.create_connection

    def connect(*a, **kw):
        connects.append(threading.current_thread().name)
        return real(*a, **kw)

    monkeypatch.setattr(wire_mod.socket, "create_connection", connect)
    wire = Wire(lambda dest, stopped=None: ("127.0.0.1", server.port), lambda: (0, 0.01, 0.02),
                name="t")
    try:
        for n in range(3):
            wire.send("peer", pack([(("a-u-s1", n), n)]), lambda: None, "t").result(10)
        deadline = time.monotonic() + 10
        while len(got) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [items[0][1] for items in got] == [0, 1, 2]
        assert connects == ["t-to-peer"], connects
    finally:
        wire.close()
        server.close()
