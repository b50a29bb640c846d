"""``dask-ipar calibrate`` measures every figure of the machine file on the live cluster."""

from __future__ import annotations

import math
import os

from dask_ipar.runtime.calibrate import QUICK, calibrate
from dask_ipar.cost import load_machine, save_machine


def test_calibrate_measures_every_figure(client, tmp_path):
    lines = []
    # three exchanges beside computing, spread over the calibration in groups of one
    # and two kernel-mix runs, the compute rates' readings spread alike (session 59)
    m = calibrate(client, effort=QUICK, block_mib=2, busy_repeats=3, mix_runs=2,
                  log=lines.append)
    for name in ("alpha_s", "bandwidth_Bps", "flops_per_s", "cluster_flops_per_s", "task_s",
                 "mem_Bps", "cluster_bandwidth_Bps", "message_s", "round_s",
                 "transfer_cpu_s_per_B", "elementwise_Bps", "exchange_Bps",
                 "direct_message_cpu_s", "busy_exchange_Bps"):
        v = getattr(m, name)
        assert v is not None and math.isfinite(v) and v > 0, (name, v)
    assert 1e-5 < m.alpha_s < 1.0 and 1e-5 < m.task_s < 1.0  # seconds, not ms or us
    assert 1e-6 < m.message_s < m.alpha_s  # a program's message skips the scheduler
    assert 1e-12 < m.transfer_cpu_s_per_B < 1e-6  # seconds per byte: 1 TB/s to 1 MB/s
    # the figure written is the one read beside computing (session 53), not on idle cores
    (beside,) = [line for line in lines if line.startswith("exchange beside computing")]
    assert f"transfer CPU {m.transfer_cpu_s_per_B * 1e9:.2f} ns per byte" in beside, beside
    assert any("on idle cores" in line and "ns per byte" in line for line in lines)
    # the median of the three readings, which the line lists by their range (session 58)
    import re

    lo, hi = map(float, re.search(r"the median of 3 spread over the calibration, "
                                  r"([0-9.]+)-([0-9.]+)", beside).groups())
    assert lo - 0.005 <= m.transfer_cpu_s_per_B * 1e9 <= hi + 0.005, beside
    # the network stack's work on the computing threads (their system time; Linux reads a
    # thread's): per byte crossing the transports, written, and a share of their time, logged
    import resource

    if hasattr(resource, "RUSAGE_THREAD"):
        got = re.search(r"network stack's work on the computing threads: ([0-9.]+) ns per "
                        r"byte \(([0-9.]+)% of their time\)", beside)
        assert got and 0 <= float(got.group(2)) < 100, beside
        assert m.stack_cpu_s_per_B is not None and 0 <= m.stack_cpu_s_per_B < 1e-6
        assert got.group(1) == f"{m.stack_cpu_s_per_B * 1e9:.3f}", (got.group(1), m)
    else:
        assert m.stack_cpu_s_per_B is None and "not readable here" in beside
    # its exchanges' blocks: each worker sends QUICK's 28 MiB at least (2 MiB blocks asked)
    from dask_ipar.runtime.linkprobe import exchange_block
    from dask_ipar.runtime.workers import scheduler_workers

    peers = len(scheduler_workers(client)) - 1
    mib = exchange_block(peers + 1, 2 << 20, QUICK.exchange_mib << 20)
    assert peers * mib >= 28 << 20 and any(f"pushing {mib >> 20} MiB to every other" in line
                                           for line in lines), lines
    assert 1e8 < m.elementwise_Bps < 1e12 and 1e5 < m.exchange_Bps < 1e12  # bytes/s
    # the conv front's own rate, from the mix's conv and pooling calls (its flops are a
    # small part of their time: always measurable)
    assert m.conv_Bps is not None and 1e8 < m.conv_Bps < 1e12, m.conv_Bps
    # one rate for every block size: read on blocks that stream from memory (session 52)
    assert m.elementwise_large_Bps is None
    assert any("element-wise rate of the conv front's" in line and "16 MiB blocks" in line
               and "GB/s" in line for line in lines)
    assert 1e-7 < m.direct_message_cpu_s < 1e-2 and 0 <= m.message_cpu_s < 1e-1  # seconds
    assert m.word_bytes == 4
    # beside the kernels the links carry no more than alone (a generous margin: noise)
    assert m.busy_exchange_Bps < 1.5 * m.exchange_Bps
    # a message behind an all-to-all's 32 MiB blocks: not faster than an idle one's hop;
    # None only where the links emptied before five round trips
    assert m.loaded_message_s is None or m.loaded_message_s > 0.5 * m.message_s, \
        (m.loaded_message_s, m.message_s)
    # dask's own CPU where the workers share the cores: a fraction of the cores while they
    # compute, and a submitted step's work outside its programs
    assert 0 < m.background_cores < (os.cpu_count() or 1), m.background_cores
    assert 1e-5 < m.step_cpu_s < 1.0, m.step_cpu_s
    # the programs' own loops, per task: microseconds, not the kernels' milliseconds
    assert 1e-7 < m.program_task_cpu_s < 1e-3, m.program_task_cpu_s
    assert any("programs' own loops" in line and "us per task" in line for line in lines)
    assert any("per task" in line for line in lines)
    assert any("at rest" in line for line in lines)
    (rounds,) = [line for line in lines if "workers at once)" in line and "GFLOP/s" in line]
    assert f"fastest of {QUICK.cluster_rounds} rounds spread over the calibration" in rounds
    # the written rate is the fastest round's (QUICK's 512-cubed scaled to 1024-cubed by the
    # edge model: at least the fastest reading, as the edge only adds)
    got = [float(v) for v in re.search(r"calibration \(([0-9., ]+)\)", rounds).group(1).split(",")]
    from dask_ipar.kernels.cost_shapes import gemm

    f_sq, e_sq = gemm(QUICK.matmul_n, QUICK.matmul_n, QUICK.matmul_n)
    scale = 1.0 + m.gemm_edge_flops * e_sq / f_sq
    assert len(got) == QUICK.cluster_rounds
    assert abs(m.cluster_flops_per_s / 1e9 - max(got) * scale) <= 0.051 * scale, (got, m)
    # one worker's matmul: one reading a group, three groups
    (one,) = [line for line in lines if "on one worker): " in line and "GFLOP/s" in line]
    assert re.search(r"readings [0-9.]+, [0-9.]+, [0-9.]+;", one), one
    # the kernel mix: two runs, one a group, the fastest's rates written
    mix = [line for line in lines if line.startswith("element-wise rate of")]
    assert len(mix) == 2 and all(re.search(
        r"the fastest of 2 runs spread over the calibration \([0-9]+ ms, [0-9]+ ms\)",
        line) for line in mix), mix
    # a thin product's rate beside the square one's: what its edge costs (flop-equivalents
    # per element; 0 where the thin one ran as fast)
    assert 0 <= m.gemm_edge_flops < 600, m.gemm_edge_flops
    assert any("thin product" in line and "per element" in line for line in lines)
    # the memory its blocks leave on the workers goes back once they idle
    from dask_ipar.runtime.release import RELEASE_NAME

    assert all(client.run(lambda dask_worker: RELEASE_NAME in dask_worker.plugins).values())
    path = tmp_path / "machine.yaml"
    save_machine(m, path)
    assert load_machine(path) == m


