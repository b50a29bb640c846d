"""Probes of the worker programs' transport, for :func:`~dask_ipar.runtime.calibrate.calibrate`.

Its one job: time what the programs' links do, with what a program uses (its
:class:`~dask_ipar.runtime.sender.Sender`, the exchange plugin's mailbox):

* :func:`program_hop`: one hop of a 4-byte block (half a ping-pong's round trip);
* :func:`loaded_hop`: the same while every link carries an all-to-all's large blocks;
* :func:`transfer_cpu`: every worker pushing a block to every other at once: the CPU
  per byte the transports spend, and each link's rate (``exchange_Bps``); with
  :func:`rest_cores`, the CPU the hosts spend beyond the workers' own (the kernel's
  network stack, charged to no worker process);
* :func:`busy_exchange`: the same while every worker also computes (``busy_exchange_Bps``,
  and the transports' CPU per byte then: ``transfer_cpu_s_per_B``);
* :func:`message_cpu`: the transports' fixed CPU per message.
"""

from __future__ import annotations

import os
import socket
import time

import numpy as np

__all__ = ["program_hop", "loaded_hop", "transfer_cpu", "busy_exchange", "message_cpu",
           "exchange_block", "rest_cores", "hosts_cpu", "spread", "BusyReadings",
           "TRANSFER_WARMUPS", "TRANSFER_REPEATS", "BUSY_REPEATS", "BUSY_GROUPS",
           "LOADED_REPEATS"]

#: Exchanges of the measured size before the transfer CPU is timed, and how many are timed.
TRANSFER_WARMUPS = 2
TRANSFER_REPEATS = 5
#: Exchanges beside computing (``busy_exchange_Bps``) timed after one warm-up, in
#: :data:`BUSY_GROUPS` groups spread over a calibration (:func:`spread`).
BUSY_REPEATS = 9
BUSY_GROUPS = 3
#: Loaded ping-pongs (``loaded_message_s``): their median.
LOADED_REPEATS = 3


def _pingpong(peer: str, reps: int, uid: str, serve: bool, direct: bool = True):
    """One side of a ping-pong of a 4-byte block between two worker programs, run as a
    task on each worker: the ``serve`` side answers each block it receives; the other
    sends, waits for the answer, and returns the round trips' median. Both use what a
    program uses (its sender, the mailbox, a waiting thread); ``direct=False``: dask's comms
    instead of the direct links."""
    from distributed import get_worker

    from dask_ipar.runtime.exchange import plugin_of
    from dask_ipar.runtime.sender import Sender

    worker = get_worker()
    plugin = plugin_of(worker)
    sender = Sender(plugin, worker, direct=direct)
    block = np.zeros(1, dtype=np.float32)
    ping = [(f"calibrate.ping-{uid}-s{k}", 0) for k in range(reps)]
    pong = [(f"calibrate.pong-{uid}-s{k}", 0) for k in range(reps)]
    rtt = []
    for k in range(reps):
        if serve:
            plugin.receive(ping[k], timeout=60.0)
            sender.push(pong[k], block, [peer])
            sender.release()
        else:
            t0 = time.perf_counter()
            sender.push(ping[k], block, [peer])
            sender.release()
            plugin.receive(pong[k], timeout=60.0)
            rtt.append(time.perf_counter() - t0)
    sender.flush()
    return float(np.median(rtt[1:])) if rtt else None


def _barrier(plugin, sender, peers: list, me: str, uid: str) -> None:
    """Return once every worker of ``peers`` has reached it (``me``: this one; a 4-byte
    block to and from each other one): no large block leaves before every worker's window
    is open."""
    others = [p for p in peers if p != me]
    sender.push((f"calibrate.ready-{uid}", peers.index(me)), np.zeros(1, np.float32), others)
    sender.release()
    for p in others:
        plugin.receive((f"calibrate.ready-{uid}", peers.index(p)), timeout=300.0)


