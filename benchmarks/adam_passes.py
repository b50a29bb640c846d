"""Adam's update of one weight slice: the kernels' row slices against whole-array passes.

    python benchmarks/adam_passes.py [--rows 4096] [--cols 4097] [--threads 1,2] [--repeats 5]
                                     [--batch 1024]

Times ``kernels.adam._moments`` then ``_step`` (AdamW, float32, in place) on a ``rows x
cols`` slice with the kernel threads at each of ``--threads`` (the process's
``OMP_NUM_THREADS``, which ``kernels.threads.kernel_threads`` reads), beside the same
formulas on whole arrays (what ``kernels/adam.py`` ran before session 40), in turns; reports
the best of ``--repeats`` and the peak of the temporaries (``tracemalloc``), and checks that
every variant gives the whole-array bits.

Then the whole update of a slice with its dW product (``dZ`` of ``rows x --batch`` by the
input's ``cols - 1`` rows, the bias the last column) and one remote dW piece, as the engine
runs it on the slice's owner: ``kernels.adam.adam_update`` in place (fused since session 41:
the product by chunks of rows, each finished in cache) against the unfused path it took
before (the whole gradient from ``adam_state``, then ``_step`` on the slice), in turns, the
same threads; the two agree to float32 rounding (the product is made by chunks of rows).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import tracemalloc

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from dask_ipar.kernels import adam  # noqa: E402 (after the path: the repository's)

HP = (0.9, 0.999, 1e-8, 0.01, True)  # beta1, beta2, eps, weight decay, decoupled (AdamW)
LR, T = 1e-3, 3


def whole_arrays(w, state, g, n_decay):
    """The update on whole arrays: each line a pass over the slice, into new temporaries."""
    b1, b2, eps, wd, _ = HP
    m, s = state[0], state[1]
    m *= b1
    m += (1 - b1) * g
    s *= b2
    s += (1 - b2) * (g * g)
    w[:, :n_decay] *= 1 - LR * wd
    w -= (LR / (1 - b1 ** T)) * m / (np.sqrt(s) / math.sqrt(1 - b2 ** T) + eps)


def kernels(w, state, g, n_decay):
    adam._step(w, adam._moments(w, HP, n_decay, state, g), HP, n_decay, LR, T)


def timed(variants, repeats, fresh, same):
    """Best seconds and peak temporaries (``tracemalloc``) of each ``(name, fn, threads)``
    of ``variants`` over ``repeats`` turns, each ``fn(*fresh())`` on fresh copies made
    before the clock starts; ``same(name, data, ref)`` checks a variant's data after it
    against the first variant's (it raises where they differ)."""
    best = {name: math.inf for name, _, _ in variants}
    peak = dict.fromkeys(best, 0)
    ref = None
    for _ in range(repeats):
        for name, fn, threads in variants:
            os.environ["OMP_NUM_THREADS"] = str(threads)
            data = fresh()
            tracemalloc.start()
            t = time.perf_counter()
            fn(*data)
            best[name] = min(best[name], time.perf_counter() - t)
            peak[name] = max(peak[name], tracemalloc.get_traced_memory()[1])
            tracemalloc.stop()
            if ref is None:
                ref = data
            else:
                same(name, data, ref)
    return best, peak


def update_unfused(w, st, args):
    dz, xb, n_in, x, remote = args
    adam._step(w, adam.adam_state(w, HP, n_in, st, dz, xb, 0, n_in + 1, n_in, x, remote), HP,
               n_in, LR, T)


def update_fused(w, st, args):
    dz, xb, n_in, x, remote = args
    adam.adam_update(w, st, HP, n_in, LR, T, True, 0, dz, xb, 0, n_in + 1, n_in, x, remote)


def time_updates(a, rng):
    """The whole update with its dW product, unfused and fused, at each thread count."""
    n_in = a.cols - 1
    w0 = rng.standard_normal((a.rows, a.cols)).astype(np.float32)
    st0 = np.abs(rng.standard_normal((2, a.rows, a.cols))).astype(np.float32)
    args = (rng.standard_normal((a.rows, a.batch)).astype(np.float32), [(0, n_in)], n_in,
            rng.standard_normal((n_in, a.batch)).astype(np.float32),
            rng.standard_normal((a.rows, a.cols)).astype(np.float32))
    variants = [(f"{name}, {n} thread{'s' if n > 1 else ''}", fn, n)
                for n in map(int, a.threads.split(","))
                for name, fn in (("unfused", update_unfused), ("fused", update_fused))]

    def same(name, data, ref):
        if np.abs(data[0] - ref[0]).max() > 1e-5 * np.abs(w0).max():
            raise SystemExit(f"{name}: not the unfused update's values")

    best, peak = timed(variants, a.repeats, lambda: (w0.copy(), st0.copy(), args), same)
    print(f"Adam (AdamW) update with its dW product ({a.rows} x {a.batch} by {a.batch} x "
          f"{n_in}, one remote piece), best of {a.repeats}:")
    for name in best:
        base = best["unfused" + name[name.index(","):]]  # the same threads, unfused
        print(f"- {name}: {best[name] * 1e3:.1f} ms ({best[name] / base:.2f}x the unfused), "
              f"temporaries {peak[name] / 2 ** 20:.1f} MiB at most")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=4096)
    p.add_argument("--cols", type=int, default=4097)
    p.add_argument("--threads", default="1,2")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--batch", type=int, default=1024)
    a = p.parse_args(argv)
    rng = np.random.default_rng(0)
    w0 = rng.standard_normal((a.rows, a.cols)).astype(np.float32)
    g0 = rng.standard_normal((a.rows, a.cols)).astype(np.float32)
    st0 = np.abs(rng.standard_normal((2, a.rows, a.cols))).astype(np.float32)
    n_decay = a.cols - 1  # the last column is the bias
    variants = [("whole arrays", whole_arrays, 1)] + [
        (f"kernels, {n} thread{'s' if n > 1 else ''}", kernels, n)
        for n in map(int, a.threads.split(","))]

    def same(name, data, ref):
        if not (np.array_equal(data[0], ref[0]) and np.array_equal(data[1], ref[1])):
            raise SystemExit(f"{name}: not the whole-array bits")

    best, peak = timed(variants, a.repeats, lambda: (w0.copy(), st0.copy(), g0.copy(), n_decay),
                       same)
    base = best["whole arrays"]
    print(f"Adam (AdamW) update of a {a.rows} x {a.cols} float32 slice, best of {a.repeats}:")
    for name in best:
        print(f"- {name}: {best[name] * 1e3:.1f} ms ({best[name] / base:.2f}x), temporaries "
              f"{peak[name] / 2 ** 20:.1f} MiB at most; the same bits")
    time_updates(a, rng)


if __name__ == "__main__":
    main()
