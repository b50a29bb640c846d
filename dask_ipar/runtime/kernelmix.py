"""The engine's own element-wise-heavy kernels as a calibration workload.

``dask-ipar calibrate`` runs :func:`kernel_mix` on a worker and turns its time into the
step-time model's element-wise rates (:func:`mix_rates`): the rate at which the
model's counted memory passes (:mod:`dask_ipar.kernels.costs`) go, in the simulator's own
terms. A fixed copy benchmark would not do: the kernels' strided im2col gathers, pooling
windows and in-place sums run at a fraction of what a plain ``a * s + b`` reaches (this
machine: 15 GB/s of the model's bytes against 50-80 GB/s), and so does a fixed rate in the
code (5 GB/s: the CNN's conv front priced at 2.3x its measured time).

The mix: a conv block forward and backward with its 2x2 max pooling (32 channels, 16
images of 32 x 64, the size of a strip of the CNN benchmark's second stage: arrays that do
not stay in cache; with an eighth of the conv input and a quarter of the dense blocks the
rate read 22 GB/s), and a dense block forward (ReLU, bias) whose contraction is short, so
that its passes over the output dominate, with the reduce of a dX reduce-scatter (two
remote pieces summed, then ReLU').

``dask-ipar calibrate`` runs it with its conv block on 64 images (:data:`LARGE_IMAGES`: 16
MiB blocks, which stream from memory) and prices every kernel's bytes at that one rate
(session 52). Two sizes before, 4 MiB and 16 MiB, solved for a rate each: the step model
then priced the small blocks of the CNN's domain-parallel strips at the small size's rate,
which workers sharing a machine's cores do not reach (the CNN's Pr > 1 grids on 2 and 4
emulated hosts ran 8-22% slower than predicted, the small rate's solve moved 7.4-12.8 GB/s
run to run, the large one 8.2-9.8).

Its conv and pooling calls are timed apart as well: the conv front's strided kernels run at
a rate of their own (:func:`mix_rates`' second; 2 loopback workers of this machine: 0.98
of the whole mix's rate, whose bytes they hold 93% of), which the step model charges them
(:class:`dask_ipar.cost.Machine`'s ``conv_Bps``).
"""

from __future__ import annotations

import time
from typing import NamedTuple

import numpy as np

__all__ = ["kernel_mix", "kernel_calls", "elementwise_rate", "mix_rates", "MixRun", "IMAGES",
           "LARGE_IMAGES"]

XSHAPE = (16, 32, 32, 64)
DENSE = (64, 4096, 1024)
#: images of the conv block: the mix's small size (4 MiB blocks of float32: the default of
#: the benchmarks that run it) and its large one (16 MiB, the dense block unchanged), the
#: calibration's: :data:`dask_ipar.cost.machine.ELEMENTWISE_BLOCKS`
IMAGES, LARGE_IMAGES = XSHAPE[0], 4 * XSHAPE[0]