def test_dask_cpu_probes_skip_workers_in_the_clients_process(client):
    """Workers that are threads of the client's process: their CPU cannot be told from the
    client's, so calibrate leaves ``background_cores`` and ``step_cpu_s`` unmeasured."""
    from distributed import Client, LocalCluster

    from dask_ipar.runtime.stepprobe import measurable
    from dask_ipar.runtime.workers import scheduler_workers

    assert measurable(client, sorted(scheduler_workers(client)))
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                      dashboard_address=None) as cluster, Client(cluster) as local:
        assert not measurable(local, sorted(scheduler_workers(local)))


def test_exchange_block_sends_each_worker_its_least():
    """The transfer CPU's exchanges: the block asked for where every worker sends at least
    ``least`` bytes with it, else the smallest that does (rounded up: 112 MiB over 3 peers
    is 37.33 MiB)."""
    from dask_ipar.runtime.linkprobe import exchange_block

    mib = 2**20
    assert exchange_block(8, 16 * mib, 112 * mib) == 16 * mib  # 7 peers: 112 MiB already
    assert exchange_block(16, 16 * mib, 112 * mib) == 16 * mib  # more than enough
    assert exchange_block(2, 16 * mib, 112 * mib) == 112 * mib  # one peer takes it all
    b = exchange_block(4, 16 * mib, 112 * mib)
    assert 3 * b >= 112 * mib > 3 * (b - 1)
    assert exchange_block(1, 16 * mib, 112 * mib) == 112 * mib  # no peer: no division by 0


