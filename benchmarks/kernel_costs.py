"""Each conv-front kernel's measured time beside the step-time model's cost of it.

    python benchmarks/kernel_costs.py [--batch 16] [--reps 7]

One process, one BLAS thread, float32, the shapes of ``benchmarks/common.py``'s CNN (3x64x64
input, 3x3 convs 32-32-64-64 with 2x2 max pooling) for ``--batch`` images: the conv block
forward and backward, the pooling forward and backward. The model's time of a call is
``flops / rate + bytes / elementwise`` (:mod:`dask_ipar.kernels.costs`,
:mod:`dask_ipar.runtime.stepmodel`), the rate the measured matmul rate of the same process,
``elementwise`` the rate ``dask-ipar calibrate`` measures (its kernel mix, in this process;
``--elementwise GBPS`` to give one, e.g. ``5`` for the default ``ELEMENTWISE_BPS``, also
used where the mix's time is nearly all flops).
Prints a markdown table; the ratio column is model / measured.
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def _median_s(f, *args, reps):
    f(*args)
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        f(*args)
        ts.append(time.perf_counter() - t)
    return float(np.median(ts))


def main(argv=None):
    from threadpoolctl import threadpool_limits

    from dask_ipar.kernels import conv as CK
    from dask_ipar.kernels.costs import kernel_cost, kernel_kind
    from dask_ipar.runtime.kernelmix import LARGE_IMAGES, kernel_mix, mix_rates
    from dask_ipar.runtime.stepmodel import ELEMENTWISE_BPS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--elementwise", type=float, default=None,
                    help="GB/s of element-wise work (default: the kernel mix's, measured)")
    a = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    rows = []
    with threadpool_limits(1):
        m = rng.standard_normal((1024, 1024), dtype=np.float32)
        rate = 2 * 1024 ** 3 / _median_s(lambda: m @ m, reps=a.reps)
        if a.elementwise:
            ew = conv = a.elementwise * 1e9
        else:  # as calibrate: the fastest of three runs of the mix on 16 MiB blocks
            mixes = [kernel_mix(1, images=LARGE_IMAGES) for _ in range(3)]
            ew, conv = mix_rates(min(mixes, key=lambda r: r.seconds), rate)
            ew = ew or ELEMENTWISE_BPS
            conv = conv or ew

        def cost(func, *args):
            shape = lambda v: tuple(v.shape) if isinstance(v, np.ndarray) else None  # noqa: E731
            _, flops, nbytes, _ = kernel_cost(func, args, shape, 4)
            return flops / rate + nbytes / (conv if kernel_kind(func) == "conv" else ew)

        c, h = 3, 64
        for k, o in enumerate((32, 32, 64, 64)):
            x = rng.standard_normal((a.batch, c, h, h), dtype=np.float32)
            wm = rng.standard_normal((o, c * 9 + 1), dtype=np.float32)
            ws, pad = (o, c, 3, 3), (1, 1, 1, 1)
            y = CK.conv_block(x, wm, ws, 1, pad, 1, "relu")
            p = CK.pool_block(y, 2, None, (0, 0, 0, 0), "max")
            calls = [
                (f"conv{k} forward", CK.conv_block, (x, wm, ws, 1, pad, 1, "relu")),
                (f"conv{k} backward", CK.conv_block_backward,
                 (x, wm, y, y, ws, 1, pad, 1, "relu", k > 0)),
                (f"pool{k} forward", CK.pool_block, (y, 2, None, (0, 0, 0, 0), "max")),
                (f"pool{k} backward", CK.pool_block_backward,
                 (y, p, 2, None, (0, 0, 0, 0), "max")),
            ]
            for name, f, args in calls:
                meas = _median_s(f, *args, reps=a.reps)
                rows.append((name, meas, cost(f, *args)))
            c, h = o, h // 2
    print(f"matmul rate {rate / 1e9:.1f} GFLOP/s (one thread), elementwise "
          f"{ew / 1e9:.1f} GB/s, batch {a.batch}\n")
    print("| kernel | measured (ms) | model (ms) | model / measured |")
    print("|---|---|---|---|")
    for name, meas, model in rows:
        print(f"| {name} | {meas * 1e3:.2f} | {model * 1e3:.2f} | {model / meas:.2f} |")
    tot_m, tot_p = sum(r[1] for r in rows), sum(r[2] for r in rows)
    print(f"| all | {tot_m * 1e3:.2f} | {tot_p * 1e3:.2f} | {tot_p / tot_m:.2f} |")


if __name__ == "__main__":
    main()
