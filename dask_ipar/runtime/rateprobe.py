"""Probes of the workers' compute rates, for :func:`~dask_ipar.runtime.calibrate.calibrate`.

Its one job: time what a step's kernels do on the cluster's cores, each figure the fastest
of readings spread over a calibration (:class:`RateReadings`):

* the matmul rate of one worker (``flops_per_s``, :func:`matmul_rate`);
* the matmul rate of every worker at once, a square product's and a thin one's
  (``cluster_flops_per_s`` and, from the two, ``gemm_edge_flops``: :func:`cluster_rate`);
* the kernel mix on one worker (``elementwise_Bps``, ``conv_Bps``:
  :func:`~dask_ipar.runtime.kernelmix.mix_rates`).

Back to back, the readings of one figure sample one moment of the machine: on 4 emulated
hosts at 10 Gbit/s (session 58) one calibration's three back-to-back runs read the
element-wise rate 7.4 GB/s, the conv front's 7.3 and the edge 49 flop-equivalents where
the calibration before read 9.1, 8.9 and 29; the steps measured after it ran as fast as
that one's, and all nine of its grids were predicted 1.07-1.24x their steps (0.97-1.12 on
the earlier figures). Spread, as the transports' CPU beside computing
(:class:`~dask_ipar.runtime.linkprobe.BusyReadings`), the fastest reading is the machine's
own, not the moment's.
"""

from __future__ import annotations

import time

import numpy as np

from dask_ipar.kernels.blas import matmul
from dask_ipar.kernels.cost_shapes import GEMM_REF_N, edge_flops, gemm
from dask_ipar.nn.graph import StepGraph
from dask_ipar.runtime.linkprobe import BUSY_GROUPS, spread

__all__ = ["matmul_rate", "matmul_work", "mem_work", "cluster_rate", "one_worker_flops",
           "RateReadings", "THIN"]

#: The thin product ``(m, k, n)`` whose all-workers rate beside the square one's gives
#: ``gemm_edge_flops``.
THIN = (2048, 2048, 128)


def matmul_rate(n, dtype, repeats):
    """Flops per second of the fastest of ``repeats`` ``n``-cubed matmuls (after one)."""
    a = np.random.default_rng(0).standard_normal((n, n)).astype(dtype)
    b = a.copy()
    matmul(a, b)  # warm up (and the first import of the BLAS ipar.matmul picks)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        matmul(a, b)
        best = min(best, time.perf_counter() - t)
    return 2.0 * n ** 3 / best


def _wait_until(start_at):
    if start_at is not None:
        time.sleep(max(0.0, start_at - time.time()))


def matmul_work(shape, dtype, repeats, start_at=None):
    """``(flops, start, stop)`` of ``repeats`` matmuls of ``shape`` (``(m, k, n)``, or
    ``n`` for a square one; wall-clock stamps for a cluster rate), started at ``start_at``
    (a ``time.time()``) where given."""
    m, k, n = (shape,) * 3 if isinstance(shape, int) else shape
    rng = np.random.default_rng(0)
    a = rng.standard_normal((m, k)).astype(dtype)
    b = rng.standard_normal((k, n)).astype(dtype)
    out = np.empty((m, n), dtype)
    matmul(a, b, out)  # the BLAS ipar.matmul picks imported before the clock starts
    _wait_until(start_at)
    t0 = time.time()
    for _ in range(repeats):
        matmul(a, b, out)
    return 2.0 * m * k * n * repeats, t0, time.time()