def test_spread_cuts_readings_into_even_groups_first_ones_larger():
    """The busy exchanges' groups over a calibration: as even as can be, every reading
    taken once, groups of none where there are fewer readings than groups."""
    from dask_ipar.runtime.linkprobe import BUSY_GROUPS, BUSY_REPEATS, spread

    assert spread(9, 3) == [3, 3, 3]
    assert spread(5, 3) == [2, 2, 1]
    assert spread(1, 3) == [1, 0, 0]
    assert spread(0, 3) == [0, 0, 0]
    assert spread(4, 0) == [4]  # at least one group
    for n in range(12):
        got = spread(n)
        assert sum(got) == n and len(got) == BUSY_GROUPS and max(got) - min(got) <= 1
    assert spread(BUSY_REPEATS) == [3, 3, 3]  # FULL: nine, three a group


def test_hosts_cpu_is_each_hosts_busy_span_less_its_rest():
    """The transfer CPU read on the hosts (:func:`~dask_ipar.runtime.linkprobe.hosts_cpu`):
    per host its busy CPU from the earliest worker's start to the latest worker's end, less
    its rest rate over that window, summed over hosts; None where a host is unreadable or
    has no rest figure (calibrate then keeps the workers' own CPU)."""
    from pytest import approx

    from dask_ipar.runtime.linkprobe import hosts_cpu

    readings = [("a", 10.0, 12.0, 100.0, 101.0), ("a", 10.1, 12.5, 100.2, 101.5),
                ("b", 5.0, 5.6, 100.0, 100.5)]
    rest = {"a": 0.2, "b": 0.1}
    # a: 12.5 - 10.0 - 0.2 * 1.5 = 2.2; b: 0.6 - 0.1 * 0.5 = 0.55
    assert hosts_cpu(readings, rest) == approx(2.75)
    assert hosts_cpu(readings, {"a": 0.2}) is None
    assert hosts_cpu([("a", None, 1.0, 0.0, 1.0)], rest) is None
    assert hosts_cpu([], rest) is None


def test_rest_cores_reads_each_host_once(client):
    """One figure per host of the workers (this test's cluster: one host), a fraction of its
    cores while nothing is submitted; on a platform without ``/proc/stat``, none."""
    from dask_ipar.runtime.linkprobe import rest_cores
    from dask_ipar.runtime.workers import scheduler_workers

    rest = rest_cores(client, sorted(scheduler_workers(client)), seconds=0.3)
    if not os.path.exists("/proc/stat"):
        assert rest == {}
        return
    assert len(rest) == 1
    assert all(0 <= c <= (os.cpu_count() or 1) for c in rest.values()), rest


def test_one_worker_flops_is_its_fastest_reading_and_no_less_than_its_share_of_all():
    """``flops_per_s``: the faster of the one-worker readings, raised to each worker's
    share of the all-workers rate where a reading came out below it (a reading hit by
    other work: 81 GFLOP/s once against 93 a worker with both computing at once)."""
    from dask_ipar.runtime.calibrate import one_worker_flops

    assert one_worker_flops((81e9, 90e9), 186e9, 2) == 93e9  # raised to the share
    assert one_worker_flops((99e9, 101e9), 186e9, 2) == 101e9  # the fastest reading
    assert one_worker_flops((99e9, 97e9), 187e9, 8) == 99e9  # 8 workers on 2 cores


