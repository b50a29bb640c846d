"""The kernel mix behind the calibrated element-wise rate (``dask_ipar.runtime.kernelmix``)."""

from __future__ import annotations

import numpy as np
import pytest

from dask_ipar.kernels.costs import kernel_cost
from dask_ipar.runtime.kernelmix import (
    IMAGES,
    LARGE_IMAGES,
    elementwise_rate,
    elementwise_rates,
    kernel_calls,
    kernel_mix,
    mix_split,
)

pytestmark = pytest.mark.fast


def test_the_mix_counts_its_kernels_model_costs_and_times_them():
    flops1, mem1, s1 = kernel_mix(1)
    flops3, mem3, s3 = kernel_mix(3)
    assert flops3 == pytest.approx(3 * flops1) and mem3 == pytest.approx(3 * mem1)
    assert 0 < s1 and 0 < s3
    # the counts are the cost model's own, call by call, as the simulator charges a task
    want_f = want_m = 0.0
    for f, args in kernel_calls("float32"):
        _, fl, mb, _ = kernel_cost(f, args, lambda v: tuple(v.shape)
                                if isinstance(v, np.ndarray) else None, 4)
        want_f, want_m = want_f + fl, want_m + mb
    assert (flops1, mem1) == pytest.approx((want_f, want_m))
    # the mix is mostly element-wise work: the conv, pooling and short dense kernels
    assert mem1 > 1e8 and flops1 > 1e8


def test_elementwise_rate_makes_the_model_time_equal_the_measured_time():
    flops, mem, seconds, rate = 1e9, 2e9, 0.5, 2e10
    for speed in (1.0, 0.25):
        e = elementwise_rate(flops, mem, seconds, rate, speed)
        # the simulator's time of the run at that share of the cores
        assert (flops / rate + mem / e) / speed == pytest.approx(seconds)
    # the flops alone take the whole time (or more): no rate can be read off
    assert elementwise_rate(flops, mem, flops / rate, rate) is None
    assert elementwise_rate(flops, mem, 0.5 * flops / rate, rate) is None


def test_two_sizes_of_the_mix_give_the_small_and_the_large_blocks_rates():
    # the mix's bytes by its calls' largest arrays: the 4 MiB conv block at the small
    # size, its dense forward's 16 MiB output at the large; the 16 MiB conv block all large
    f16, a16, b16 = mix_split("float32", IMAGES)
    f64, a64, b64 = mix_split("float32", LARGE_IMAGES)
    assert a16 > 2 * b16 > 0 and a64 == 0 and b64 > a16 + b16 and f64 > f16
    # runs timed as the model would time them at known rates: the rates come back
    rate, small, large = 1e11, 1.8e10, 1.5e10
    runs = [(f * k, (a + b) * k, f * k / rate + a * k / small + b * k / large)
            for (f, a, b), k in (((f16, a16, b16), 2), ((f64, a64, b64), 1))]
    assert elementwise_rates(*runs, rate) == pytest.approx((small, large))
    # no positive solution (the large run took less than its flops alone): one rate, the
    # small run's
    fast = (runs[1][0], runs[1][1], 0.9 * runs[1][0] / rate)
    assert elementwise_rates(runs[0], fast, rate) == (elementwise_rate(*runs[0], rate), None)
    # the large mix runs (its conv block on 16 MiB)
    assert kernel_calls("float32", LARGE_IMAGES)[0][1][0].nbytes == 16 * 2**20


def test_the_mix_solved_with_its_products_edge_priced():
    """With ``gemm_edge_flops`` the mix's products cost their flops and their edge's
    flop-equivalents (as the step model charges them); runs timed that way give the rates
    back, and the edge-free solve of the same runs reads the element-wise work slower."""
    e = 90.0
    f16, a16, b16 = mix_split("float32", IMAGES)
    f64, a64, b64 = mix_split("float32", LARGE_IMAGES)
    g16, g64 = (mix_split("float32", n, e)[0] for n in (IMAGES, LARGE_IMAGES))
    # the mix's dense kernels are thin products (64 rows): their edge costs time
    assert g16 > f16 and g64 - f64 == pytest.approx(g16 - f16)
    rate, small, large = 1e11, 1.8e10, 1.5e10
    runs = [(f * k, (a + b) * k, g * k / rate + a * k / small + b * k / large)
            for (f, g, a, b), k in (((f16, g16, a16, b16), 2), ((f64, g64, a64, b64), 1))]
    assert elementwise_rates(*runs, rate, edge_flops=e) == pytest.approx((small, large))
    plain = elementwise_rates(*runs, rate)
    assert plain[0] < small and plain[1] < large