def _host_busy() -> tuple:
    """``(host, CPU seconds this machine's cores have been busy so far)``: every core's
    user, system, interrupt and softirq time from ``/proc/stat`` (not idle, I/O wait or
    time stolen by a hypervisor); ``(host, None)`` where that cannot be read (not Linux)."""
    host = socket.gethostname()
    try:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:8]]
        user, nice, system, _idle, _iowait, irq, softirq = ticks
    except (OSError, ValueError):
        return host, None
    return host, (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def _rest_busy(seconds: float) -> tuple:
    """``(host, cores busy)`` on this worker's host over ``seconds`` of sleeping."""
    host, b0 = _host_busy()
    time.sleep(seconds)
    _, b1 = _host_busy()
    return host, (None if b0 is None or b1 is None else (b1 - b0) / seconds)


def rest_cores(client, workers, seconds: float = 1.0) -> dict:
    """``{host: cores busy}`` of each host of ``workers`` while nothing is submitted (one
    worker per host sleeps ``seconds``; the scheduler's, the client's and the workers' own
    periodic work, whatever else runs there): the baseline :func:`hosts_cpu` takes off an
    exchange's host CPU. Hosts whose CPU cannot be read are left out."""
    by_host = dict(client.run(socket.gethostname, workers=list(workers)))
    one = {}
    for w, host in sorted(by_host.items()):
        one.setdefault(host, w)
    futs = [client.submit(_rest_busy, seconds, workers=[w], pure=False,
                          allow_other_workers=False) for w in one.values()]
    return {h: rate for h, rate in client.gather(futs) if rate is not None}


def hosts_cpu(readings, rest: dict) -> float | None:
    """CPU seconds the hosts spent on an exchange beyond their rest: per host, its busy
    CPU from the earliest reading at a worker's start to the latest at a worker's end,
    less ``rest[host]`` cores over that window; summed over the hosts. ``readings``:
    ``(host, busy at start, busy at end, start, end)`` per worker (:func:`_exchange_cpu`).
    None where a host's CPU or rest is unknown."""
    spans: dict = {}
    for host, b0, b1, t0, t1 in readings:
        if b0 is None or b1 is None or host not in rest:
            return None
        lo, hi, s, e = spans.get(host, (b0, b1, t0, t1))
        spans[host] = (min(lo, b0), max(hi, b1), min(s, t0), max(e, t1))
    if not spans:
        return None
    return sum(hi - lo - rest[h] * (e - s) for h, (lo, hi, s, e) in spans.items())


def _sent_bytes(nbytes: int, workers) -> int:
    """Bytes one worker pushes in an all-to-all of ``nbytes`` blocks (float32 blocks)."""
    return max(1, nbytes // 4) * 4 * (len(list(workers)) - 1)


def _exchange_cpu(peers: list, nbytes: int, uid: str, busy: bool = False):
    """Run as a task on every worker of ``peers``: push an ``nbytes`` block to every other
    one and take theirs, over what a program uses (its sender, the mailbox); returns
    ``(process id, CPU seconds of this process, bytes sent and received, start, stop, host,
    its busy CPU at start, at stop, the computing thread's CPU, its part in the operating
    system's kernel or None)`` over the exchange
    (``time.time()`` from this worker's first block out to its last block in; the host's CPU
    by :func:`_host_busy`). ``busy``: a thread of the worker runs the engine's kernels (the
    calibration's kernel mix, :mod:`dask_ipar.runtime.kernelmix`) from before the first
    block leaves until the last one is in, as a program's kernels run beside its transfers
    (its CPU, by its thread's clock, returned apart: the process's includes it)."""
    import os
    import resource
    import threading

    from distributed import get_worker

    from dask_ipar.runtime.exchange import plugin_of
    from dask_ipar.runtime.sender import Sender

    worker = get_worker()
    plugin = plugin_of(worker)
    sender = Sender(plugin, worker)
    me = worker.address
    others = [p for p in peers if p != me]
    block = np.ones(max(1, nbytes // 4), dtype=np.float32)
    if busy:  # the kernels' inputs made before the barrier: no worker's making of them
        from dask_ipar.runtime.kernelmix import kernel_calls  # runs beside the exchange
        from dask_ipar.runtime.programs import thread_system_time

        calls = kernel_calls("float32")
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    _barrier(plugin, sender, peers, me, uid)
    host, h0 = _host_busy()
    stop = threading.Event()
    kernel_cpu = [0.0, None]  # the computing thread's CPU (not the transports'), its system
    if busy:
        def compute():  # until the last block is in (not to the end of a round)
            c0, s0 = time.thread_time(), thread_system_time()
            while not stop.is_set():
                for f, args in calls:
                    if stop.is_set():
                        break
                    f(*args)
            kernel_cpu[0] = time.thread_time() - c0
            s1 = thread_system_time()
            kernel_cpu[1] = None if s0 is None or s1 is None else s1 - s0

        kernels = threading.Thread(target=compute, name="calibrate-busy", daemon=True)
        kernels.start()
    t0 = time.time()
    try:
        sender.push((f"calibrate.xfer-{uid}", peers.index(me)), block, others)
        sender.release()  # a block below the merge size would wait for the flush otherwise
        got = 0
        for p in others:
            got += plugin.receive((f"calibrate.xfer-{uid}", peers.index(p)),
                                  timeout=300.0).nbytes
        sender.flush()
        t1 = time.time()
    finally:
        stop.set()
        if busy:
            kernels.join()
    _, h1 = _host_busy()
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    return (os.getpid(), cpu, got + block.nbytes * len(others), t0, t1, host, h0, h1,
            *kernel_cpu)


def _exchange(client, workers, nbytes: int, busy: bool = False, rest: dict | None = None):
    """Every worker of ``workers`` pushes an ``nbytes`` block to every other one at once
    (:func:`_exchange_cpu`): ``(CPU seconds, bytes, seconds, lost)``: the workers' CPU time (workers
    in one process: its CPU time once; with ``rest`` (:func:`rest_cores`), the hosts' CPU
    beyond their rest where that reads more, :func:`hosts_cpu`), the bytes that crossed
    their transports (both ends counted), the median worker's time from its first block
    out to its last block in, and with ``busy`` the computing threads' seconds in the OS
    kernel and their CPU seconds (``(stack, kernels)``; None without ``busy`` or where
    unreadable)."""
    from dask_ipar.errors import IparError
    from dask_ipar.runtime.exchange import install_exchange

    workers = list(workers)
    if len(workers) < 2:
        raise IparError(f"the transfer CPU needs at least 2 workers; got {len(workers)}.")
    install_exchange(client)
    uid = f"{time.time_ns():x}"
    futs = [client.submit(_exchange_cpu, list(workers), nbytes, uid, busy, workers=[w],
                          pure=False, allow_other_workers=False,
                          key=f"calibrate.exchange-{uid}-{k}")
            for k, w in enumerate(workers)]
    out = client.gather(futs)
    cpu: dict = {}
    kernels: dict = {}  # the computing threads' CPU, per process (not the transports')
    stack = []  # their time in the OS kernel: the network stack's work charged to them
    for pid, c, *_, k, ks in out:
        cpu[pid] = max(cpu.get(pid, 0.0), c)
        kernels[pid] = kernels.get(pid, 0.0) + k
        stack.append(ks)
    took = float(np.median([t1 - t0 for _, _, _, t0, t1, *_ in out]))
    total = sum(cpu.values()) - sum(kernels.values())
    if rest is not None:
        machine = hosts_cpu([(h, b0, b1, t0, t1) for _, _, _, t0, t1, h, b0, b1, *_ in out],
                            rest)
        if machine is not None:  # less the computing threads' CPU, where they ran
            total = max(total, machine - sum(kernels.values()))
    nbytes_all = float(sum(b for _, _, b, *_ in out))
    # the computing threads' time in the OS kernel, and their CPU: what the stack took
    stack = (sum(stack), sum(kernels.values())) if busy and None not in stack else None
    return total, nbytes_all, took, stack


def exchange_block(workers: int, block: int, least: int) -> int:
    """The block each of ``workers`` pushes to every other one in the transfer CPU's
    exchanges: ``block`` bytes, or more where each worker would send fewer than ``least``
    in all (few workers). The CPU clocks read it in ticks (the machine's, ``/proc/stat``, in
    10 ms ones) and each exchange has fixed costs: 2 emulated hosts at 10 Gbit/s, 16 MiB
    blocks (35 ms of CPU an exchange) read 0.40-1.19 ns a byte on idle cores, 112 MiB
    blocks 0.47-0.89 (median 0.51); in the weight-dominated MLP's 1x2 steps there the
    transports took 0.40."""
    return max(int(block), -(-int(least) // max(1, workers - 1)))


def transfer_cpu(client, workers, nbytes: int, rest: dict | None = None) -> tuple[float, float]:
    """``(CPU seconds per byte, bytes per second each worker sends)``, every worker of
    ``workers`` pushing an ``nbytes`` block to every other one at once (:func:`_exchange`):
    the workers' CPU time (with ``rest``, the hosts' beyond their rest where that is more:
    the kernel's network stack runs in interrupt context, charged to no worker or to another
    process) over the bytes that crossed their transports, both ends counted;
    and the bytes a worker pushed over the median worker's time from its first block out to
    its last block in (what one link carries while every link is busy, as in a collective:
    below a pair's rate where the links share a switch, a host's stack or its cores)."""
    cpu, nbytes_all, took, _ = _exchange(client, workers, nbytes, rest=rest)
    return cpu / nbytes_all, _sent_bytes(nbytes, workers) / max(took, 1e-9)


def busy_exchange(client, workers, nbytes: int, rest: dict | None = None
                  ) -> tuple[float, float, float | None, float | None]:
    """``(bytes per second each worker sends, CPU seconds per byte, the stack's CPU seconds
    per byte, the stack's share)`` while every worker of ``workers`` pushes an ``nbytes``
    block to every other one at once and also computes (a thread running the engine's
    kernels for the whole exchange, :func:`_exchange_cpu`): a link's rate while a step's
    kernels fill the cores (its transport then waits for them); what the transports cost the
    cores then, the computing threads' CPU taken off (as :func:`transfer_cpu`, with
    ``rest``); and the computing threads' time in the operating system's kernel (they make
    no system calls: the network stack's work for the packets that come while they run) over
    the bytes that crossed the transports (both ends counted: ``Machine.stack_cpu_s_per_B``)
    and over their CPU (None where a thread's system time is not readable, no
    ``RUSAGE_THREAD``). Beside computing a transport is woken less often and reads larger
    pieces: 8 emulated hosts at 1 Gbit/s sharing 2 cores, 0.43-0.54 ns a byte against
    0.80-0.86 on idle cores (0.33-0.38 and 0.32-0.47 at 10 Gbit/s)."""
    cpu, nbytes_all, took, lost = _exchange(client, workers, nbytes, busy=True, rest=rest)
    stack_B = share = None
    if lost is not None:
        stack_B, share = lost[0] / nbytes_all, lost[0] / max(lost[1], 1e-9)
    return _sent_bytes(nbytes, workers) / max(took, 1e-9), cpu / nbytes_all, stack_B, share


def spread(repeats: int, groups: int = BUSY_GROUPS) -> list[int]:
    """``repeats`` readings cut into ``groups`` groups as even as can be (the first ones
    one larger; groups of none where fewer), to be taken at points spread over a
    calibration: readings of one figure drift together for seconds (a busy exchange's
    transfer CPU on 4 emulated hosts at 10 Gbit/s, twelve in a row: 0.42-0.61 ns a byte,
    neighbours alike), so back to back they sample one moment of the machine."""
    groups = max(1, int(groups))
    return [repeats // groups + (i < repeats % groups) for i in range(groups)]


class BusyReadings:
    """Exchanges beside computing (:func:`busy_exchange`) of ``nbytes`` blocks among
    ``workers``, ``repeats`` of them in :func:`spread` groups: one warm-up and the first
    group when made, a group each :meth:`take`, their medians from :meth:`medians`."""

    def __init__(self, client, workers, nbytes: int, rest: dict | None, repeats: int,
                 groups: int = BUSY_GROUPS):
        self.args = (client, list(workers), nbytes, rest)
        self.groups, self.readings = iter(spread(repeats, groups)), []
        busy_exchange(*self.args)  # warm the computing threads
        self.take()

    def take(self) -> None:
        """The next group's readings (none once every group is taken)."""
        self.readings += [busy_exchange(*self.args) for _ in range(next(self.groups, 0))]

    def medians(self) -> tuple:
        """:func:`busy_exchange`'s four values, each the median of the readings (None
        where any reading has none)."""
        return tuple(None if any(v is None for v in col) else float(np.median(col))
                     for col in zip(*self.readings))

    def spread_note(self) -> str:
        """The transfer CPU's readings, for a log line: how many and their range."""
        per_B = [r[1] * 1e9 for r in self.readings]
        return (f"the median of {len(per_B)} spread over the calibration, "
                f"{min(per_B):.2f}-{max(per_B):.2f}")


def message_cpu(client, workers, per_byte: float, repeats: int = 3) -> tuple[float, float]:
    """``(CPU seconds per message end of a small message, of a large one)``: the
    transports' fixed work per message beyond ``per_byte``, from all-to-all exchanges
    (:func:`_exchange`) of 4-byte blocks (every message small, written by the sending
    program itself over the direct links: the block and the exchange's barrier message per
    pair) and of 256 KiB blocks (each handed to the link's own thread, or to dask's comms
    where the workers have no direct links, beside one small barrier message per pair);
    medians of ``repeats`` after one of each."""
    from dask_ipar.runtime.wire import DIRECT_BYTES

    workers = list(workers)
    ends = 2 * len(workers) * (len(workers) - 1)  # messages of one kind, both ends counted
    big = max(4 * DIRECT_BYTES, 1 << 18)
    out = []
    for nbytes in (4, big):
        _exchange(client, workers, nbytes)  # warm: the first exchange of a size costs more
        runs = np.array([_exchange(client, workers, nbytes)[:2] for _ in range(repeats)])
        out.append(np.median(runs, axis=0))  # (CPU seconds, bytes)
    (cpu_s, _), (cpu_b, bytes_b) = out
    small = cpu_s / (2 * ends)
    large = max(0.0, (cpu_b - small * ends - per_byte * bytes_b) / ends)
    return float(small), float(large)


def _loaded_pingpong(peers: list, nbytes: int, uid: str, reps: int):
    """Run as a task on every worker of ``peers``: push an ``nbytes`` block to every other
    one (the links' load), and meanwhile, on the first two, a ping-pong of a 4-byte block
    over the direct links (as :func:`_pingpong`) for as long as the blocks are still on
    their way, at most ``reps`` round trips. Returns the round trips the first worker timed
    while every block was still on its way (the others return ``[]``)."""
    import threading

    from distributed import get_worker

    from dask_ipar.runtime.exchange import plugin_of
    from dask_ipar.runtime.sender import Sender

    worker = get_worker()
    plugin = plugin_of(worker)
    bulk, small = Sender(plugin, worker, direct=False), Sender(plugin, worker)
    me = worker.address
    i = peers.index(me)
    others = [p for p in peers if p != me]
    _barrier(plugin, small, peers, me, uid)
    bulk.push((f"calibrate.load-{uid}", i), np.ones(max(1, nbytes // 4), np.float32), others)
    done = threading.Event()

    def take():
        try:
            for p in others:
                plugin.receive((f"calibrate.load-{uid}", peers.index(p)), timeout=300.0)
        finally:
            done.set()

    taker = threading.Thread(target=take, name="calibrate-load", daemon=True)
    taker.start()
    rtt = []
    if i < 2:
        peer, block = peers[1 - i], np.zeros(1, np.float32)
        time.sleep(0.02)  # the flows under way
        for k in range(reps + 1):
            last = k == reps or (i == 0 and done.is_set())
            if i == 0:
                t0 = time.perf_counter()
                small.push((f"calibrate.lping-{uid}-s{k}", 0), np.ones(1, np.float32)
                           if last else block, [peer])
                small.release()
                if last:
                    break
                plugin.receive((f"calibrate.lpong-{uid}-s{k}", 0), timeout=60.0)
                if not done.is_set():  # every block still on its way: a loaded round trip
                    rtt.append(time.perf_counter() - t0)
                time.sleep(0.005)
            else:
                got = plugin.receive((f"calibrate.lping-{uid}-s{k}", 0), timeout=60.0)
                if got[0]:  # the last ping: no answer
                    break
                small.push((f"calibrate.lpong-{uid}-s{k}", 0), block, [peer])
                small.release()
    taker.join()
    bulk.flush()
    small.flush()
    return rtt


def loaded_hop(client, workers, nbytes: int = 32 * 2**20, reps: int = 30) -> float | None:
    """Seconds of one hop of a 4-byte block between two worker programs over the direct
    links while every worker of ``workers`` pushes an ``nbytes`` block to every other one
    (the links full, as in a step's collectives): half the median of the round trips timed
    while the blocks were still on their way (:func:`_loaded_pingpong`); None where fewer
    than 5 were (the links too fast for ``nbytes``). What a small block waits, beyond
    :func:`program_hop`, behind the bytes the links' queues hold."""
    from dask_ipar.runtime.exchange import install_exchange

    install_exchange(client)
    workers = list(workers)
    uid = f"{time.time_ns():x}"
    futs = [client.submit(_loaded_pingpong, workers, nbytes, uid, reps, workers=[w],
                          pure=False, allow_other_workers=False,
                          key=f"calibrate.loadedhop-{uid}-{k}")
            for k, w in enumerate(workers)]
    rtt = client.gather(futs)[0]
    return float(np.median(rtt)) / 2 if len(rtt) >= 5 else None


def program_hop(client, src: str, dst: str, reps: int = 50, direct: bool = True) -> float:
    """Seconds of one hop of a 4-byte block from one worker program to another, ``src``
    to ``dst``: half the median round trip of a ping-pong between a task on each (the
    blocking send and receive that gloo's ping-pong times). ``direct=False``: over dask's
    comms instead of the programs' direct links."""
    from dask_ipar.runtime.exchange import install_exchange

    install_exchange(client)
    uid = f"{time.time_ns():x}"
    futs = [client.submit(_pingpong, peer, reps, uid, serve, direct, workers=[me], pure=False,
                          allow_other_workers=False, key=f"calibrate.pingpong-{uid}-{serve}")
            for me, peer, serve in ((dst, src, True), (src, dst, False))]
    rtt = client.gather(futs)[1]
    return rtt / 2
