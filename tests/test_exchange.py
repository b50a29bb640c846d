"""The worker programs' transport: retried sends, stale blocks dropped, a bounded mailbox."""

from __future__ import annotations

import asyncio

import pytest

from dask_ipar.runtime.exchange import KEEP_STEPS, ExchangePlugin
from dask_ipar.runtime.wire import send_with_retry

pytestmark = pytest.mark.fast


class _Worker:
    handlers: dict = {}
    address = "inproc://test/1"  # dask's comms: no direct links to open


def _plugin():
    p = ExchangePlugin()
    p.setup(_Worker())
    return p


def test_a_failed_send_is_retried_with_backoff_then_succeeds():
    calls = []

    async def op():
        calls.append(asyncio.get_running_loop().time())
        if len(calls) < 3:
            raise ConnectionResetError("peer reset")
        return "OK"

    assert asyncio.run(send_with_retry(op, lambda: None, "x", (5, 0.05, 1.0))) == "OK"
    gaps = [b - a for a, b in zip(calls, calls[1:])]
    assert len(calls) == 3 and gaps[0] < 0.04 and 0.04 < gaps[1] < 0.2  # at once, then min


def test_retries_end_at_their_count_or_when_the_step_was_stopped():
    calls = []

    async def op():
        calls.append(1)
        raise OSError("connection refused")

    with pytest.raises(OSError, match="after 3 attempt"):
        asyncio.run(send_with_retry(op, lambda: None, "sending a to b", (2, 0.01, 0.02)))
    calls.clear()
    with pytest.raises(OSError, match=r"after 1 attempt\(s\) \(worker gone\)"):
        asyncio.run(send_with_retry(op, lambda: "worker gone", "x", (10, 0.01, 0.02)))
    assert len(calls) == 1

    async def bad():
        raise ValueError("not a comm error")

    with pytest.raises(ValueError):  # the receiver's own error is not retried
        asyncio.run(send_with_retry(bad, lambda: None, "x", (10, 0.01, 0.02)))


def test_mailbox_drops_blocks_of_stopped_steps_and_old_ones():
    p = _plugin()
    p.put(key=["dense0.act-u1-s5", 0, 1], data=1)
    p.put(key=["dense0.act-u2-s1", 0, 1], data=2)  # another model: kept
    assert set(p.box) == {("dense0.act-u1-s5", 0, 1), ("dense0.act-u2-s1", 0, 1)}
    p.abort(tag="u1-s6", reason="peer gone")
    p.put(key=["dense0.act-u1-s6", 0, 0], data=3)  # a late block of the stopped step
    assert ("dense0.act-u1-s6", 0, 0) not in p.box
    assert p.stopped_tag("u1-s6") == "peer gone" and p.stopped_tag("u1-s7") is None
    p.put(key=["dense0.act-u1-s7", 0, 0], data=4)
    assert ("dense0.act-u1-s5", 0, 1) in p.box  # in flight still
    p.put(key=["dense0.act-u1-s" + str(6 + KEEP_STEPS), 0, 0], data=5)
    assert ("dense0.act-u1-s5", 0, 1) not in p.box  # nobody will take it now
    assert ("dense0.act-u1-s7", 0, 0) in p.box and ("dense0.act-u2-s1", 0, 1) in p.box
    # a stopped model: its blocks up to its newest step are dropped on arrival
    p.abort(tag="u2", reason="closed", model=True, upto=(3, 0))
    p.put(key=["dense0.act-u2-s3", 0, 0], data=6)
    assert ("dense0.act-u2-s3", 0, 0) not in p.box and p.stopped_tag("u2-s3") == "closed"


def test_small_blocks_wait_past_short_tasks_and_go_before_others():
    """``Sender.phase``: small blocks held back go when the program turns to another
    task, unless that task is known to be short (``hold``); one message per peer then
    carries the blocks of several tasks."""
    import types

    import numpy as np

    from dask_ipar.runtime.sender import Sender

    plugin = types.SimpleNamespace(wire=None, direct_bytes=1 << 16)
    worker = types.SimpleNamespace(loop=types.SimpleNamespace(asyncio_loop=None),
                                   address="tcp://a")
    sender = Sender(plugin, worker)
    sent = []
    sender._go = lambda dest, items: sent.append((dest, [k for k, _, _ in items]))
    block = np.zeros(4)
    sender.phase("dense1.dxp")
    sender.push(("dense1.dxp-u-s1", 0, 0), block, ["tcp://b"])
    sender.phase("dense1.dwp", hold=True)  # short last time: the block waits
    sender.push(("dense1.dwp-u-s1", 0, 0), block, ["tcp://b"])
    assert sent == []
    sender.phase("dense0.dxp")  # not known to be short: both go, as one message
    assert sent == [("tcp://b", [("dense1.dxp-u-s1", 0, 0), ("dense1.dwp-u-s1", 0, 0)])]
    sender.push(("dense0.dxp-u-s1", 0, 0), block, ["tcp://b"])
    sender.release()  # what a program does before it waits for blocks
    assert sent[-1] == ("tcp://b", [("dense0.dxp-u-s1", 0, 0)])