def kernel_calls(dtype, images=IMAGES):
    """``[(kernel, args)]`` of one round of the mix (inputs made once per call), its conv
    block on ``images`` images."""
    from dask_ipar.kernels import conv as CK
    from dask_ipar.kernels import dense as DK

    rng = np.random.default_rng(0)
    dt = np.dtype(dtype)

    def values(*shape):
        return _values(rng, shape, dt)

    x = values(images, *XSHAPE[1:])
    wm = values(32, 32 * 9 + 1)
    ws, pad = (32, 32, 3, 3), (1, 1, 1, 1)
    y = CK.conv_block(x, wm, ws, 1, pad, 1, "relu")
    p = CK.pool_block(y, 2, None, (0, 0, 0, 0), "max")
    n_in, rows, b = DENSE
    w = values(rows, n_in + 1)
    xd = values(n_in, b)
    # a block row of a layer twice as wide, of which the dX piece reads the first ``rows``
    # columns: the rest is never touched (nor paid for). Uniform values, drawn in half a
    # normal draw's time: the mix's largest input, and a product's time does not depend
    # on its values (a whole round, uniform against normal inputs: 97.9 against 97.6 ms)
    wk = np.empty((rows, 2 * rows + 1), dtype=dt)
    wk[:, :rows] = _values(rng, (rows, rows), dt, rng.random)
    wk[:, :rows] -= 0.5
    dz = values(rows, b // 8)
    a = np.abs(values(rows, b // 8))
    pieces = [values(rows, b // 8) for _ in range(2)]
    return [
        (CK.conv_block, (x, wm, ws, 1, pad, 1, "relu")),
        (CK.conv_block_backward, (x, wm, y, y, ws, 1, pad, 1, "relu", True)),
        (CK.pool_block, (y, 2, None, (0, 0, 0, 0), "max")),
        (CK.pool_block_backward, (y, p, 2, None, (0, 0, 0, 0), "max")),
        (DK.dense_forward, ([(0, n_in + 1)], [(0, n_in)], n_in, "relu", w, xd)),
        (DK.dz_from_pieces, (a, "relu", [(0, 2 * rows + 1)], 0, rows, dz, wk, *pieces)),
    ]


def _values(rng, shape, dt, draw=None):
    """Values of ``shape`` and ``dt`` from ``draw`` (a method of ``rng``; default standard
    normal), drawn in ``dt`` where NumPy can (a float64 draw cast down took 2-3x as long:
    the mix's inputs are built on every worker for every probe, 8 workers sharing 2
    cores). Normal by default, as before: some kernels' time depends on their values (max
    pooling's backward, docs/benchmarks.md, session 37)."""
    draw = draw or rng.standard_normal
    if dt in (np.float32, np.float64):
        return draw(shape, dtype=dt)
    return draw(shape).astype(dt)


def _shape(v):
    return tuple(v.shape) if isinstance(v, np.ndarray) else None


class MixRun(NamedTuple):
    """One run of :func:`kernel_mix`: the model's flops and memory bytes of its calls and
    the wall time they took, for the whole mix and for its conv front's calls alone (the
    conv and pooling kernels, :func:`dask_ipar.kernels.costs.kernel_kind` ``"conv"``)."""

    flops: float
    mem_bytes: float
    seconds: float
    conv_flops: float = 0.0
    conv_mem_bytes: float = 0.0
    conv_seconds: float = 0.0
    #: the products' edge (:func:`dask_ipar.kernels.cost_shapes.gemm`), all the calls'
    edge: float = 0.0


def _costs(calls, itemsize):
    """``[(flops, edge, mem, conv)]`` of each of ``calls`` by the cost model: its flops, its
    products' edge (priced by the step model at ``gemm_edge_flops`` per element), its memory
    bytes, and whether it is one of the conv front's (:func:`~dask_ipar.kernels.costs.kernel_kind`
    ``"conv"``)."""
    from dask_ipar.kernels.costs import kernel_cost, kernel_kind

    out = []
    for f, args in calls:
        _, flops, mem, edge = kernel_cost(f, args, _shape, itemsize)
        out.append((flops, edge, mem, kernel_kind(f) == "conv"))
    return out


def kernel_mix(repeats: int, dtype="float32", images=IMAGES):
    """Run the mix ``repeats`` times in this process (with its BLAS threads as they are:
    a worker's, one per worker thread), its conv block on ``images`` images; returns a
    :class:`MixRun`: the model's flops, products' edge and memory bytes of the calls
    (:func:`dask_ipar.kernels.costs.kernel_cost`) and the wall time they took, and the
    same of its conv front's calls, each call timed."""
    calls = kernel_calls(dtype, images)
    costs = _costs(calls, np.dtype(dtype).itemsize)
    conv = [c[3] for c in costs]
    flops, edge, mem = (sum(c[k] for c in costs) for k in range(3))
    c_flops, c_mem = (sum(c[k] for c in costs if c[3]) for k in (0, 2))
    for f, args in calls:  # warm: the first call of a kernel allocates and imports
        f(*args)
    clock = time.perf_counter
    conv_s = 0.0
    t = clock()
    for _ in range(repeats):
        for (f, args), is_conv in zip(calls, conv):
            t0 = clock()
            f(*args)
            if is_conv:
                conv_s += clock() - t0
    seconds = clock() - t
    return MixRun(flops * repeats, mem * repeats, seconds, c_flops * repeats, c_mem * repeats,
                  conv_s, edge * repeats)


def mix_rates(run, flops_per_s, edge_flops=0.0):
    """``(elementwise, conv)``: the element-wise rates of a :func:`kernel_mix` run
    (:class:`MixRun`), as ``dask-ipar calibrate`` reads them from a run on
    :data:`LARGE_IMAGES` (:class:`dask_ipar.cost.Machine`'s ``elementwise_Bps`` and
    ``conv_Bps``): the whole mix's, its products' flops with ``edge_flops`` per element of
    their edge (the machine's ``gemm_edge_flops``), and its conv and pooling calls' alone
    (their products have no edge); each :func:`elementwise_rate` (None where the flops take
    the time). The conv calls hold most of the mix's bytes (93% on 16 MiB), so the two
    rates differ by what the dense calls add."""
    priced = run.flops + edge_flops * run.edge
    return (elementwise_rate(priced, run.mem_bytes, run.seconds, flops_per_s),
            elementwise_rate(run.conv_flops, run.conv_mem_bytes, run.conv_seconds,
                             flops_per_s))


def elementwise_rate(flops, mem_bytes, seconds, flops_per_s, speed=1.0):
    """Bytes per second of element-wise work that make the model's time of a kernel-mix
    run, ``flops / flops_per_s + mem_bytes / rate``, times ``1 / speed`` (each worker's
    share of the cores while all of them compute: the simulator's processor sharing, the
    cluster matmul rate over the workers' one-worker rates), equal to the measured
    ``seconds``. None where the matmul part takes 95% of the measured time or more (the
    rest is then noise, or the model's flops, not its bytes, are off)."""
    left = seconds * speed - flops / flops_per_s
    if left <= 0.05 * seconds * speed:
        return None
    return mem_bytes / left