def mem_work(nbytes, repeats, start_at=None):
    """``(bytes, start, stop)`` of elementwise work into fresh arrays, as the kernels do,
    started at ``start_at`` where given."""
    a = np.ones(nbytes // 4, np.float32)
    b = a.copy()
    _wait_until(start_at)
    t0 = time.time()
    for _ in range(repeats):
        c = a * np.float32(0.5)  # read a, write a fresh c
        c += b  # read c and b, write c
        del c
    return 5 * a.nbytes * repeats, t0, time.time()


def cluster_rate(client, workers, tag, func, *args):
    """Total flops (or bytes) per second of ``func`` on every worker at the same time: all
    of them start at one moment (else the scheduler's dispatch leaves the first ones alone
    for a while, and the rate over the whole span reads low: 8 workers on 2 cores)."""
    g = StepGraph()
    keys = []
    start = time.time() + 0.3 + 0.05 * len(workers)  # after the dispatch and the inputs
    for k, w in enumerate(workers):
        key = (f"calibrate.mm-{tag}", k)
        g.add(key, w, func, *args, start)
        keys.append(key)
    out = client.gather(client.get(g.to_hlg(f"calibrate-mm-{tag}"), keys, sync=False))
    return sum(f for f, _, _ in out) / (max(e for _, _, e in out) - min(s for _, s, _ in out))


def one_worker_flops(readings, cluster, workers: int) -> float:
    """``flops_per_s`` from one worker's matmul ``readings`` and the all-workers rate
    ``cluster`` of ``workers``: the fastest reading, and no less than each worker's share
    of ``cluster`` (one worker alone computes no slower than each of them at once; one
    reading once read 81 GFLOP/s against 93 a worker at once: docs/communication.md)."""
    return float(max(*readings, cluster / workers))


class RateReadings:
    """The compute rates of ``workers`` (``a`` the one-worker figures' worker), read in
    :func:`~dask_ipar.runtime.linkprobe.spread` groups: per group a one-worker matmul
    reading and its share of the ``rounds`` all-workers rounds (a square product's, then a
    thin one's, as many flops each) and of the ``mix_runs`` kernel-mix runs. The first
    group when made (after one warm-up round), one each :meth:`take`, the figures from
    :meth:`rates` once every group is taken."""

    def __init__(self, client, workers, a, *, dtype, matmul_n, repeats, rounds, mix_repeats,
                 mix_runs, tag, groups: int = BUSY_GROUPS):
        self.client, self.workers, self.a, self.tag = client, list(workers), a, tag
        self.dtype, self.n, self.repeats, self.mix_repeats = dtype, matmul_n, repeats, mix_repeats
        m, k, n = THIN  # the thin product: as many flops a round as the square one's
        self.thin_repeats = max(1, round(repeats * matmul_n ** 3 / (m * k * n)))
        self.plan = iter(zip(spread(rounds, groups), spread(mix_runs, groups)))
        self.spread_out = max(1, int(groups)) > 1
        self.one, self.square, self.thin, self.mix = [], [], [], []
        cluster_rate(client, self.workers, tag + "w", matmul_work, 256, dtype, 2)
        self.take()

    def take(self) -> bool:
        """The next group's readings; False once every group is taken."""
        from dask_ipar.runtime.kernelmix import LARGE_IMAGES, kernel_mix

        group = next(self.plan, None)
        if group is None:
            return False
        rounds, mixes = group
        c, w, tag = self.client, self.workers, f"{self.tag}g{len(self.one)}"
        self.one.append(c.submit(matmul_rate, self.n, self.dtype, 3, workers=[self.a],
                                 pure=False).result())
        for r in range(rounds):
            self.square.append(cluster_rate(c, w, f"{tag}s{r}", matmul_work, self.n,
                                            self.dtype, self.repeats))
            self.thin.append(cluster_rate(c, w, f"{tag}t{r}", matmul_work, THIN, self.dtype,
                                          self.thin_repeats))
        self.mix += [c.submit(kernel_mix, self.mix_repeats, images=LARGE_IMAGES,
                              workers=[self.a], pure=False, allow_other_workers=False).result()
                     for _ in range(mixes)]
        return True

    def rates(self, log) -> tuple:
        """``(flops_per_s, cluster_flops_per_s, gemm_edge_flops, elementwise_Bps,
        conv_Bps)``, each from the fastest reading, the matmul rates at the model's square
        product (:data:`~dask_ipar.kernels.cost_shapes.GEMM_REF_N`); each logged with its
        readings. Groups not yet taken are taken first (none is left out)."""
        from dask_ipar.runtime.kernelmix import mix_rates

        while self.take():
            pass

        def listed(rates):
            return ", ".join(f"{r / 1e9:.1f}" for r in rates)

        n, p, (m_th, k_th, n_th) = self.n, len(self.workers), THIN
        cluster, thin = max(self.square), max(self.thin)
        spread_note = ("spread over the calibration ({})" if self.spread_out
                       else "back to back ({})")
        log(f"compute (all {p} workers at once): {cluster / 1e9:.1f} GFLOP/s, the fastest of "
            f"{len(self.square)} rounds " + spread_note.format(listed(self.square)))
        flops = one_worker_flops(self.one, cluster, p)
        log(f"compute ({self.dtype} matmul {n}^3 on one worker): {flops / 1e9:.1f} GFLOP/s "
            f"(readings {listed(self.one)}; all workers' rate over {p}: "
            f"{cluster / p / 1e9:.1f})")
        edge = edge_flops(cluster, n, thin, THIN)
        log(f"compute of a thin product ({m_th} x {k_th} x {n_th}, every worker at once): "
            f"{thin / 1e9:.1f} GFLOP/s (the fastest of {listed(self.thin)}), "
            f"{thin / cluster:.2f} of the square one's: {edge:.0f} flop-equivalents per "
            "element of a product's edge")
        if n != GEMM_REF_N:  # the rates at the model's square product
            f_sq, e_sq = gemm(n, n, n)
            flops, cluster = (r * (1.0 + edge * e_sq / f_sq) for r in (flops, cluster))
        ew, conv = mix_rates(min(self.mix, key=lambda r: r.seconds), flops, edge_flops=edge)
        runs = f"the fastest of {len(self.mix)} runs " + spread_note.format(
            ", ".join(f"{r.seconds * 1e3:.0f} ms" for r in self.mix))
        for what, rate in (("the kernels (conv, pooling and dense kernels", ew),
                           ("the conv front's (its conv and pooling calls", conv)):
            log(f"element-wise rate of {what} on 16 MiB blocks, one worker, {runs}): " + (
                "not measured (the matmul part took the whole time)" if rate is None
                else f"{rate / 1e9:.1f} GB/s"))
        return flops, cluster, edge, ew, conv