def test_the_programs_loop_cpu_is_their_run_less_setup_and_everything_counted():
    """``program_task_cpu_s`` from a worker's counts: the programs' run less their setup
    is the loops' CPU; less the kernels, the transports' work on the program thread and
    the accounting's own work per counted call, per task (kernel calls)."""
    from pytest import approx

    from dask_ipar.runtime.stepprobe import program_cpu

    got = {"program:run": (1.0, 2), "program:start": (0.1, 2), "act:dense_forward": (0.5, 40),
           "bwd:dx_piece": (0.2, 20), "program:push": (0.05, 30), "program:wait": (0.02, 10),
           "program:phase": (0.01, 60)}
    loop, beyond, tasks = program_cpu(got, count_s=1e-4)
    calls = 2 + 2 + 40 + 20 + 30 + 10 + 60
    assert loop == approx(0.9) and tasks == 60
    assert beyond == approx(0.9 - 0.5 - 0.2 - 0.05 - 0.02 - 0.01 - calls * 1e-4)
    assert program_cpu({}, 1e-4) == (0.0, 0.0, 0)  # nothing ran counted


def test_rate_readings_spread_their_rounds_and_runs_over_the_groups(client):
    """The compute rates' readings (session 59): a one-worker matmul reading, the square
    and thin rounds and the kernel-mix runs in :func:`spread` groups, one group when made
    and one each ``take`` (none after the last); one group takes them all back to back.
    The figures are the fastest readings' (the all-workers rate the fastest square round's,
    one worker's no slower than its fastest reading)."""
    from dask_ipar.runtime.rateprobe import RateReadings
    from dask_ipar.runtime.workers import scheduler_workers

    workers = sorted(scheduler_workers(client))
    kw = dict(dtype="float32", matmul_n=512, repeats=2, mix_repeats=1)

    def counts(r):
        return len(r.one), len(r.square), len(r.thin), len(r.mix)

    spread_out = RateReadings(client, workers, workers[0], rounds=3, mix_runs=2, tag="rg3",
                              groups=3, **kw)
    assert counts(spread_out) == (1, 1, 1, 1)
    spread_out.take()
    assert counts(spread_out) == (2, 2, 2, 2)
    spread_out.take()
    assert counts(spread_out) == (3, 3, 3, 2)  # the mix's third group has none
    spread_out.take()
    assert counts(spread_out) == (3, 3, 3, 2)  # every group taken
    lines = []
    flops, cluster, edge, ew, conv = spread_out.rates(lines.append)
    from pytest import approx

    from dask_ipar.kernels.cost_shapes import gemm

    f_sq, e_sq = gemm(512, 512, 512)  # 512-cubed rates scaled to the model's square product
    scale = 1.0 + edge * e_sq / f_sq
    assert cluster == approx(max(spread_out.square) * scale)
    assert flops == approx(max(*spread_out.one, max(spread_out.square) / len(workers)) * scale)
    assert edge >= 0 and ew is not None and ew > 0
    assert any("fastest of 3 rounds spread over the calibration" in line for line in lines)
    at_once = RateReadings(client, workers, workers[0], rounds=2, mix_runs=1, tag="rg1",
                           groups=1, **kw)
    assert counts(at_once) == (1, 2, 2, 1)
    assert not at_once.take() and counts(at_once) == (1, 2, 2, 1)
    lines = []
    at_once.rates(lines.append)
    assert any("fastest of 2 rounds back to back" in line for line in lines), lines
    # groups never taken are read before the figures: none is left out
    left = RateReadings(client, workers, workers[0], rounds=4, mix_runs=1, tag="rg4",
                        groups=4, **kw)
    left.rates(lambda _: None)
    assert counts(left) == (4, 4, 4, 1)
